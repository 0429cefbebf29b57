"""The build's memory check (build.check_build_memory): a checkpoint whose build would not fit in
this host's memory is refused before anything is loaded, with the figures and the fix."""

from __future__ import annotations

import json
import struct

import pytest

from bionemo_export.build import BuildError, check_build_memory
from bionemo_export.models.readers.base import fp32_weight_bytes


def test_a_checkpoint_too_large_for_this_host_is_refused_before_it_is_loaded(tmp_path):
    """check_build_memory reads the weights' sizes from the safetensors headers (elements x 4 bytes
    in fp32, whatever the stored dtype) and refuses, naming the need and the fix, when 2.7x that
    exceeds the memory available; nothing is loaded to find out."""
    header = json.dumps({"a": {"dtype": "BF16", "shape": [1000, 1000], "data_offsets": [0, 2_000_000]},
                         "__metadata__": {"format": "pt"}}).encode()
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)  # the header alone
    assert fp32_weight_bytes(folder) == 4_000_000
    (folder / "pytorch_model.bin").write_bytes(bytes(2_000_000))  # the same weights again, as torch.save'd
    assert fp32_weight_bytes(folder) == 4_000_000  # counted once: the reader reads the safetensors
    check_build_memory(folder, available=int(4_000_000 * 2.7) + 1)
    check_build_memory(folder, available=None)  # unknown: not checked
    with pytest.raises(BuildError, match=r"needs about 0.0 GiB of memory \(2.7 x its 0.0 GiB of fp32 weights.*"
                                         r"--no-memory-check"):
        check_build_memory(folder, available=4_000_000)
