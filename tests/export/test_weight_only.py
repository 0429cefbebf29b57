"""`--precision int8w` and `int4` builds (exporters/optimize/weight_only.py) and the margin every
quantized graph is accepted with (exporters/optimize/pipeline.py), on a tiny random BERT (AntiBERTy's
layout; a random ESM-2's int4 embeddings measured 0.979, under int4's 0.99: Gaussian random weights
have none of the structure trained ones keep through 4 bits, docs/building.md): the stored
graph holds MatMulNBits, its weights shrink as the format says, it answers new sequences within the
precision's tolerance of PyTorch, manifest.json records how and what it cost, and a graph within
the tolerance but under its margin is refused with the figures."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.choices import Precision
from bionemo_export.exporters import export_onnx, verify_onnx
from bionemo_export.exporters.optimize import pipeline
from bionemo_export.exporters.optimize.pipeline import MARGIN_SHARE, PrecisionError, margin_min_cosine
from bionemo_export.exporters.verification import PRECISION_MIN_COSINE, precision_tolerances
from bionemo_export.models import get_family
from bionemo_export.serving.golden import compare
from bionemo_export.testing.checkpoints import save_random_checkpoint

MATMUL_HEAVY = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "intermediate_size": 512}
"""A shape whose weights are mostly MatMuls (1.5 MB; the 512 position embeddings 0.26 MB)."""
FAMILY = "bert"
NEW_SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQ", "GSHMLE", "ACDEFGHIKLMNPQRSTVWY"]
"""Sequences the build did not check the graph with (its samples are the family's)."""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_random_checkpoint(FAMILY, tmp_path_factory.mktemp("weight-only") / "checkpoint", seed=0,
                                  **MATMUL_HEAVY)


@pytest.fixture(scope="module", params=["int8w", "int4"])
def built(request, checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "repo"
    build_repository(BuildRequest(family=FAMILY, checkpoint=checkpoint, name="ab", out=out, backend="python",
                                  precision=request.param, tasks=("embeddings", "hiddens")))
    return request.param, out


def test_the_stored_graph_holds_matmulnbits_and_weighs_what_the_format_stores(built):
    precision, repo = built
    bits = {"int8w": 8, "int4": 4}[precision]
    graph = repo / "ab_encoder" / "1" / "model.onnx"
    model = onnx.load(str(graph))
    nbits = [node for node in model.graph.node if node.op_type == "MatMulNBits"]
    assert len(nbits) == 6 * MATMUL_HEAVY["num_layers"]  # q, k, v, output, up, down per layer
    assert {onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits")) for node in nbits} \
        == {bits}
    manifest = json.loads((repo / "manifest.json").read_text())
    assert manifest["precision"] == precision
    quantization = manifest["accuracy"]["quantization"]
    assert (quantization["bits"], quantization["block_size"], quantization["accuracy_level"]) == (bits, 32, 4)
    assert quantization == manifest["export"]["encoder"]["optimization"]["quantization"]
    # The MatMuls' weights: 0.16x fp32 at 4 bits (the issue's bound: 0.2x), 0.29x at 8.
    assert quantization["ratio"] <= (0.2 if bits == 4 else 0.3)
    # The file: those, and the rest (embeddings, norms, biases) as fp32 was, and the graph itself.
    stored = graph.stat().st_size + sum(p.stat().st_size for p in graph.parent.glob("model.onnx.data"))
    fp32 = manifest["export"]["encoder"]["weight_bytes"]
    expected = quantization["weight_bytes"] + fp32 - quantization["weight_bytes_fp32"]
    assert expected < stored < expected + 64_000, (stored, expected)


def test_it_answers_new_sequences_within_the_precisions_tolerance_of_pytorch(built, checkpoint):
    precision, repo = built
    loaded = get_family(FAMILY).load(checkpoint)
    encoded = loaded.tokenizer.encode(NEW_SEQUENCES)
    inputs = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
              "residue_mask": encoded.residue_mask}
    session = ort.InferenceSession(str(repo / "ab_encoder" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    answers = {output.name: np.asarray(value) for output, value in
               zip(session.get_outputs(), session.run(None, {n: inputs[n] for n in names}))}
    with torch.inference_mode():
        reference = loaded.encoder(*(torch.from_numpy(inputs[n]) for n in names))
    expected = dict(zip([spec.name for spec in loaded.outputs], (value.numpy() for value in reference)))
    valid = inputs["attention_mask"] != 0
    for name, tolerance in PRECISION_MIN_COSINE[precision].items():
        figures = compare(answers[name], expected[name], valid)
        assert figures.min_cosine >= tolerance, (name, figures)


def test_manifest_records_the_margin_and_the_served_sessions_it_was_checked_in(built):
    precision, repo = built
    accuracy = json.loads((repo / "manifest.json").read_text())["accuracy"]
    assert accuracy["precision"] == precision and accuracy["margin_share"] == MARGIN_SHARE
    assert set(accuracy["sessions"]) >= {"ORT_ENABLE_BASIC, 1 thread"}
    for name, output in accuracy["outputs"].items():
        assert output["required_min_cosine"] == pytest.approx(margin_min_cosine(output["tolerance"]["min_cosine"]))
        assert output["min_cosine"] >= output["required_min_cosine"]
        assert output["min_cosine"] == min(session[name] for session in accuracy["sessions"].values())


def test_a_graph_within_its_tolerance_but_under_the_margin_is_refused_with_the_figures(checkpoint, tmp_path,
                                                                                      monkeypatch):
    """int4 with one candidate and its tolerance set between what the graph measures and that
    tolerance plus its margin: the graph passes the tolerance (the served golden check would load it)
    and the build refuses it all the same, naming the graph, the figures and what to pass instead."""
    family = get_family(FAMILY)
    loaded = family.load(checkpoint)
    batches = []
    for sequences in (family.sample_sequences(), NEW_SEQUENCES[:1]):
        encoded = loaded.tokenizer.encode(sequences)
        batches.append({"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
                        "residue_mask": encoded.residue_mask})
    folder = tmp_path / "encoder"
    folder.mkdir()
    exported = export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, batches[0], folder / "model.onnx")
    names = [spec.name for spec in loaded.outputs]
    plain_report = verify_onnx(loaded.encoder, exported.path, batches, atol=family.atol, min_cosine=family.min_cosine,
                               output_names=names)

    def int4(work: str, log=None):
        return pipeline.optimize_and_verify(
            loaded.encoder, exported.path, plain_report, tmp_path / work, batches, num_heads=MATMUL_HEAVY["num_heads"],
            hidden_size=MATMUL_HEAVY["hidden_size"], atol=family.atol, min_cosine=family.min_cosine,
            output_names=names, mask_input="attention_mask", precision="int4", log=log)

    monkeypatch.setitem(pipeline.ATTEMPTS, "int4", ({},))
    measured = int4("first").report
    # 1 - tolerance = (1 + MARGIN_SHARE / 2) x what the graph misses by: within the tolerance, over
    # 1 - MARGIN_SHARE of it.
    strict = {check.name: 1 - (1 - check.min_cosine) * (1 + MARGIN_SHARE / 2) for check in measured.outputs}
    assert all((1 - check.min_cosine) > (1 - strict[check.name]) * (1 - MARGIN_SHARE) for check in measured.outputs)
    monkeypatch.setitem(PRECISION_MIN_COSINE, "int4", strict)
    logged: list[str] = []
    with pytest.raises(PrecisionError) as refused:
        int4("second", log=logged.append)
    assert len(logged) == 1 and logged[0].startswith("encoder: the int4 graph with all steps is below its margin: ")
    for check in measured.outputs:
        tolerance = precision_tolerances("int4", names, family.atol, family.min_cosine)[check.name].min_cosine
        assert check.min_cosine >= tolerance  # the tolerance alone passes it
        assert f"{check.name} min cosine {check.min_cosine:.6f} (required {margin_min_cosine(tolerance):.6g}: " \
               f"the tolerance {tolerance:g} and a margin)" in logged[0]
    message = str(refused.value)
    assert message.startswith("no int4 graph of encoder meets the int4 tolerance against PyTorch fp32 with its margin")
    assert message.endswith("Build with `precision` int8w (8-bit weights: about twice int4's bytes).")


def test_a_block_size_matmulnbits_does_not_compute_is_refused_before_anything_is_read(checkpoint, tmp_path):
    with pytest.raises(BuildError, match=r"^`block_size` 48: choose one of 16, 32, 64, 128, 256 "):
        build_repository(BuildRequest(family=FAMILY, checkpoint=checkpoint, name="ab", out=tmp_path / "repo",
                                      precision=Precision.INT4, block_size=48))
    assert not (tmp_path / "repo").exists()


def test_weight_only_precisions_are_cpu_graphs(checkpoint, tmp_path):
    with pytest.raises(BuildError, match="`precision` int4 is ONNX Runtime's CPU quantization; on `device` gpu"):
        build_repository(BuildRequest(family=FAMILY, checkpoint=checkpoint, name="ab", out=tmp_path / "repo",
                                      precision=Precision.INT4, backend="tensorrt"))
