"""How an exception reads in a message for the user.

Messages written for users name the input and the problem: those of the project's own exception
classes, of the ValueErrors its code raises for bad input, and of an OSError that names its file.
Anything else (a library's error, a bug in this code) is shown with its type, which is often the
only clue to what went wrong.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


def user_facing(err: BaseException) -> bool:
    """Whether `err`'s message explains itself to a user (see the module's docstring)."""
    return _ours(err) or _names_a_file(err)


def reason(err: BaseException) -> str:
    """`err` as a clause for a message: its message if it explains itself, else `Type: message`."""
    if _ours(err):
        return str(err)
    if _names_a_file(err):
        return f"{err.filename}: {err.strerror}"
    return f"{type(err).__name__}: {err}"


def _ours(err: BaseException) -> bool:
    if type(err).__module__.split(".")[0] == PACKAGE.name:
        return True
    return isinstance(err, ValueError) and _raised_in_package(err)


def _raised_in_package(err: BaseException) -> bool:
    """Whether the innermost frame of `err`'s traceback is this package's code."""
    frame = err.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and Path(frame.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def _names_a_file(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.filename is not None and bool(err.strerror)
