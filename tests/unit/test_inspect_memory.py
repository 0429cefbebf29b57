"""`inspect CHECKPOINT` says what a build of it needs in memory here (checkpoint_report.memory_report,
build.estimate_build_memory): the path the build takes and whether it fits this host; and what
serving it needs, in fp32 and int4 (memory_plan.serve_memory)."""

from __future__ import annotations

import json
import struct

from typer.testing import CliRunner

from bionemo_export.checkpoint_report import memory_report
from bionemo_export.cli.main import app
from bionemo_export.memory_plan import (
    BUILD_MEMORY_FACTORS,
    IN_MEMORY,
    QUANTIZE_MEMORY_FACTOR,
    SERVE_BASELINE_BYTES,
    STORED_WEIGHT_SHARE,
    STREAMED,
    WEIGHTS_ON_DISK,
)
from bionemo_export.testing.checkpoints import save_random_checkpoint


def test_inspect_reports_the_memory_a_build_needs_here(tmp_path):
    folder = save_random_checkpoint("esm2", tmp_path / "esm2")
    result = CliRunner().invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output
    factor = BUILD_MEMORY_FACTORS[IN_MEMORY]
    line = f"memory      fp32: about 0.8 GiB ({factor} x 0.0 GiB of fp32 weights, {IN_MEMORY}); fits the"
    assert line in result.output and "; writes about 0.0 GiB of disk beside its --out" in result.output
    assert "serving     fp32: about 1.0 GiB (its 0.00 GiB of fp32 weights + 1.0 GiB); fits here" in result.output
    memory = json.loads(CliRunner().invoke(app, ["inspect", str(folder), "--json"]).output)["memory"]
    assert list(memory["builds"]) == ["fp32"]  # a quantized build takes the same path: not repeated
    assert memory["builds"]["fp32"]["fits"] and memory["available_bytes"] > memory["builds"]["fp32"]["needed_bytes"]


def test_a_large_checkpoint_has_a_quantized_estimate_of_its_own(tmp_path):
    """Over the external-data threshold the weights stay on disk in fp32; quantizing reads them in."""
    header = json.dumps({"a": {"dtype": "BF16", "shape": [2_840_000, 1000], "data_offsets": [0, 5_680_000_000]},
                         "__metadata__": {"format": "pt"}}).encode()
    folder = tmp_path / "esm2_3b"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    builds = memory_report(folder, available=21 * 2**30)["builds"]
    assert builds["fp32"]["path"] == builds["quantized"]["path"] == WEIGHTS_ON_DISK
    assert builds["quantized"]["factor"] == QUANTIZE_MEMORY_FACTOR > builds["fp32"]["factor"]
    # Where that does not fit, int4 streams (exporters/streamed.py) in a fraction of it.
    builds = memory_report(folder, available=12 * 2**30)["builds"]
    assert not builds["fp32"]["fits"] and builds["quantized"]["path"] == STREAMED and builds["quantized"]["fits"]
    # The disk each writes beside its --out (build.estimate_build_disk): 4 fp32 copies and the fp32
    # copy of the bf16 weights; streamed, the int4 graph alone (its layers widened in memory).
    weights = builds["fp32"]["weights_bytes"]
    assert builds["fp32"]["disk_bytes"] == 4 * weights + weights
    assert builds["quantized"]["disk_bytes"] == int(STORED_WEIGHT_SHARE["int4"] * weights)


def test_inspect_names_the_precision_that_builds_here(tmp_path, monkeypatch):
    """fp32 over the memory available and int4 streamed within it: the command inspect prints asks
    for int4, which builds here."""
    from bionemo_export import procfs
    from bionemo_export.memory_plan import build_memory
    from bionemo_export.models.readers.base import fp32_weight_bytes

    folder = save_random_checkpoint("esm2", tmp_path / "esm2")
    weights = fp32_weight_bytes(folder)
    between = (build_memory(weights, "int4", streamed=True).needed + build_memory(weights).needed) // 2
    monkeypatch.setattr(procfs, "available_memory_bytes", lambda: between)
    result = CliRunner().invoke(app, ["inspect", str(folder)])
    assert result.exit_code == 0, result.output
    command = next(line for line in result.output.splitlines() if line.startswith("build with"))
    assert command.endswith("--precision int4"), result.output


def test_inspect_reports_what_serving_it_needs_in_fp32_and_int4(tmp_path):
    """A 3B-sized checkpoint (the header alone): served in fp32 it holds its 11.4 GB of weights, in
    int4 about a fifth of them, each beside the server's own GiB."""
    header = json.dumps({"a": {"dtype": "F32", "shape": [2_839_005_634], "data_offsets": [0, 11_356_022_536]},
                         "__metadata__": {"format": "pt"}}).encode()
    folder = tmp_path / "esm2_3b"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    serves = memory_report(folder)["serves"]
    assert serves["fp32"]["weights_bytes"] == 11_356_022_536
    assert serves["int4"]["weights_bytes"] == int(11_356_022_536 * STORED_WEIGHT_SHARE["int4"])
    assert serves["fp32"]["needed_bytes"] == SERVE_BASELINE_BYTES + 11_356_022_536
    assert serves["int4"]["text"] == "about 3.0 GiB (its 2.01 GiB of int4 weights + 1.0 GiB)"
