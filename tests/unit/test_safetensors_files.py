"""The safetensors reader (models/readers/safetensors_files.py): the tensors safetensors' own
loader gives, as views of a read-only shared mapping of the file (which Linux does not charge
against its commit limit, so a file larger than the host's memory opens), and every header entry
checked against the file before a tensor is made."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bionemo_export.models.readers.base import CheckpointError
from bionemo_export.models.readers.huggingface import read_weight_file
from bionemo_export.models.readers.mapped import file_mappings, mapped_file
from bionemo_export.models.readers.safetensors_files import load_safetensors


def _raw(path: Path, header: dict, data: bytes, pad_header_to: int | None = None) -> Path:
    """A safetensors file written by its documented layout (no alignment unless `pad_header_to`)."""
    text = json.dumps(header).encode()
    if pad_header_to:
        text += b" " * (-len(text) % pad_header_to)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def test_the_tensors_are_safetensors_own_as_views_of_a_read_only_shared_mapping(tmp_path):
    tensors = {"f32": torch.randn(64, 32), "bf16": torch.randn(33, 7).bfloat16(), "f16": torch.randn(5).half(),
               "i64": torch.arange(9), "u8": torch.arange(200, dtype=torch.uint8), "flag": torch.tensor([True, False]),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    loaded = load_safetensors(path)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert mapped_file(loaded["f32"]) == str(path.resolve())
    address = loaded["f32"].data_ptr()
    with open("/proc/self/maps", encoding="ascii") as maps:
        permissions = next(line.split()[1] for line in maps
                           if int(line.split("-")[0], 16) <= address < int(line.split()[0].split("-")[1], 16))
    assert permissions == "r--s"  # read-only and shared: no copy-on-write memory to charge
    assert any(m.path == str(path.resolve()) for m in file_mappings())


def test_a_tensor_whose_bytes_are_not_aligned_is_copied_with_the_same_values(tmp_path):
    values = torch.arange(6, dtype=torch.float32)
    header = {"odd": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "f": {"dtype": "F32", "shape": [2, 3], "data_offsets": [1, 25]}}
    path = _raw(tmp_path / "m.safetensors", header, bytes([7]) + values.numpy().tobytes(), pad_header_to=8)
    loaded = load_safetensors(path)
    assert int(loaded["odd"][0]) == 7 and torch.equal(loaded["f"], values.view(2, 3))
    assert mapped_file(loaded["f"]) is None  # a copy


@pytest.mark.parametrize(("header", "data", "problem"), [
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, r"bytes 0-16 lie outside the file's "
                                                                                r"8 bytes of data \(truncated\?\)"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 16, r"12 bytes for shape \[4\] of F32 "
                                                                                 r"\(16 expected\)"),
    ({"w": {"dtype": "F31", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 16, r"dtype 'F31' is none of F64, F32"),
    ({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}}, b"\0" * 16, r"shape \[-4\] is not a list of "
                                                                                  "non-negative integers"),
    ({"w": {"dtype": "F32", "shape": [4], "data_offsets": [8]}}, b"\0" * 16, r"data_offsets \[8\] is not two integers"),
    ({"w": [1, 2]}, b"", r"its header entry is not an object"),
    ([1, 2], b"", r"the header is a JSON list, not an object"),
])
def test_a_header_that_does_not_fit_its_file_is_refused_naming_the_file_and_the_entry(tmp_path, header, data, problem):
    path = _raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(CheckpointError, match=rf"cannot read weights {path}: .*{problem}"):
        read_weight_file(path)


def test_a_length_field_that_claims_more_than_the_file_is_refused_before_reading(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(CheckpointError, match=r"the header claims 1152921504606846976 bytes; the file holds 2"):
        read_weight_file(path)
    path.write_bytes(b"\1\2")
    with pytest.raises(CheckpointError, match=r"2 bytes: shorter than the 8-byte header length"):
        read_weight_file(path)
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(CheckpointError, match=rf"cannot read weights {path}"):
        read_weight_file(path)
