"""The package's exceptions, and how one reads in a message for the user.

Every error this package raises on purpose is a `BionemoExportError`. Its `UserError` branch is
what the user can act on (a bad input, a setting that cannot work, a file that is not what it
should be, a server that refused): the message, written for them, names the input, the problem and
the fix, and is shown as is. The class decides, not where the error was raised. Anything else (a
library's error, a bug here) is shown with its type, which is often the only clue to what went
wrong; so is an OSError, unless it names its file ("x: No such file or directory" explains itself).

Error classes keep the built-in class callers catch (`class DeployError(UserError, ValueError)`),
so that `except ValueError` around a library call goes on working.

Settings in messages: a library error names the settings it is about by their field names
(`ServingOptions.max_batch_size`, `BuildRequest.backend`), in backticks: "`backend` tensorrt runs
on gpu, not cpu: pass `device` gpu". `str(err)` shows them so; a front end words them as its own
with `reason(err, name_of)`: the command line turns them into its flags ("--backend tensorrt runs on
gpu, not cpu: pass --device gpu", cli/__init__.py), in one place.

The served package copied into generated repositories (serving/, tokenizers and search included)
import only the standard library and numpy, not this module: their errors for bad input are listed
in `STANDALONE_USER_ERRORS` instead of deriving from `UserError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

FIELD = re.compile(r"`([a-z][a-z0-9_]*)`")
"""A setting named in a message by its field name, in backticks."""

STANDALONE_USER_ERRORS = frozenset({
    ("bionemo_export.serving.tokenizers.character", "TokenizationError"),
    ("bionemo_export.serving.windows", "WindowError"),
    ("bionemo_export.serving.scoring", "ScoringError"),
    ("bionemo_export.serving.search", "GenerationError"),
})
"""(module, class) of the user errors of modules that cannot import this one (see the docstring)."""


class BionemoExportError(Exception):
    """Base of every error this package raises on purpose."""


class UserError(BionemoExportError):
    """An error the user can act on: its message, written for them, is shown as is (settings named
    by field, in backticks, are worded by the front end: `reason`)."""


class InvalidInputError(UserError, ValueError):
    """A value, name or file the user gave that cannot be used (an unknown family, a malformed
    input file, a number out of range), where no more specific error class says more."""


def user_facing(err: BaseException) -> bool:
    """Whether `err`'s message explains itself to a user (see the module's docstring)."""
    return _for_user(err) or _names_a_file(err)


def reason(err: BaseException, name_of: Callable[[str], str | None] | None = None) -> str:
    """`err` as a clause for a message: its message if it explains itself, else `Type: message`.
    `name_of` words the settings a user error names (a field name -> the front end's name for it,
    None to leave one as it is)."""
    if _for_user(err):
        return worded(str(err), name_of) if name_of is not None else str(err)
    if _names_a_file(err):
        assert isinstance(err, OSError)  # _names_a_file checked it
        return f"{err.filename}: {err.strerror}"
    return f"{type(err).__name__}: {err}"


def worded(message: str, name_of: Callable[[str], str | None]) -> str:
    """`message` with each setting it names in backticks (`max_batch_size`) replaced by
    `name_of(field)`; one `name_of` does not know keeps its backticks."""
    return FIELD.sub(lambda match: name_of(match.group(1)) or match.group(0), message)


def _for_user(err: BaseException) -> bool:
    return isinstance(err, UserError) or any((cls.__module__, cls.__qualname__) in STANDALONE_USER_ERRORS
                                             for cls in type(err).__mro__)


def _names_a_file(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.filename is not None and bool(err.strerror)
