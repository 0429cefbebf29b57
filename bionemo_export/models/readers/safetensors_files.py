"""The one way the readers open a safetensors file: its header checked, its data mapped read-only.

    weights = load_safetensors(path)           # {name: tensor}, each a view of the file's pages
    header, start = read_header(handle, size)  # the JSON header and where the data begins

The layout is safetensors' documented one: an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range (`data_offsets`, relative to the data), then the
data. Every entry is checked against the file before a tensor is made: a known dtype, a shape of
non-negative integers, a byte range that lies inside the file and holds exactly the shape's bytes.

Why not safetensors' own `load_file`: it maps the file private and writable (copy-on-write), and
Linux charges such a mapping against its commit limit in full, so a file larger than the host's
memory and swap is refused outright ("Cannot allocate memory": ESM-2 15B's 30 GB in fp16 on a
24 GB host without swap). A read-only shared mapping is not charged: its pages are the file's,
read as tensors are used and dropped again by the kernel when memory is short (mapped.py). The
tensors are read-only memory: a write faults rather than changing the user's file (the readers
copy what they change into new tensors). A tensor whose bytes are not aligned to its element size
(files written by hand can be) is copied instead.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_HEADER_BYTES = 100 << 20
"""A header longer than this is refused (safetensors' own limit): the length field is the file's
to claim, and is read before anything else."""
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8), "F32": ("float32", 4), "F16": ("float16", 2), "BF16": ("bfloat16", 2),
    "I64": ("int64", 8), "I32": ("int32", 4), "I16": ("int16", 2), "I8": ("int8", 1), "U8": ("uint8", 1),
    "BOOL": ("bool", 1), "F8_E4M3": ("float8_e4m3fn", 1), "F8_E5M2": ("float8_e5m2", 1)}
"""safetensors' dtype names: torch's, and the bytes of an element."""


def read_header(handle: IO[bytes], size: int) -> tuple[dict[str, Any], int]:
    """(the JSON header, the offset where the data begins) of the safetensors file open as
    `handle`, `size` bytes long; ValueError naming what is wrong."""
    handle.seek(0)
    if size < 8:
        raise ValueError(f"{size} bytes: shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", handle.read(8))
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise ValueError(f"the header claims {length} bytes; the file holds {size - 8} after its length field")
    try:
        header = json.loads(handle.read(length))
    except UnicodeDecodeError as err:
        raise ValueError(f"the header is not UTF-8 JSON ({err})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    return header, 8 + length


def load_safetensors(path: Path | str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at `path`, views of a read-only shared mapping of it
    (the module's docstring); ValueError naming the first entry that does not fit the file."""
    import torch

    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        header, start = read_header(handle, size)
        layouts = {name: _layout(name, entry, size - start) for name, entry in header.items() if name != "__metadata__"}
        mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size > start else None
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")  # read-only on purpose
        for name, (dtype_name, shape, begin, nbytes) in layouts.items():
            dtype = getattr(torch, dtype_name)
            count = nbytes // dtype.itemsize
            offset = start + begin
            if count == 0 or mapping is None:
                tensors[name] = torch.empty(shape, dtype=dtype)
            elif offset % dtype.itemsize:  # misaligned: a copy, as safetensors itself makes
                tensors[name] = torch.frombuffer(bytearray(mapping[offset:offset + nbytes]), dtype=dtype).view(shape)
            else:
                tensors[name] = torch.frombuffer(mapping, dtype=dtype, count=count, offset=offset).view(shape)
    return tensors


def _layout(name: str, entry: Any, data_bytes: int) -> tuple[str, list[int], int, int]:
    """(torch dtype name, shape, first byte in the data, byte count) of header entry `name`."""
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r}: its header entry is not an object")
    dtype, itemsize = DTYPES.get(str(entry.get("dtype")), ("", 0))
    if not dtype:
        raise ValueError(f"tensor {name!r}: dtype {entry.get('dtype')!r} is none of {', '.join(DTYPES)}")
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in offsets)):
        raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not two integers")
    begin, end = offsets
    count = 1
    for n in shape:
        count *= n
    if not 0 <= begin <= end <= data_bytes:
        raise ValueError(f"tensor {name!r}: bytes {begin}-{end} lie outside the file's {data_bytes} bytes of data "
                         "(truncated?)")
    if end - begin != count * itemsize:
        raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape} of {entry['dtype']} "
                         f"({count * itemsize} expected)")
    return dtype, shape, begin, end - begin
