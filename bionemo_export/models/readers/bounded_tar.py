"""A tar archive read without extracting it, bounded in time and memory whatever it holds: the
`.nemo` reader's archive layer (nemo.py reads model_config.yaml and the weights through it).

- the archive is never extracted to disk; members with absolute or `..` paths, links, devices and
  sparse files are refused; the declared sizes are bounded, and so is what a gzip'd archive
  expands to (headers included), checked member by member before tarfile skips to the next one;
- tar extension headers (GNU long names, pax records) are bounded before tarfile reads them
  (`BoundedTarInfo`): tarfile itself reads a header's whole declared payload into memory.

Importable without torch: the standard library only, and the readers' CheckpointError.
"""

from __future__ import annotations

import os
import posixpath
import tarfile
import zlib
from pathlib import Path
from typing import Any

from .base import CheckpointError

MAX_MEMBERS = 10_000
MAX_UNPACKED_BYTES = int(os.environ.get("BIONEMO_EXPORT_NEMO_MAX_BYTES", 256 << 30))
"""Most bytes a .nemo may declare in all (the largest BioNeMo models are ~12 GB)."""
MAX_EXPANSION = 20
"""Most a gzip'd archive may expand relative to its size (weights compress by ~10%, not 20x)."""
MAX_NAME_BYTES = 4096
"""Longest member name (or link target) in bytes: PATH_MAX; NeMo's are `<uuid>_<file>`."""
MAX_PAX_HEADER_BYTES = 64 << 10
"""Largest pax extended header ('x'/'g'); Python's tarfile writes a few hundred bytes per member."""
MAX_HEADER_BYTES_IN_ALL = 1 << 20
"""Most bytes of extension headers (long names, pax records) in a whole archive."""
MAX_HEADERS_IN_A_ROW = 8
"""Most extension headers before one member (tarfile writes at most two: a long name and a long link)."""
MAX_PAX_RECORDS = 64
"""Most pax records that apply to one member (tarfile copies global ones into every member)."""


class RefusedArchive(Exception):
    """A header that the bounded tar reader refuses; the caller names the archive (`NemoReader.read`). Not a
    TarError (tarfile.open would try the next compression and hide it) nor an OSError (gzopen
    would turn it into "not a gzip file")."""


def _shown_name(name: str) -> str:
    """A member name for a message: quoted on one line, at most 80 characters."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


def _name_bytes(name: str) -> int:
    return len(name.encode("utf-8", "surrogateescape"))


class BoundedTarInfo(tarfile.TarInfo):
    """tarfile's TarInfo with every header bounded before tarfile reads what it declares.

    TarFile reads a GNU long name ('L'/'K') or a pax header ('x'/'g') whole into memory and
    follows chains of them recursively; sparse members make it read maps of any length. These
    private hooks of tarfile (checked to exist by `open_archive`) refuse them first."""

    def _proc_member(self, archive: BoundedTarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise RefusedArchive(f"member {_shown_name(self.name)} declares a negative size")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise RefusedArchive(f"member {_shown_name(self.name)} is a sparse file")
        if self.type in _EXTENSION_TYPES:
            _count_extension_header(self, archive)
        else:
            archive.headers_in_a_row = 0
        try:
            member = super()._proc_member(archive)  # pyright: ignore[reportAttributeAccessIssue] - tarfile's private hook
        except (ValueError, IndexError) as err:  # tarfile's parsers assume well-formed numbers and maps
            reason = " ".join(str(err).split())[:200]
            raise RefusedArchive(f"malformed tar header near byte {self.offset} ({reason})") from None
        _check_member(member)
        return member

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        if len(pax_headers) > MAX_PAX_RECORDS:
            raise RefusedArchive(f"member {_shown_name(self.name)} has {len(pax_headers)} pax records "
                                  f"(the most a member may have is {MAX_PAX_RECORDS})")
        super()._apply_pax_info(pax_headers, encoding, errors)  # pyright: ignore[reportAttributeAccessIssue] - private

    def _refuse_sparse(self, next_member: tarfile.TarInfo, *args: Any) -> None:
        raise RefusedArchive(f"member {_shown_name(next_member.name)} is a sparse file (pax GNU.sparse records)")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


_EXTENSION_TYPES = {tarfile.GNUTYPE_LONGNAME: "GNU long name", tarfile.GNUTYPE_LONGLINK: "GNU long link name",
                    tarfile.XHDTYPE: "pax extended header", tarfile.XGLTYPE: "pax global header",
                    tarfile.SOLARIS_XHDTYPE: "Solaris extended header"}
TAR_HOOKS = ("_proc_member", "_apply_pax_info", "_proc_gnusparse_00", "_proc_gnusparse_01", "_proc_gnusparse_10")
"""The private TarInfo methods that `BoundedTarInfo` overrides; without them it bounds nothing."""


def _count_extension_header(header: tarfile.TarInfo, archive: BoundedTarFile) -> None:
    """Refuse an extension header whose payload, or the archive's in all, is over the limits,
    before tarfile reads the payload."""
    kind = _EXTENSION_TYPES[header.type]
    is_name = header.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
    limit = MAX_NAME_BYTES + 1 if is_name else MAX_PAX_HEADER_BYTES  # a long name ends with a NUL
    if header.size > limit:
        what = "member names" if is_name else "pax headers"
        raise RefusedArchive(f"a {kind} at byte {header.offset} declares {header.size} bytes "
                              f"(the most for {what} is {limit})")
    archive.headers_in_a_row += 1
    if archive.headers_in_a_row > MAX_HEADERS_IN_A_ROW:
        raise RefusedArchive(f"more than {MAX_HEADERS_IN_A_ROW} extension headers in a row at byte {header.offset}")
    archive.header_bytes += header.size
    if archive.header_bytes > MAX_HEADER_BYTES_IN_ALL:
        raise RefusedArchive(f"its extension headers (long names, pax records) hold more than "
                              f"{MAX_HEADER_BYTES_IN_ALL} bytes in all")


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse a member (as extension headers left it) with an over-long name or a negative size."""
    for what, name in (("name", member.name), ("link target", member.linkname)):
        if _name_bytes(name) > MAX_NAME_BYTES:
            raise RefusedArchive(f"a member's {what} is {_name_bytes(name)} bytes long "
                                  f"(the most is {MAX_NAME_BYTES}): {_shown_name(name)}")
    if member.size < 0:
        raise RefusedArchive(f"member {_shown_name(member.name)} declares a negative size")


class BoundedTarFile(tarfile.TarFile):
    """A TarFile that reads members as `BoundedTarInfo` and keeps the counts they check."""

    tarinfo = BoundedTarInfo
    headers_in_a_row = 0
    """Extension headers read since the last member."""
    header_bytes = 0
    """Bytes of extension headers read so far."""


def open_archive(path: Path) -> tarfile.TarFile:
    """`path` opened for reading (plain or compressed) with every header bounded."""
    if missing := [hook for hook in TAR_HOOKS if not hasattr(tarfile.TarInfo, hook)]:
        raise CheckpointError(f"cannot read {path} safely: this Python's tarfile has no {', '.join(missing)}, which "
                              "the .nemo reader overrides to bound tar headers; use Python 3.10 to 3.13")
    return BoundedTarFile.open(path, "r:*")


def looks_like_tar(path: Path) -> bool:
    """tarfile.is_tarfile, bounded: whether `path` opens as a (possibly compressed) tar archive."""
    try:
        with open_archive(path):
            return True
    except RefusedArchive:
        return True  # a tar archive all the same; `read` refuses it with the reason
    except (tarfile.TarError, EOFError, zlib.error):  # what tarfile.is_tarfile answers False to
        return False


def _member_name(member: tarfile.TarInfo, archive: Path) -> str:
    """The member's normalized relative name; CheckpointError for names that leave the archive."""
    name = member.name
    if name.startswith("/") or name.startswith("\\") or (len(name) > 1 and name[1] == ":"):
        raise CheckpointError(f"{archive}: member {name!r} has an absolute path; refusing the archive")
    normalized = posixpath.normpath(name.replace("\\", "/"))
    if normalized == ".." or normalized.startswith("../"):
        raise CheckpointError(f"{archive}: member {name!r} points outside the archive; refusing it")
    return "" if normalized == "." else normalized


def safe_members(tar: tarfile.TarFile, archive: Path) -> dict[str, tarfile.TarInfo]:
    """Regular files by normalized name, after the safety checks."""
    files: dict[str, tarfile.TarInfo] = {}
    total = 0
    compressed = archive.stat().st_size
    most_unpacked = MAX_EXPANSION * max(compressed, 1 << 20)
    for count, member in enumerate(tar, start=1):
        if count > MAX_MEMBERS:
            raise CheckpointError(f"{archive} has more than {MAX_MEMBERS} members; not a .nemo checkpoint")
        name = _member_name(member, archive)
        if member.isdir():
            continue
        if not member.isfile():
            kind = "link" if member.issym() or member.islnk() else "special file"
            raise CheckpointError(f"{archive}: member {member.name!r} is a {kind}; refusing the archive")
        total += member.size
        if total > MAX_UNPACKED_BYTES:
            raise CheckpointError(f"{archive} would unpack to more than {MAX_UNPACKED_BYTES >> 30} GiB; refusing it "
                                  "(set BIONEMO_EXPORT_NEMO_MAX_BYTES to raise the limit)")
        # Checked before tarfile moves on: reaching the next header decompresses everything up to
        # tar.offset, which counts the headers as well as the declared content.
        unpacked = max(total, tar.offset)
        if unpacked > most_unpacked:
            raise CheckpointError(f"{archive} ({compressed} bytes) declares {unpacked} bytes of content: "
                                  "a decompression bomb, not a checkpoint; refusing it")
        files[name] = member
    return files


def read_member(tar: tarfile.TarFile, member: tarfile.TarInfo, most: int = -1) -> bytes:
    """The member's content, or its first `most` bytes."""
    handle = tar.extractfile(member)
    assert handle is not None  # regular files always have content
    return handle.read(most)
