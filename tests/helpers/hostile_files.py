"""Hostile torch files, written by hand from pickle opcodes and zipfile, for the hostile-checkpoint
matrix (tests/unit/test_hostile_checkpoints.py): each is a file a reader may be handed where it
expects weights, and each would run code, change torch, or ask for terabytes if it were loaded as
`torch.load(weights_only=False)` (or torch.jit.load) loads it. `legitimate_*` are the same writers'
harmless files, so a test can show the writers make real torch files.
"""

from __future__ import annotations

import io
import struct
import zipfile
from pathlib import Path

import torch

PROTO2 = b"\x80\x02"
MARK, STOP, TUPLE, REDUCE, BUILD, SETITEM, EMPTY_DICT, BINPERSID = b"(", b".", b"t", b"R", b"b", b"s", b"}", b"Q"
TERABYTES = 1 << 40
"""Elements a forged storage claims (4 TiB of float32)."""
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.serialization.MAGIC_NUMBER


# ------------------------------------------------------------------------------ opcodes
def text(value: str) -> bytes:
    """BINUNICODE."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def integer(value: int) -> bytes:
    """LONG1: any int, in as many bytes as it takes."""
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def global_(module: str, name: str) -> bytes:
    """GLOBAL: the named object, found by the unpickler."""
    return b"c" + f"{module}\n{name}\n".encode()


def call(module: str, name: str, *arguments: bytes) -> bytes:
    """REDUCE: module.name(*arguments), each argument already pickled."""
    return global_(module, name) + MARK + b"".join(arguments) + TUPLE + REDUCE


def one_key_dict(key: str, value: bytes) -> bytes:
    return EMPTY_DICT + text(key) + value + SETITEM


def float_tensor(numel: int, *, legacy: bool = False) -> bytes:
    """A 1-D float tensor of two elements over storage "0", whose storage claims `numel` elements
    (torch.save writes the storage's true size there; the legacy format adds where a view starts)."""
    storage = MARK + text("storage") + global_("torch", "FloatStorage") + text("0") + text("cpu") \
        + integer(numel) + (b"N" if legacy else b"") + TUPLE + BINPERSID
    return call("torch._utils", "_rebuild_tensor_v2", storage, integer(0), integer(2) + b"\x85",
                integer(1) + b"\x85", b"\x89", call("collections", "OrderedDict"))


def build(module: str, name: str) -> bytes:
    """BUILD on the global module.name: sets its attribute `poisoned` (on a function or a class,
    for every later use of it in the process). The state is (None, {...}), which pickle applies
    with setattr: a class's own __dict__ cannot be updated in place."""
    return global_(module, name) + b"N" + one_key_dict("poisoned", integer(1)) + b"\x86" + BUILD


def system(marker: Path) -> bytes:
    """os.system("touch <marker>")."""
    return call("os", "system", text(f"touch {marker}"))


# --------------------------------------------------------------------------- file formats
def torch_zip(data_pkl: bytes, records: dict[str, bytes] | None = None) -> bytes:
    """torch's zip format as torch.save lays it out: `archive/data.pkl`, version records and one
    `archive/data/<key>` per storage, stored uncompressed."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        for key, data in (records or {}).items():
            archive.writestr(f"archive/data/{key}", data)
        archive.writestr("archive/version", "3\n")
    return buffer.getvalue()


def legacy_stream(body: bytes, storages: dict[str, bytes] | None = None) -> bytes:
    """torch's legacy format: pickles of the magic number, the protocol version, the system
    information, `body` (an opcode sequence without PROTO and STOP) and the storage keys, then
    each storage as its element count and its bytes (float32 storages)."""
    storages = storages or {}
    keys = b"]" + b"".join(text(key) + b"a" for key in storages)  # EMPTY_LIST, APPEND each
    sys_info = EMPTY_DICT + text("protocol_version") + integer(1001) + SETITEM \
        + text("little_endian") + b"\x88" + SETITEM
    stream = b"".join(PROTO2 + part + STOP for part in (integer(LEGACY_MAGIC), integer(1001), sys_info, body, keys))
    return stream + b"".join(struct.pack("<q", len(data) // 4) + data for data in storages.values())


# ------------------------------------------------------------------------------ the files
def legacy_call(marker: Path) -> bytes:
    """A legacy torch file (magic number and all) whose object is os.system(...)."""
    return legacy_stream(one_key_dict("w", system(marker)))


def plain_pickle_call(marker: Path) -> bytes:
    """A plain pickle stream (no torch magic number) calling os.system(...)."""
    return PROTO2 + one_key_dict("w", system(marker)) + STOP


def zip_call(marker: Path) -> bytes:
    """A torch zip whose data.pkl calls os.system(...)."""
    return torch_zip(PROTO2 + one_key_dict("w", system(marker)) + STOP)


def build_on_function(module: str = "torch._utils", name: str = "_rebuild_tensor_v2") -> bytes:
    """A torch zip whose data.pkl sets an attribute on a function (torch's tensor rebuild, by default)."""
    return torch_zip(PROTO2 + one_key_dict("w", build(module, name)) + STOP)


def build_on_class(module: str = "collections", name: str = "OrderedDict") -> bytes:
    """A torch zip whose data.pkl sets an attribute on a class (OrderedDict, which torch allows, by default)."""
    return torch_zip(PROTO2 + one_key_dict("w", build(module, name)) + STOP)


def terabytes_zip(numel: int = TERABYTES) -> bytes:
    """A torch zip holding one float tensor whose storage claims `numel` elements over an 8-byte record."""
    return torch_zip(PROTO2 + one_key_dict("w", float_tensor(numel)) + STOP, {"0": bytes(8)})


def terabytes_legacy(numel: int = TERABYTES) -> bytes:
    """A legacy torch file holding one float tensor whose storage claims `numel` elements over 8 bytes."""
    return legacy_stream(one_key_dict("w", float_tensor(numel, legacy=True)), {"0": bytes(8)})


class _Armed(torch.nn.Module):
    """A module whose TorchScript __setstate__ creates the file named in its state: what
    torch.jit.load (and torch.load(weights_only=False) of the archive) runs."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.proof = torch.zeros(1, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker = state[0]
        self.training = state[1]
        # a shared mapping creates the file; kept in an attribute so TorchScript does not drop the call
        self.proof = torch.from_file(state[0], shared=True, size=1, dtype=torch.uint8)


def torchscript(marker: Path) -> bytes:
    """A TorchScript archive whose loading creates `marker`."""
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(_Armed(str(marker))), buffer)
    return buffer.getvalue()


def legitimate_zip() -> bytes:
    """`terabytes_zip`'s harmless twin: {"w": tensor([0., 0.])}."""
    return terabytes_zip(2)


def legitimate_legacy() -> bytes:
    """`terabytes_legacy`'s harmless twin: {"w": tensor([0., 0.])}."""
    return terabytes_legacy(2)
