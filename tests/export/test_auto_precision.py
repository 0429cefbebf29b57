"""`build --precision auto` (build_precision.py, build._build_choosing_precision): the precisions it
tries on each kind of host, int8's two gates (accuracy, then speed against fp32 timed here), the
fallback to fp32 with the refusal recorded, and a published repository that is the fp32 or int8
build as if asked for by name. Real tiny ESM-2 builds; the speed floor is set where the outcome is
known (a graph cannot run 1000x fp32) or read back against the figures the build recorded."""

from __future__ import annotations

import json

import pytest

from bionemo_export.build import BuildError, BuildRequest, PrecisionRefused, build_repository
from bionemo_export.build_precision import AUTO_INT8_MIN_SPEEDUP, candidate_precisions
from bionemo_export.choices import Precision
from bionemo_export.exporters.optimize.pipeline import ATTEMPTS
from bionemo_export.exporters.verification import PRECISION_MIN_COSINE
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.serving.host import cpu_description

TASKS = ("embeddings",)


def _manifest(repository) -> dict:
    return json.loads((repository / "manifest.json").read_text())


def test_candidates_follow_the_device_and_the_memory():
    cpu = candidate_precisions(cpu_kernels=True, tensorrt=False)
    assert cpu.precisions == ("int8", "fp32") and f"{AUTO_INT8_MIN_SPEEDUP:g}x" in cpu.why
    assert candidate_precisions(cpu_kernels=False, tensorrt=False).precisions == ("fp16", "fp32")
    assert candidate_precisions(cpu_kernels=False, tensorrt=True).precisions == ("fp32",)
    only_fp32 = candidate_precisions(cpu_kernels=True, tensorrt=False, fits=lambda p: p == "fp32")
    assert only_fp32.precisions == ("fp32",) and "does not fit" in only_fp32.why
    streamed = candidate_precisions(cpu_kernels=True, tensorrt=False, fits=lambda p: False)
    assert streamed.precisions == ("int8w",) and "weight by weight" in streamed.why


def test_requests_auto_cannot_take_are_refused_before_loading(esm2_checkpoint, tmp_path):
    with pytest.raises(BuildError, match="`stream-weights` writes int4 or int8w graphs; `precision` auto"):
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=tmp_path / "r",
                                      precision="auto", streamed=True))
    with pytest.raises(BuildError, match="`min_int8_speedup` 0"):
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=tmp_path / "r",
                                      precision=Precision.INT8, min_int8_speedup=0))
    with pytest.raises(BuildError, match="`precision` 'int2': choose one of fp32, int8, int8w, int4, fp16, auto"):
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=tmp_path / "r",
                                      precision="int2"))  # pyright: ignore[reportArgumentType]
    assert not list(tmp_path.iterdir())


def test_int8_under_its_speed_floor_falls_back_to_fp32_through_a_temporary_graph_cache(esm2_checkpoint, tmp_path):
    """No graph runs at 1000x fp32: int8 passes its accuracy gate, is refused for its speed (the
    figures named), and the fp32 build is published, the plain export reused from a graph cache
    beside `out` that is gone afterwards."""
    out = tmp_path / "built" / "repo"
    messages: list[str] = []
    build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=out, backend="python",
                                  tasks=TASKS, precision="auto", min_int8_speedup=1000.0, graph_cache=None),
                     progress=messages.append)
    manifest = _manifest(out)
    assert manifest["precision"] == "fp32" and manifest["accuracy"]["precision"] == "fp32"
    choice = manifest["precision_choice"]
    assert choice["asked"] == "auto" and choice["chosen"] == "fp32" and choice["tried"] == ["int8", "fp32"]
    assert [r["precision"] for r in choice["refused"]] == ["int8"]
    assert "x the fp32 graph's speed here" in choice["refused"][0]["why"]
    assert "under the 1000x" in choice["refused"][0]["why"]
    assert choice["host"] == cpu_description()
    assert any(m.startswith("precision auto: int8 refused") for m in messages)
    assert any("graph cache" in m or "exporting the encoder graph" in m for m in messages)
    assert sorted(p.name for p in out.parent.iterdir()) == ["repo"]  # the scratch cache removed
    assert check_repository(out) == []


def test_int8_missing_its_accuracy_gate_falls_back_to_fp32(esm2_checkpoint, tmp_path, monkeypatch):
    """An int8 gate no graph meets (cosine 1.01), with one int8 candidate instead of the ladder
    (test_optimize.py climbs the ladder; here every rung would be refused alike, twice per build:
    each int8 weights' type)."""
    monkeypatch.setitem(PRECISION_MIN_COSINE, "int8", {"embeddings": 1.01, "hiddens": 1.01})
    monkeypatch.setitem(ATTEMPTS, Precision.INT8, ATTEMPTS[Precision.INT8][:1])
    build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=tmp_path / "repo",
                                  backend="python", tasks=TASKS, precision="auto", min_cosine=0.9999999))
    choice = _manifest(tmp_path / "repo")["precision_choice"]
    assert choice["chosen"] == "fp32" and choice["refused"][0]["precision"] == "int8"
    assert "meets" in choice["refused"][0]["why"]  # the accuracy gate's message, with its figures
    # Asked by name, the same refusal fails the build (PrecisionRefused is a BuildError).
    with pytest.raises(PrecisionRefused):
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm", out=tmp_path / "x",
                                      backend="python", tasks=TASKS, precision=Precision.INT8))


def test_cli_auto_keeps_int8_exactly_when_it_pays_here(esm2_checkpoint, tmp_path):
    """The default floor, on whatever CPU runs the test: the choice must agree with the speed the
    build recorded (int8 kept: at least the floor; refused: the message names the figures)."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    result = CliRunner().invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(esm2_checkpoint),
                                      "--name", "esm", "--out", str(tmp_path / "repo"), "--backend", "python",
                                      "--tasks", "embeddings", "--precision", "auto"])
    assert result.exit_code == 0, result.output
    manifest = _manifest(tmp_path / "repo")
    choice = manifest["precision_choice"]
    assert f"precision auto chose {manifest['precision']}" in result.output
    if manifest["precision"] == "int8":
        assert manifest["export"]["encoder"]["int8_speed_on_build_host"]["int8_vs_fp32"] >= AUTO_INT8_MIN_SPEEDUP
        assert choice["refused"] == []
    else:
        assert manifest["precision"] == "fp32" and choice["refused"][0]["precision"] == "int8"
        assert "int8 refused" in result.output
