"""Digests of a repository's files: recorded in manifest.json by the build, checked before serving.

Why: a repository whose files changed after the build (a bad copy, a disk or transfer error, a
hand edit) mostly still loads. Changed bytes inside an encoder's weights leave a graph that Triton
loads, that becomes ready and that `health` finds answering, with every answer wrong. Only a
comparison with what the build wrote tells, so the build records a sha256 of every file it writes
(manifest.json's `files`: relative path -> {"sha256", "bytes"}; manifest.json itself aside) and
`serve`, `verify` and `repo push` compare the files with it first.

What is checked:
- every recorded file: present, same size, same sha256 ("changed", "missing");
- inside the model folders the build wrote, files it did not write: Triton loads what is in a
  model's folder (a `2/` version folder added beside `1/` is served instead of it), so they are
  reported too, except what serving itself writes there (`__pycache__/`, `*.pyc`: the Python
  backend compiles model.py and its modules) and hidden files (`.DS_Store`, editors' droppings);
- not: files outside the built model folders (notes, `engines build`'s timing cache), and model
  folders the build did not write (a user may serve their own models beside the built ones): the
  summary line names those as not checked.

A repository without recorded digests (built before they were, or written by hand) is served with
a one-line note, not refused. Sizes are compared first, so a truncated file costs no hashing;
contents are hashed in 1 MiB reads (digests.file_digest; about 1 GB/s for sha256 on one core).

Standard library only: serve, verify and repo push run it on hosts without torch or protobuf.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from bionemo_export.digests import file_digest
from bionemo_export.errors import UserError

from .manifest import MANIFEST_NAME, Manifest, ManifestError

FIX = "rebuild the repository or pass --no-check"
"""What to do about any problem: the record is the build's, so only a build (or opting out) helps."""


class IntegrityError(UserError, ValueError):
    """A repository's files differ from the digests its manifest.json records; the message names
    each file and the problem, and says what to do."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        if len(problems) == 1:
            message = f"{problems[0]}; {FIX}"
        else:
            message = (f"{len(problems)} files differ from what the build recorded:\n  " + "\n  ".join(problems)
                       + f"\n{FIX}")
        super().__init__(message)


def _ignored(relative: PurePosixPath) -> bool:
    """Files that are never recorded nor reported: what the Python backend writes when it imports
    model.py (`__pycache__/`, `*.pyc`) and hidden files."""
    return relative.suffix == ".pyc" or any(part == "__pycache__" or part.startswith(".") for part in relative.parts)


def _files_under(root: Path, folder: Path) -> Iterator[PurePosixPath]:
    """Every file under `folder`, relative to `root`, ignored ones left out."""
    for directory, subdirectories, names in os.walk(folder):
        subdirectories.sort()
        for name in sorted(names):
            relative = PurePosixPath(Path(directory, name).relative_to(root).as_posix())
            if not _ignored(relative):
                yield relative


def record_files(root: Path) -> dict[str, dict[str, Any]]:
    """The digests of every file under `root` (a repository just written) except manifest.json:
    what the build stores in manifest.json's `files`."""
    return {str(relative): file_digest(root / relative)
            for relative in sorted(_files_under(root, root), key=str) if str(relative) != MANIFEST_NAME}


def update_records(files: dict[str, dict[str, Any]], root: Path,
                   written: Iterable[str]) -> dict[str, dict[str, Any]]:
    """`files` with the digests of the files `written` (relative to `root`) replaced or added, for a
    step that adds to a built repository (runtime/engines.py). The other records are kept, not
    recomputed, so a file that changed before the step is still reported. A repository without
    records stays without: a partial record would report every file it lacks as added."""
    if not files:
        return {}
    return {**files, **{name: file_digest(root / name) for name in written}}


@dataclass(frozen=True)
class FileCheck:
    """What comparing a repository's files with its manifest.json found."""

    root: Path
    recorded: int
    """Files manifest.json records; 0: none (the check could not tell anything)."""
    bytes: int = 0
    """Bytes hashed."""
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)
    """One line per file: its path, and what is wrong."""
    unchecked_models: list[str] = field(default_factory=list)
    """Model folders (with a config.pbtxt) that the build did not write: served, not checked."""
    note: str | None = None
    """Why nothing was checked, when nothing was."""

    @property
    def summary(self) -> str:
        """One line for the user: what was checked (or why nothing was), and how long it took."""
        if self.note:
            return f"note: {self.note}"
        line = (f"files: {self.recorded} match {self.root / MANIFEST_NAME} "
                f"({self.bytes / 1e6:.1f} MB hashed in {self.seconds:.2f} s)")
        if self.unchecked_models:
            line += f"; not built with it, not checked: {', '.join(self.unchecked_models)}"
        return line


def check_files(root: Path) -> FileCheck:
    """Compare the files of repository `root` with the digests its manifest.json records (see the
    module docstring). Raises IntegrityError when manifest.json itself cannot be read: it is the
    record, and a repository whose record is broken cannot be told intact."""
    root = Path(root)
    started = time.perf_counter()
    if not (root / MANIFEST_NAME).is_file():
        return FileCheck(root, 0, note=f"{root} has no {MANIFEST_NAME} (not built by bionemo-export): "
                                       "its files are not checked against a build's digests")
    try:
        recorded = Manifest.read(root).files
    except ManifestError as err:
        raise IntegrityError([str(err)]) from None
    if not recorded:
        return FileCheck(root, 0, note=f"{root / MANIFEST_NAME} records no file digests (built before "
                                       "bionemo-export recorded them, or by hand): its files are not checked; "
                                       "rebuild it to have them checked")
    problems: list[str] = []
    hashed = 0
    for name, record in recorded.items():
        relative = PurePosixPath(name)
        if relative.is_absolute() or ".." in relative.parts or not relative.parts:
            problems.append(f"{root / MANIFEST_NAME} records {name!r}, which is not a path inside the repository")
            continue
        if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
                and isinstance(record.get("bytes"), int)):
            problems.append(f"{root / MANIFEST_NAME} records no valid digest for {name} ({record!r})")
            continue
        problem, size = _compare(root / relative, record)
        hashed += size
        if problem:
            problems.append(problem)
    built_models = sorted({PurePosixPath(name).parts[0] for name in recorded if len(PurePosixPath(name).parts) > 1})
    for model in built_models:
        if (root / model).is_dir():
            problems += [f"{root / relative} was not written by the build (Triton loads what is in a model's folder)"
                         for relative in _files_under(root, root / model) if str(relative) not in recorded]
    unchecked = sorted(child.name for child in root.iterdir() if child.is_dir() and child.name not in built_models
                       and (child / "config.pbtxt").is_file())
    return FileCheck(root, len(recorded), hashed, time.perf_counter() - started, problems, unchecked)


def _compare(path: Path, record: dict[str, Any]) -> tuple[str | None, int]:
    """(what is wrong with `path` against its record, or None; the bytes hashed)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing (the build wrote it: {record['bytes']} bytes)", 0
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})", 0
    if size != record["bytes"]:  # no need to hash it
        return f"{path} changed since the build ({size} bytes, recorded {record['bytes']})", 0
    try:
        found = file_digest(path)["sha256"]
    except OSError as err:
        return f"{path} cannot be read ({err.strerror})", 0
    if found != record["sha256"]:
        return f"{path} changed since the build (sha256 {found[:16]}..., recorded {record['sha256'][:16]}...)", size
    return None, size


def check_repository_files(root: Path) -> list[str]:
    """The problems `check_files` finds: one line per changed, missing or added file; [] when the
    files match their digests, or when none are recorded."""
    return check_files(root).problems


def require_intact(root: Path) -> str:
    """Raise IntegrityError naming every file of `root` that differs from its recorded digest;
    otherwise return the one line to show the user (what was checked, or the note saying why
    nothing was)."""
    found = check_files(root)
    if found.problems:
        raise IntegrityError(found.problems)
    return found.summary
