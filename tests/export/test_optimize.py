"""Stored optimized graphs (exporters/optimize/): fusions that keep the graph equal to PyTorch, the
fallback to the plain export, reduced precision (int8, fp16) with its accuracy cost recorded, and
`verify`'s precision-aware tolerance."""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
import torch

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.choices import ChoiceError, Precision
from bionemo_export.cli.main import error_line
from bionemo_export.exporters import export_onnx, verify_onnx
from bionemo_export.exporters import optimize as optimize_module
from bionemo_export.exporters.graph_cache import GraphCache
from bionemo_export.exporters.optimize import (
    SERVING_GRAPH_OPTIMIZATION_LEVEL,
    OptimizationError,
    attention,
    candidates,
    fuse_attention,
    fuse_graph,
    fused_operators,
    optimize_onnx,
)
from bionemo_export.exporters.signature import dynamic_axes
from bionemo_export.exporters.verification import PRECISION_MIN_COSINE, precision_tolerances
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.models import get_family
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import precision_checks

ENCODER_ONLY = ("embeddings", "hiddens")
"""The encoder graph is what these tests optimize and quantize (the masked-LM head is stored as exported)."""

FAMILIES = ("esm2", "bert")


def _encode(loaded, sequences):
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def _batches(loaded):
    """Mixed lengths with padding, then the shortest and the longest alone: a build's check batches
    (the first one, which the export traces, in the family's order as a build has it)."""
    samples = loaded.family.sample_sequences()
    by_length = sorted(samples, key=len)
    return [_encode(loaded, samples), _encode(loaded, by_length[:1]), _encode(loaded, by_length[-1:])]


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory, graph_cache):
    """(family name, loaded tiny random model, its plain dynamo export). The seed-0 checkpoint that
    builds across the suite export, traced on the batch a build traces: the run's graph cache holds
    its export when one of them ran first (these tests optimize that graph; the export's own tests
    are test_exporters.py)."""
    folder = tmp_path_factory.mktemp(request.param)
    family = get_family(request.param)
    loaded = family.load(save_random_checkpoint(family.name, folder / "checkpoint", seed=0))
    exported = export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, _batches(loaded)[0], folder / "model.onnx",
                           cache=GraphCache(graph_cache))
    return request.param, loaded, exported.path


def _verify(loaded, path, **kwargs):
    family = loaded.family
    return verify_onnx(loaded.encoder, path, _batches(loaded), atol=family.atol, min_cosine=family.min_cosine,
                       **kwargs)


def _layers(loaded) -> int:
    return loaded.description["layers"]


def test_optimized_graph_fuses_attention_and_equals_pytorch(tiny, tmp_path):
    name, loaded, plain = tiny
    result = optimize_onnx(plain, tmp_path / "model.onnx", num_heads=loaded.description["heads"],
                           hidden_size=loaded.hidden_size)
    assert result.fused["MultiHeadAttention"] == _layers(loaded)
    # the rotary fusion (rotary.py) comes first in the families with rotary positions (ESM-2, ESM C)
    fusions = [step for step in result.applied if not step.startswith("rotary_fusion")]
    assert fusions[0] == f"attention_fusion(MultiHeadAttention x{_layers(loaded)})"
    assert result.applied[-1] == "onnxruntime_extended"
    assert result.serving_graph_optimization_level == SERVING_GRAPH_OPTIMIZATION_LEVEL == "ORT_ENABLE_BASIC"
    assert result.nodes_after < result.nodes_before
    stored = onnx.load(str(result.path))
    assert {(o.domain, o.version) for o in stored.opset_import} == {("", 18), ("com.microsoft", 1)}
    assert stored.ir_version == onnx.load(str(plain)).ir_version
    report = _verify(loaded, result.path)
    assert report.passed, report.to_dict()
    # Fewer, larger batch and length combinations still agree (the graph stays dynamic).
    assert {shape[1] for shape in report.batch_shapes} == {len(b["input_ids"][0]) for b in _batches(loaded)}
    assert max(check.max_abs_error for check in report.outputs) < 1e-4


def test_attention_fusion_reads_the_torchscript_exporters_pattern_too(tiny, tmp_path):
    """The legacy exporter transposes keys with one Transpose([0, 2, 3, 1]) and masks with -inf."""
    name, loaded, _ = tiny
    sample = _batches(loaded)[0]
    path = tmp_path / "torchscript.onnx"
    names = [spec.name for spec in loaded.inputs]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(loaded.encoder, tuple(torch.from_numpy(sample[n]) for n in names), str(path), dynamo=False,
                          opset_version=18, input_names=names, output_names=[s.name for s in loaded.outputs],
                          dynamic_axes=dynamic_axes([*loaded.inputs, *loaded.outputs]))
    model = onnx.load(str(path))
    assert fuse_attention(model, loaded.description["heads"]) == _layers(loaded)
    fused = tmp_path / "fused.onnx"
    onnx.save(model, str(fused))
    assert _verify(loaded, fused).passed


def test_a_subgraph_whose_values_are_used_elsewhere_is_left_alone(tiny):
    _, loaded, plain = tiny
    model = onnx.load(str(plain))
    softmax = next(node for node in model.graph.node if node.op_type == "Softmax")
    model.graph.output.append(onnx.helper.make_tensor_value_info(softmax.output[0], onnx.TensorProto.FLOAT, None))
    fused = fuse_attention(model, loaded.description["heads"])
    assert fused == _layers(loaded) - 1
    assert softmax.output[0] in {o for node in model.graph.node for o in node.output}


def test_build_stores_the_optimized_graph_and_records_the_optimizations(tmp_path):
    family = get_family("esm2")
    checkpoint = save_random_checkpoint(family.name, tmp_path / "checkpoint")
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                           backend="python", tasks=ENCODER_ONLY))
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    optimization = manifest["export"]["encoder"]["optimization"]
    assert optimization["fallback"] is None
    assert optimization["precision"] == "fp32" and manifest["precision"] == "fp32"
    assert optimization["applied"][:2] == ["rotary_fusion(RotaryEmbedding x4)",
                                           "attention_fusion(MultiHeadAttention x2)"]
    assert "onnxruntime_extended" in optimization["applied"]
    assert optimization["serving_graph_optimization_level"] == "ORT_ENABLE_BASIC"
    stored = onnx.load(str(next((tmp_path / "repo").rglob("model.onnx"))))
    assert fused_operators(stored) == optimization["fused"]
    assert fused_operators(stored)["MultiHeadAttention"] == 2
    verification = manifest["verification"]["graphs"]["encoder"]
    assert verification["optimized"] and verification["passed"]
    assert verification["unoptimized"]["outputs"][0]["name"] == "hiddens"
    assert manifest["accuracy"]["outputs"]["embeddings"]["min_cosine"] > 0.9999
    assert result.manifest == Manifest.read(tmp_path / "repo") and result.manifest.to_dict() == manifest


def _no_fusion_verifies(monkeypatch):
    """Corrupt the attention fusion (a wrong scale): the optimized graph no longer verifies."""
    original = attention._fused_nodes

    def wrong_scale(match, *args):
        match.scale *= 1.5
        return original(match, *args)

    monkeypatch.setattr(attention, "_fused_nodes", wrong_scale)


def test_an_optimized_graph_that_fails_verification_falls_back_to_the_plain_export(tmp_path, monkeypatch, caplog):
    _no_fusion_verifies(monkeypatch)
    family = get_family("bert")
    checkpoint = save_random_checkpoint(family.name, tmp_path / "checkpoint")
    messages = []
    build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="b", out=tmp_path / "repo",
                                  backend="python", tasks=("embeddings",)), progress=messages.append)
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    optimization = manifest["export"]["encoder"]["optimization"]
    assert optimization["applied"] == [] and optimization["level"] == "none"
    assert "min cosine" in optimization["fallback"] and optimization["rejected"][0]["figures"]
    assert optimization["serving_graph_optimization_level"] == "ORT_ENABLE_ALL"
    assert any("keeping the unoptimized graph" in m for m in messages)
    assert any("keeping the unoptimized graph" in r.getMessage() for r in caplog.records)
    stored = onnx.load(str(next((tmp_path / "repo").rglob("model.onnx"))))
    assert "MultiHeadAttention" not in fused_operators(stored)
    assert not manifest["verification"]["graphs"]["encoder"]["optimized"]


def test_an_optimizer_error_falls_back_with_its_reason(tiny, tmp_path, monkeypatch):
    _, loaded, plain = tiny

    def broken(model, num_heads):
        raise KeyError("unexpected pattern")

    monkeypatch.setattr(candidates, "fuse_attention", broken)
    with pytest.raises(OptimizationError, match="attention fusion failed: KeyError"):
        optimize_onnx(plain, tmp_path / "model.onnx", num_heads=4, hidden_size=loaded.hidden_size)
    report = _verify(loaded, plain)
    chosen = optimize_module.optimize_and_verify(
        loaded.encoder, plain, report, tmp_path / "work", _batches(loaded), num_heads=4,
        hidden_size=loaded.hidden_size, atol=1e-4, min_cosine=0.9999, output_names=["hiddens", "embeddings"],
        mask_input="attention_mask", log=lambda message: None)
    assert chosen.path == plain and chosen.report is report
    assert "attention fusion failed: KeyError" in (chosen.record.fallback or "")


def test_external_data_graphs_are_optimized_into_one_weights_file(tiny, tmp_path):
    _, loaded, plain = tiny
    result = optimize_onnx(plain, tmp_path / "model.onnx", num_heads=loaded.description["heads"],
                           hidden_size=loaded.hidden_size, external_data=True)
    assert result.external_data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert any("transformer_fusions" in reason for reason in result.skipped)
    assert result.fused["MultiHeadAttention"] == _layers(loaded)
    assert _verify(loaded, result.path).passed


def test_a_build_with_external_data_stores_the_optimized_graph_and_one_weights_file(tmp_path, monkeypatch):
    from bionemo_export.exporters import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)
    monkeypatch.setattr(candidates, "INLINE_LIMIT_BYTES", 1000)
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint")
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                  backend="python", tasks=("embeddings",)))
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    optimization = manifest["export"]["encoder"]["optimization"]
    assert optimization["external_data"] and optimization["fallback"] is None
    assert optimization["fused"]["MultiHeadAttention"] == 2
    graph = next((tmp_path / "repo").rglob("model.onnx"))
    assert sorted(p.name for p in graph.parent.iterdir() if p.name.startswith("model.onnx")) == [
        "model.onnx", "model.onnx.data"]


def test_a_graph_too_large_for_the_free_memory_is_not_optimized(tiny, tmp_path, monkeypatch):
    _, loaded, plain = tiny
    monkeypatch.setattr(candidates, "available_memory_bytes", lambda: 1000)
    with pytest.raises(OptimizationError, match="needs about .* GiB of free memory"):
        optimize_onnx(plain, tmp_path / "model.onnx", num_heads=4, hidden_size=loaded.hidden_size)
    assert not (tmp_path / "model.onnx").exists()


def test_int8_keeps_the_share_of_feed_forward_outputs_asked_in_fp32(tiny, tmp_path):
    _, loaded, plain = tiny
    heads, layers = loaded.description["heads"], _layers(loaded)
    calibration = _batches(loaded)[0]
    kept = {}
    for fraction in (0.0, 0.25, 1.0):
        result = optimize_onnx(plain, tmp_path / f"{fraction}.onnx", num_heads=heads, hidden_size=loaded.hidden_size,
                               precision="int8", keep_fp32=fraction, calibration=calibration)
        quantization = result.to_dict()["quantization"]
        kept[fraction] = quantization["kept_fp32"]
        assert quantization["matmuls_fp32"] == len(kept[fraction])
        assert quantization["matmuls_int8"] == 6 * layers - len(kept[fraction])
    assert (len(kept[0.0]), len(kept[0.25]), len(kept[1.0])) == (0, 1, layers)
    assert set(kept[0.25]) < set(kept[1.0])
    with pytest.raises(ValueError, match="fraction"):
        optimize_onnx(plain, tmp_path / "x.onnx", num_heads=heads, hidden_size=loaded.hidden_size, keep_fp32=2)


def test_a_ladder_fused_once_writes_the_graphs_each_candidate_fused_alone_writes(tiny, tmp_path):
    """An int8 ladder fuses the export once (fuse_graph), ranks its feed-forward outputs and quantizes
    the other MatMuls once per weights' type: every candidate is byte for byte the file optimize_onnx
    writes alone."""
    _, loaded, plain = tiny
    heads, calibration = loaded.description["heads"], _batches(loaded)[0]
    shared = fuse_graph(plain, num_heads=heads, hidden_size=loaded.hidden_size)
    for weights in ("int8", "uint8"):
        for fraction in (0.0, 0.5):
            alone, together = (
                optimize_onnx(plain, tmp_path / f"{kind}-{weights}-{fraction}.onnx", num_heads=heads,
                              hidden_size=loaded.hidden_size, precision="int8", keep_fp32=fraction,
                              int8_weights=weights, calibration=calibration, fused=fused)
                for kind, fused in (("alone", None), ("shared", shared)))
            assert together.path.read_bytes() == alone.path.read_bytes(), (weights, fraction)
            assert together.to_dict()["quantization"] == alone.to_dict()["quantization"]
    fp32 = optimize_onnx(plain, tmp_path / "fp32.onnx", num_heads=heads, hidden_size=loaded.hidden_size, fused=shared)
    alone = optimize_onnx(plain, tmp_path / "fp32-alone.onnx", num_heads=heads, hidden_size=loaded.hidden_size)
    assert fp32.path.read_bytes() == alone.path.read_bytes()
    with pytest.raises(ValueError, match="fuse=True"):  # made for another candidate: refused, not used
        optimize_onnx(plain, tmp_path / "x.onnx", num_heads=heads, hidden_size=loaded.hidden_size, fuse=False,
                      fused=shared)


def test_int8_build_of_antiberty_keeps_embeddings_within_cosine_0_999(tmp_path):
    """The real AntiBERTy: int8 embeddings against PyTorch fp32, measured by the build and recorded."""
    from bionemo_export.models.bert import antiberty_checkpoint

    build_repository(BuildRequest(family="bert", checkpoint=antiberty_checkpoint(), name="antiberty",
                                  out=tmp_path / "repo", backend="python", precision=Precision.INT8,
                                  tasks=ENCODER_ONLY))
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    assert manifest["precision"] == "int8"
    accuracy = manifest["accuracy"]
    assert accuracy["precision"] == "int8" and accuracy["reference"] == "PyTorch fp32"
    assert accuracy["outputs"]["embeddings"]["min_cosine"] >= 0.999
    assert accuracy["outputs"]["embeddings"]["tolerance"]["min_cosine"] == 0.999
    assert accuracy["outputs"]["hiddens"]["min_cosine"] >= PRECISION_MIN_COSINE["int8"]["hiddens"]
    optimization = manifest["export"]["encoder"]["optimization"]
    assert optimization["precision"] == "int8" and "quantize_dynamic(int8)" in optimization["applied"]
    quantization = optimization["quantization"]
    assert quantization["matmuls_int8"] > 6 * 8 * 3 // 4  # at most a few feed-forward outputs kept fp32
    assert quantization["matmuls_fp32"] == len(quantization["kept_fp32"])
    assert accuracy["outputs"]["embeddings"]["min_cosine"] >= accuracy["outputs"]["embeddings"]["required_min_cosine"]
    for rejected in optimization["rejected"]:  # the tries before: recorded with their figures, under the margin
        assert any(f["min_cosine"] < f["required_min_cosine"] for f in rejected["figures"].values())
        assert rejected["figures"]["embeddings"]["required_min_cosine"] == pytest.approx(0.9991)
    # Both graphs from every build host: the u8s8 one for VNNI/AMX hosts (a host without VNNI checks it
    # through its exact u8u8 twin, the integers VNNI hosts sum) and the u8u8 one for the others.
    assert quantization["weights"] == "int8"
    assert manifest["export"]["encoder"]["optimization_no_vnni"]["quantization"]["weights"] == "uint8"
    stored = onnx.load(str(next((tmp_path / "repo").rglob("model.onnx"))))
    assert {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"} & set(fused_operators(stored))
    # Graph inputs and outputs keep their types.
    assert [o.type.tensor_type.elem_type for o in stored.graph.output] == [onnx.TensorProto.FLOAT] * 2


def test_fp16_build_keeps_float32_inputs_and_outputs(tmp_path):
    family = get_family("esm2")
    checkpoint = save_random_checkpoint(family.name, tmp_path / "checkpoint")
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                  backend="python", precision=Precision.FP16, tasks=("embeddings",)))
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    assert manifest["precision"] == "fp16"
    assert manifest["accuracy"]["outputs"]["embeddings"]["min_cosine"] >= PRECISION_MIN_COSINE["fp16"]["embeddings"]
    optimization = manifest["export"]["encoder"]["optimization"]
    assert optimization["serving_graph_optimization_level"] == "ORT_ENABLE_ALL"  # the GPU host optimizes
    # layer norms and the residual sums they read stay fp32 (2 layers: 2 x 2 norms + the final one)
    assert optimization["quantization"]["normalizations_fp32"] == 5
    assert optimization["quantization"]["residual_additions_fp32"] == 4
    stored = onnx.load(str(next((tmp_path / "repo").rglob("model.onnx"))))
    assert any(init.data_type == onnx.TensorProto.FLOAT16 for init in stored.graph.initializer)
    assert [o.type.tensor_type.elem_type for o in stored.graph.output] == [onnx.TensorProto.FLOAT] * 2


def test_a_precision_nothing_meets_fails_the_build_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setitem(PRECISION_MIN_COSINE, "int8", {"embeddings": 1.01, "hiddens": 1.01})
    family = get_family("esm2")
    checkpoint = save_random_checkpoint(family.name, tmp_path / "checkpoint")
    refused = r"no int8 graph of encoder meets .* with its margin .* fp32 or fp16\.$"
    with pytest.raises(BuildError, match=refused) as failed:
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                      backend="python", precision=Precision.INT8, tasks=("embeddings",)))
    assert error_line(failed.value).endswith(". Build with --precision int8w (weight-only: closer to fp32), fp32 or "
                                             "fp16.")  # the command line's words
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    with pytest.raises(BuildError, match="`precision` 'int2'"):
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                      precision="int2"))  # pyright: ignore[reportArgumentType]


def test_optimize_onnx_refuses_a_precision_or_level_none_of_the_choices(tmp_path):
    # Refused before the graph is read: the choices are bionemo_export.choices' Precision and OptimizationLevel.
    with pytest.raises(ChoiceError, match="^`precision` 'int2': choose one of fp32, int8, int8w, int4, fp16$"):
        optimize_onnx(tmp_path / "in.onnx", tmp_path / "out.onnx", num_heads=None, hidden_size=None, precision="int2")
    with pytest.raises(ChoiceError, match="^`level` 'all': choose one of none, basic, extended$"):
        optimize_onnx(tmp_path / "in.onnx", tmp_path / "out.onnx", num_heads=None, hidden_size=None, level="all")


def test_verify_holds_a_repository_to_its_precisions_tolerance():
    family = get_family("bert")
    fp32, notes = precision_checks(Manifest(name="m", family="bert", tasks=["embeddings"]), family)
    assert fp32["embeddings"].atol == family.atol and notes == {}
    manifest = Manifest(name="m", family="bert", tasks=["embeddings"], precision="int8",
                        accuracy={"outputs": {"embeddings": {"min_cosine": 0.99951, "max_abs_error": 0.08}}})
    int8, notes = precision_checks(manifest, family)
    assert int8["embeddings"].min_cosine == 0.999 and int8["embeddings"].atol == float("inf")
    assert "int8 vs fp32 PyTorch" in notes["embeddings"] and "0.999510" in notes["embeddings"]
    # A build asked for its own tolerance (`--min-cosine`): verify holds the graph to what the build did.
    asked = Manifest(name="m", family="bert", tasks=["embeddings"], precision="int4", accuracy={"outputs": {
        "embeddings": {"min_cosine": 0.93, "max_abs_error": 0.5, "tolerance": {"atol": "inf", "min_cosine": 0.9}}}})
    int4, _ = precision_checks(asked, family)
    assert int4["embeddings"].min_cosine == 0.9 and int4["hiddens"].min_cosine == 0.96  # hiddens: int4's own
    assert precision_tolerances("int4", ["hiddens"], 1e-4, 0.9999, asked=0.8)["hiddens"].min_cosine == 0.8
    assert precision_tolerances("fp16", ["hiddens"], 1e-4, 0.9999)["hiddens"].min_cosine == 0.999
    with pytest.raises(ValueError, match="unknown precision"):
        precision_tolerances("int2", ["hiddens"], 1e-4, 0.9999)


def test_cli_build_accepts_precision_and_reports_the_tolerance(tmp_path):
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint")
    result = CliRunner().invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(checkpoint),
                                      "--name", "esm", "--out", str(tmp_path / "repo"), "--backend", "python",
                                      "--tasks", "embeddings", "--precision", "int8"])
    assert result.exit_code == 0, result.output
    assert "int8" in result.output and "cosine >=" in result.output
    manifest = json.loads((tmp_path / "repo" / "manifest.json").read_text())
    assert manifest["precision"] == "int8"
    assert np.isfinite(manifest["accuracy"]["outputs"]["embeddings"]["min_cosine"])


def test_verify_reports_the_served_int8_accuracy_cost(tmp_path):
    """An int8 repository served by the real tritonserver, checked by `verify` with int8's tolerance."""
    from bionemo_export.verify import verify_repository

    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint")
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=tmp_path / "repo",
                                  backend="python", precision=Precision.INT8, tasks=ENCODER_ONLY))
    checks = verify_repository(tmp_path / "repo", checkpoint)  # on the embedded tritonserver
    assert checks and all(check.passed for check in checks), [c.to_dict() for c in checks]
    assert {check.model for check in checks} == {"esm_embeddings", "esm_hiddens"}
    assert all(check.note.startswith("int8 vs fp32 PyTorch: min cosine >= ") and "build: min cosine" in check.note
               for check in checks)
    # the int8 graph is what was served
    assert all(check.min_cosine is not None and check.min_cosine < 1.0 - 1e-7 for check in checks)
