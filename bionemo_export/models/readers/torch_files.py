"""The one way every reader opens a torch file: a model file, a file read beside it (fair-esm's
contact regression), a Hugging Face `pytorch_model.bin`, a `.nemo`'s `model_weights.ckpt` (a tar
member), a record of a NeMo 2 `.distcp` file (bytes read into a buffer), ESM C's `.pth`.

Nothing in the file is run, and the bytes are judged before anything is unpickled:
- torch's zip format (what `torch.save` writes since torch 1.6: `<archive>/data.pkl`,
  `<archive>/data/<key>` per storage, a few small version records) is opened when its records
  are those, stored uncompressed and inside the file. A TorchScript archive (`code/`,
  `constants.pkl`), whose loading runs its code, is refused, as is any other zip.
- torch's legacy format (a run of pickles that starts with torch's magic number; what torch.save
  wrote before 1.6, and what older Hugging Face `pytorch_model.bin` files such as rxnfp's are) is
  opened through the same restricted unpickler. A pickle stream without the magic number is
  refused: it is not a torch file, and only a full unpickler reads it.
- every storage the pickle refers to is read off its opcodes (never executed) and may not claim
  more bytes than the file holds for it, so a forged size field cannot make torch allocate
  terabytes.
- it is then loaded with `torch.load(weights_only=True)`, allowing besides tensors only the plain
  classes real checkpoints hold (`SAFE_CLASSES`): torch's restricted unpickler refuses any other
  global, any call of a function and any state set on a function or a class.

A file named by its path in torch's zip format is memory-mapped (`torch.load(mmap=True)`): its
tensors are views of the file's pages, which the kernel reads as they are used and may drop again,
so loading a checkpoint does not copy its weights into the process (a 3B model's 11 GB among
them). It is mapped through the descriptor the checks read (/proc/self/fd), so the bytes mapped are
the bytes checked even if the path is replaced meanwhile. A buffer, a tar member or the legacy
format is read into memory as before.
"""

from __future__ import annotations

import argparse
import io
import os
import pickletools
import re
import tarfile
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from .base import CheckpointError, check_state_dict, weights_error

if TYPE_CHECKING:
    import torch

SAFE_CLASSES: tuple[type, ...] = (argparse.Namespace, io.BytesIO)
"""What a torch file may hold besides tensors, containers and numbers: fair-esm keeps its settings
in an argparse.Namespace (`cfg["model"]` of ESM-2 files, `args` of ESM-1b/1v files); older
TransformerEngine stores `_extra_state` as an io.BytesIO. Unpickling either sets plain attributes
or a byte buffer; neither runs code of the file's choosing."""

TORCH_RECORDS = re.compile(r"data\.pkl|byteorder|version|\.format_version|\.storage_alignment|\.data/version"
                           r"|\.data/serialization_id|data/[0-9A-Za-z_]+")
"""The records (under the archive's folder) that torch.save writes; nothing else is opened."""
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
"""The number torch's legacy format pickles first (torch.serialization.MAGIC_NUMBER)."""
MAX_LINE = 1 << 16
"""Longest line of a text opcode (pickle protocol 0) read."""
RE_SAVE = ("load it where you trust it and save its tensors again with torch.save (or as safetensors), "
           "then use that file")


def open_torch_file(source: Path | IO[bytes], name: str) -> Any:
    """What torch.save wrote to `source` (a path, or a seekable binary file that holds it from
    byte 0), loaded as the module says: no code in it runs. `name` is the file as messages name it
    ("x.nemo:model_weights.ckpt"). CheckpointError naming it for a file in another format (a
    TorchScript archive, a plain pickle stream), a forged storage size, or what torch refuses."""
    if isinstance(source, (str, Path)):
        with open(source, "rb") as handle:
            return _load(handle, name, mapped=True)
    return _load(source, name, mapped=False)


def _load(source: IO[bytes], name: str, *, mapped: bool) -> Any:
    """`open_torch_file` of an open file; `mapped`: memory-map it when it is a real file in torch's
    zip format (the module says why)."""
    import torch

    _check_format(source, name)
    source.seek(0)
    where: IO[bytes] | str = source
    if mapped and source.read(4) == b"PK\x03\x04" and os.path.exists(descriptor := _descriptor_path(source)):
        where = descriptor  # the same open file, by a name torch can map
    source.seek(0)
    try:
        with torch.serialization.safe_globals(list(SAFE_CLASSES)):
            if isinstance(where, str):
                return torch.load(where, map_location="cpu", weights_only=True, mmap=True)
            return torch.load(where, map_location="cpu", weights_only=True)
    except Exception as err:  # a refused pickle (refused_weights) or an unreadable file
        raise weights_error(name, err) from None


def _descriptor_path(source: IO[bytes]) -> str:
    """/proc/self/fd/N of an open file: a name for exactly that file (not whatever its path names
    now); a path that does not exist where there is no /proc or no descriptor."""
    try:
        return f"/proc/self/fd/{source.fileno()}"
    except (AttributeError, OSError, ValueError):  # io.BytesIO and friends have no descriptor
        return "/nonexistent"


def load_torch_weights(source: Path | IO[bytes], name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(state dict, skipped entries) of the torch file `source` (`open_torch_file`), checked to be
    named tensors; TransformerEngine `_extra_state` entries (io.BytesIO) are skipped."""
    return check_state_dict(open_torch_file(source, name), name)


# ------------------------------------------------------------------------------- the format
def _refused(name: str, what: str) -> CheckpointError:
    return CheckpointError(f"cannot read weights {name}: {what}; refusing it")


def _check_format(source: IO[bytes], name: str) -> None:
    """`source` checked to be one of torch's two formats, its storages no larger than the bytes the
    file holds for them (see the module); CheckpointError naming `name` otherwise."""
    source.seek(0)
    head = source.read(4)
    size = source.seek(0, os.SEEK_END)
    source.seek(0)
    if head == b"PK\x03\x04":
        _check_zip(source, size, name)
    elif head[:1] == b"\x80":  # PROTO: torch's legacy format is a run of pickles
        if _is_tar(source):  # torch.load tries its pre-1.0 tar format first, which it extracts
            raise _refused(name, "it is a tar archive (torch's pre-1.0 format), which is not opened")
        _check_legacy(_Bounded(source, size), size, name)
    else:
        raise CheckpointError(f"cannot read weights {name}: not a readable checkpoint (neither torch's zip format "
                              "nor its legacy one: corrupt, truncated or not a weights file)")


def _check_zip(source: IO[bytes], size: int, name: str) -> None:
    """A zip checked to be what torch.save writes, every storage in `data.pkl` at most its record's size."""
    try:
        with zipfile.ZipFile(source) as archive:
            records = _torch_records(archive, size, name)
            data_pkl = archive.read(records["data.pkl"])
    except CheckpointError:  # a ValueError too, but already named
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as err:
        raise CheckpointError(f"cannot read weights {name}: not a readable checkpoint (a damaged zip file: "
                              f"{' '.join(str(err).split())[:200]})") from None
    for key, claimed in _claimed_storages(data_pkl, name, "data.pkl").items():
        record = records.get(f"data/{key}")
        if record is None:
            raise _refused(name, f"its data.pkl refers to storage {key!r:.40}, which the file does not hold")
        if claimed > record.file_size:
            raise _refused(name, f"its data.pkl says storage {key:.40} holds {claimed} bytes but its record holds "
                                 f"{record.file_size}: the file is forged or damaged")


def _check_legacy(source: _Bounded, size: int, name: str) -> None:
    """torch's legacy format (torch.save before 1.6, `_use_new_zipfile_serialization=False`):
    pickles of the magic number, the protocol version, system information, the object and the
    storage keys, then each storage's bytes. Another pickle stream is refused; so is an object that
    claims more storage bytes than follow the pickles."""
    magic = [(opcode.name, arg) for opcode, arg, _ in _ops(source, name)]
    if [arg for op, arg in magic if op not in ("PROTO", "STOP")] != [LEGACY_MAGIC]:
        raise _refused(name, "it is a pickle stream, not a torch file (no torch magic number): only a full "
                             f"unpickler reads it, which can run code; {RE_SAVE}")
    for part in ("protocol version", "system information"):
        if _claimed_storages(source, name, f"its {part}"):
            raise _refused(name, f"its {part} refers to a storage, which torch.save never writes")
    claimed = _claimed_storages(source, name, "its pickle")
    for _ in _ops(source, name):  # the storage keys
        pass
    left = size - source.tell()
    if sum(claimed.values()) + 8 * len(claimed) > left:
        raise _refused(name, f"its pickle claims {sum(claimed.values())} bytes of storages but only {left} bytes "
                             "follow it: the file is forged or damaged")


def _is_tar(source: IO[bytes]) -> bool:
    """Whether the file's first block is a tar header, as torch.load's legacy path would find."""
    block = source.read(tarfile.BLOCKSIZE)
    source.seek(0)
    try:
        tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
    except tarfile.HeaderError:
        return False
    return True


class _Bounded:
    """A file's `read` and `readline` never asked for more than it holds (pickletools would ask for
    what a forged length says), for scanning pickles in place."""

    def __init__(self, source: IO[bytes], size: int) -> None:
        self.source, self.size = source, size

    def tell(self) -> int:
        return self.source.tell()

    def read(self, count: int = -1) -> bytes:
        left = self.size - self.source.tell()
        return self.source.read(left if count < 0 else min(count, left))

    def readline(self) -> bytes:  # text opcodes (protocol 0); no real line is longer
        return self.source.readline(min(MAX_LINE, self.size - self.source.tell()))


def _torch_records(archive: zipfile.ZipFile, size: int, name: str) -> dict[str, zipfile.ZipInfo]:
    """The archive's records by name under its folder, checked to be what torch.save writes:
    one folder, no code, stored uncompressed, each inside the file."""
    entries = archive.infolist()
    folders = {entry.filename.split("/", 1)[0] for entry in entries}
    inner = [entry.filename.split("/", 1)[-1] for entry in entries]
    if any(item == "constants.pkl" or item.startswith(("code/", "constants/")) for item in inner):
        raise _refused(name, "it is a TorchScript archive, which holds code that loading it runs (code/, "
                             "constants.pkl); save its state_dict() with torch.save where you trust it, or use "
                             "safetensors")
    if len(folders) != 1 or "data.pkl" not in inner or any("/" not in entry.filename for entry in entries):
        raise _refused(name, "it is a zip file but not one torch.save writes (no <archive>/data.pkl)")
    if unknown := [item for item in inner if not TORCH_RECORDS.fullmatch(item)]:
        raise _refused(name, f"it is a zip file holding {unknown[0]!r:.80}, which torch.save does not write")
    if len(set(inner)) != len(inner):
        raise _refused(name, "it is a zip file naming a record twice, which torch.save does not write")
    for item, entry in zip(inner, entries):
        if entry.compress_type != zipfile.ZIP_STORED or entry.compress_size != entry.file_size:
            raise _refused(name, f"its record {item} is compressed, which torch.save never does")
        if entry.header_offset + 30 + len(entry.orig_filename.encode()) + entry.file_size > size:
            raise _refused(name, f"its record {item} claims {entry.file_size} bytes, more than the file holds")
    return dict(zip(inner, entries))


# ------------------------------------------------------------------------- storage sizes
@dataclass(frozen=True)
class _Global:
    """A GLOBAL opcode's module and name, as read (nothing is imported)."""

    module: str
    name: str


_OPAQUE = object()
"""A value the scan does not follow (the result of a call, a container, a persistent load)."""
_MARK = object()
_TUPLES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


def _ops(pickle: bytes | _Bounded, name: str, what: str = "its pickle") -> Iterator[tuple[Any, Any, Any]]:
    """pickletools.genops over one pickle; CheckpointError naming the file when it is not one."""
    try:
        yield from pickletools.genops(cast(IO[bytes], pickle))  # a _Bounded reads and tells, all genops uses
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as err:  # unknown opcode, truncated
        raise CheckpointError(f"cannot read weights {name}: not a readable checkpoint ({what} is not a "
                              f"well-formed pickle: {' '.join(str(err).split())[:200]})") from None


def _claimed_storages(pickle: bytes | _Bounded, name: str, what: str) -> dict[str, int]:
    """{key: bytes claimed} of every storage the pickle loads, read off its opcodes with a symbolic
    stack that follows literals, tuples, globals and the memo only: nothing is built or called.
    A storage reference not spelled out as torch.save spells it is refused."""
    stack: list[Any] = []
    memo: dict[Any, Any] = {}
    claims: dict[str, int] = {}
    try:
        for opcode, arg, _ in _ops(pickle, name, what):
            op = opcode.name
            if op == "MARK":
                stack.append(_MARK)
            elif op in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = stack[-1]
            elif op == "MEMOIZE":
                memo[len(memo)] = stack[-1]
            elif op in ("GET", "BINGET", "LONG_BINGET"):
                stack.append(memo.get(arg, _OPAQUE))
            elif op == "GLOBAL":
                module, _, qualified = str(arg).partition(" ")
                stack.append(_Global(module, qualified))
            elif op == "STACK_GLOBAL":
                qualified, module = stack.pop(), stack.pop()
                stack.append(_Global(module, qualified) if isinstance(module, str) and isinstance(qualified, str)
                             else _OPAQUE)
            elif op == "TUPLE":
                mark = _last_mark(stack)
                items = tuple(stack[mark + 1:])
                del stack[mark:]
                stack.append(items)
            elif op in _TUPLES:
                count = _TUPLES[op]
                items = tuple(stack[len(stack) - count:]) if count else ()
                if len(items) != count:
                    raise ValueError(f"{op} with too few items on the stack")
                del stack[len(stack) - count:]
                stack.append(items)
            elif op == "BINPERSID":
                key, claimed = _storage_claim(stack.pop(), name, what)
                claims[key] = max(claimed, claims.get(key, 0))
                stack.append(_OPAQUE)
            elif op == "PERSID":
                raise _refused(name, f"{what} refers to data in a way torch.save never writes (PERSID)")
            elif not opcode.stack_before and len(opcode.stack_after) == 1:
                stack.append(arg if arg is not None else _OPAQUE)  # a literal: int, string, bytes, None, bool
            else:
                _generic(opcode, stack)
    except CheckpointError:  # a ValueError too, but already named
        raise
    except (ValueError, IndexError) as err:  # ops on an empty stack, or without their MARK
        raise CheckpointError(f"cannot read weights {name}: not a readable checkpoint ({what} is not a "
                              f"well-formed pickle: {' '.join(str(err).split())[:200]})") from None
    return claims


def _last_mark(stack: list[Any]) -> int:
    for index in range(len(stack) - 1, -1, -1):
        if stack[index] is _MARK:
            return index
    raise ValueError("an opcode needs a MARK that is not on the stack")


def _generic(opcode: pickletools.OpcodeInfo, stack: list[Any]) -> None:
    """Any other opcode's effect on the stack, by pickletools' description of it: what it takes
    (up to a MARK, when it takes one) is dropped; what it leaves is opaque."""
    before = opcode.stack_before
    if pickletools.markobject in before:
        del stack[_last_mark(stack):]
        taken = before.index(pickletools.markobject)
    else:
        taken = len(before)
    if taken > len(stack):
        raise ValueError(f"{opcode.name} with too few items on the stack")
    del stack[len(stack) - taken:]
    stack.extend([_OPAQUE] * len(opcode.stack_after))


def _storage_claim(pid: Any, name: str, what: str) -> tuple[str, int]:
    """(key, bytes) of a persistent id as torch.save writes it: ('storage', torch.<Type>Storage,
    key, location, number of elements), every part a literal of the pickle (the legacy format adds
    where a view starts, which claims nothing more)."""
    if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] in ("storage", b"storage")
            and isinstance(pid[1], _Global) and isinstance(pid[2], (str, bytes)) and type(pid[4]) is int
            and pid[4] >= 0):
        raise _refused(name, f"{what} refers to a storage in a form torch.save does not write")
    itemsize = _element_size(pid[1])
    if itemsize is None:
        raise _refused(name, f"{what} names {pid[1].module}.{pid[1].name:.80} as a storage type, which is not "
                             "one of torch's")
    key = pid[2].decode("ascii", "replace") if isinstance(pid[2], bytes) else pid[2]
    return key, pid[4] * itemsize


def _element_size(storage: _Global) -> int | None:
    """Bytes per element of a torch storage class named in a pickle; None if it is not one."""
    import torch

    if storage.module not in ("torch", "torch.storage") or not storage.name.endswith("Storage"):
        return None
    if storage.name == "UntypedStorage":
        return 1
    found = getattr(torch, storage.name, None)
    if not (isinstance(found, type) and issubclass(found, torch.storage.TypedStorage)) \
            or found is torch.storage.TypedStorage:
        return None
    with warnings.catch_warnings():  # "TypedStorage is deprecated": only its dtype is read
        warnings.simplefilter("ignore")
        return found.dtype.itemsize
