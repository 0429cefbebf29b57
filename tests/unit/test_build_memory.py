"""The build's memory check (build.check_build_memory): the memory a build needs is estimated by
the path it will take (graph held in memory, or weights left on disk), before anything is loaded,
and a checkpoint whose build would not fit in this host's memory is refused with the figures, the
path and the fix; one that fits is not."""

from __future__ import annotations

import json
import struct

import pytest

from bionemo_export.build import BuildError, check_build_memory, estimate_build_memory
from bionemo_export.memory_plan import (
    BUILD_BASELINE_BYTES,
    BUILD_MEMORY_FACTORS,
    IN_MEMORY,
    QUANTIZE_MEMORY_FACTOR,
    STREAMED,
    WEIGHTS_ON_DISK,
)
from bionemo_export.models.readers.base import fp32_weight_bytes

GIB = 2**30


def _header_only(folder, elements: int, dtype: str = "BF16"):
    """A Hugging Face folder whose model.safetensors is the header alone, claiming `elements` weights."""
    width = 1000
    header = json.dumps({"a": {"dtype": dtype, "shape": [elements // width, width],
                               "data_offsets": [0, elements * 2]}, "__metadata__": {"format": "pt"}}).encode()
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


def test_a_small_checkpoint_is_estimated_on_the_in_memory_path_and_refused_when_it_does_not_fit(tmp_path):
    """The weights' sizes come from the safetensors headers (elements x 4 bytes in fp32, whatever
    the stored dtype; a .bin copy beside them not counted again); nothing is loaded to find out."""
    folder = _header_only(tmp_path / "small", 1_000_000)
    assert fp32_weight_bytes(folder) == 4_000_000
    (folder / "pytorch_model.bin").write_bytes(bytes(2_000_000))  # the same weights again, as torch.save'd
    assert fp32_weight_bytes(folder) == 4_000_000
    estimate = estimate_build_memory(folder)
    assert estimate.path == IN_MEMORY and estimate.factor == BUILD_MEMORY_FACTORS[IN_MEMORY]
    assert estimate.needed == int(BUILD_BASELINE_BYTES + estimate.factor * 4_000_000)
    assert check_build_memory(folder, available=estimate.needed) == estimate
    assert check_build_memory(folder, available=None) == estimate  # unknown: not checked
    with pytest.raises(BuildError, match=rf"building it in fp32 needs about 0.8 GiB \({estimate.factor} x its 0.0 "
                                         r"GiB of fp32 weights.*held in memory: up to 256 MB.*"
                                         r"0.5 GiB is available here.*--no-memory-check"):
        check_build_memory(folder, available=GIB // 2)


def test_esm2_3b_takes_the_weights_on_disk_path_and_fits_a_24_gb_host(tmp_path):
    """ESM-2 3B's 2.84G weights (10.6 GiB in fp32) are over the external-data threshold: its build
    keeps them on disk and needs 1.3x them, which the 21 GiB free on a 24 GB host holds (the check
    refused it before, at 2.7x); quantizing them reads them in (1.5x), and where even that does not
    fit, the message says to build fp32 here. ESM-2 150M's 0.59 GB take this path too."""
    assert estimate_build_memory(_header_only(tmp_path / "esm2_150m", 148_000_000)).path == WEIGHTS_ON_DISK
    folder = _header_only(tmp_path / "esm2_3b", 2_840_000_000)
    estimate = check_build_memory(folder, available=21 * GIB)
    assert estimate is not None and estimate.path == WEIGHTS_ON_DISK
    assert estimate.factor == BUILD_MEMORY_FACTORS[WEIGHTS_ON_DISK] < 1.5
    quantized = check_build_memory(folder, available=21 * GIB, precision="int4")
    assert quantized is not None and quantized.factor == QUANTIZE_MEMORY_FACTOR
    with pytest.raises(BuildError, match=r"in fp32 needs about .* weights left on disk: the checkpoint is mapped"):
        check_build_memory(folder, available=10 * GIB)
    with pytest.raises(BuildError, match=r"in int8 needs .* weights left on disk: the checkpoint is mapped, but int8 "
                                         r"quantization reads every fp32 weight in.*Build it in fp32 here"):
        check_build_memory(folder, available=int(estimate.needed) + GIB, precision="int8")
    # int4 (and int8w) stream instead, in a fraction of the memory; asked not to, they are refused.
    streamed = check_build_memory(folder, available=int(estimate.needed) + GIB, precision="int4")
    assert streamed is not None and streamed.path == STREAMED and streamed.needed < estimate.needed
    assert "the build with its weights left on disk needs 16.7 GiB; the graph is written weight by" in streamed.why
    with pytest.raises(BuildError, match=r"in int4 needs .* weights left on disk"):
        check_build_memory(folder, available=int(estimate.needed) + GIB, precision="int4", streamed=False)


def test_an_fp32_build_that_does_not_fit_names_the_int4_path_that_does(tmp_path):
    """ESM C 6B's 6.35G weights (25.4 GB in fp32) on a 24 GB host: fp32 is refused, naming int4,
    whose streamed build needs about 0.3x them."""
    folder = _header_only(tmp_path / "esmc_6b", 6_352_005_184)
    with pytest.raises(BuildError, match=r"in fp32 needs about 31.5 GiB.*Build it in int4 \(`precision` int4: its "
                                         r"weights stream"):
        check_build_memory(folder, available=21 * GIB)
    streamed = check_build_memory(folder, available=21 * GIB, precision="int4")
    assert streamed is not None and streamed.path == STREAMED and streamed.needed < 8 * GIB


def test_the_disk_a_build_writes_is_checked_before_anything_is_loaded(tmp_path):
    """ESM-2 3B in fp32 writes about 4 copies of its fp32 weights beside the output at its peak
    (memory_plan.BUILD_DISK_COPIES), an int8w ESM C 6B with its weights on disk the fp32 copy of its
    bf16 weights too, a streamed int4 one its int4 graph alone; a build the file system cannot hold
    is refused naming the folder, the figures and the fix."""
    from bionemo_export.build import check_build_disk
    from bionemo_export.memory_plan import BUILD_DISK_COPIES, STORED_WEIGHT_SHARE

    folder = _header_only(tmp_path / "esm2_3b", 2_840_000_000, dtype="F32")  # the header claims fp32
    memory = estimate_build_memory(folder, available=21 * GIB)
    out = tmp_path / "deep" / "repo"  # its folder need not exist yet
    disk = check_build_disk(folder, out, memory, free=100 * GIB)
    assert disk.needed == int(BUILD_DISK_COPIES["fp32"] * 4 * 2_840_000_000)
    assert disk.widened == 0  # fp32 weights: nothing to widen
    with pytest.raises(BuildError, match=rf"esm2_3b: building it in fp32 writes about 42.3 GiB \(4 x its 10.6 GiB "
                                         rf"of fp32 weights\) beside {out}; 20.0 GiB is free on {tmp_path}'s file "
                                         r"system.*another file system.*--no-memory-check"):
        check_build_disk(folder, out, memory, free=20 * GIB)

    esmc = _header_only(tmp_path / "esmc_6b", 6_300_000_000)  # bf16, stored in half the fp32 bytes
    on_disk = estimate_build_memory(esmc, "int8w", available=100 * GIB)
    assert on_disk.path != STREAMED
    disk = check_build_disk(esmc, out, on_disk, "int8w", free=200 * GIB)
    assert disk.widened == 4 * 6_300_000_000  # the fp32 copy of its bf16 weights, a temporary file
    assert "for the fp32 copy of its half-precision weights" in disk.text()
    # Streamed, its layers are widened in memory one at a time (readers/mapped.widening_deferred).
    streamed = estimate_build_memory(esmc, "int4", available=21 * GIB)
    assert streamed.path == STREAMED
    disk = check_build_disk(esmc, out, streamed, "int4", free=100 * GIB)
    assert disk.widened == 0 and disk.needed == int(STORED_WEIGHT_SHARE["int4"] * 4 * 6_300_000_000)
