"""The rotary embedding fusion (exporters/optimize/rotary.py) on real exports: ESM-2's and ESM C's
rotary subgraphs each become one RotaryEmbedding node computing the same values, in the stored
optimized graph too; a subgraph that differs from the pattern is left as it is."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from bionemo_export.exporters import export_onnx, verify_onnx
from bionemo_export.exporters.graph_cache import GraphCache
from bionemo_export.exporters.optimize import fuse_attention, optimize_onnx
from bionemo_export.exporters.optimize.rotary import fuse_rotary
from bionemo_export.models import get_family
from bionemo_export.testing.checkpoints import save_random_checkpoint

AMINO_ACIDS = list("ACDEFGHIKLMNPQRSTVWY")


def _encode(loaded, sequences: list[str]) -> dict[str, np.ndarray]:
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


@pytest.fixture(scope="module", params=("esm2", "esmc"))
def tiny(request, tmp_path_factory, graph_cache):
    """(loaded tiny random model, its plain dynamo export), traced on the family's sample batch."""
    folder = tmp_path_factory.mktemp(request.param)
    family = get_family(request.param)
    loaded = family.load(save_random_checkpoint(family.name, folder / "checkpoint", seed=0))
    exported = export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, _encode(loaded, family.sample_sequences()),
                           folder / "model.onnx", cache=GraphCache(graph_cache))
    return loaded, exported.path


def _padded_batch(loaded, seed: int = 0) -> dict[str, np.ndarray]:
    """Random sequences of different lengths: the shorter rows end in padding (attention_mask 0)."""
    rng = np.random.default_rng(seed)
    batch = _encode(loaded, ["".join(rng.choice(AMINO_ACIDS, size=n)) for n in (23, 5, 17, 1)])
    assert (batch["attention_mask"][:, -1] == 0).sum() == 3
    return batch


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    outputs = session.run(None, {name: value for name, value in feeds.items() if name in names})
    return [np.asarray(output) for output in outputs]


def _ops(model: onnx.ModelProto) -> collections.Counter[str]:
    return collections.Counter(node.op_type for node in model.graph.node)


def test_each_rotary_subgraph_becomes_one_node_computing_the_same_values(tiny):
    loaded, plain = tiny
    layers = loaded.description["layers"]
    model = onnx.load(str(plain))
    fused = onnx.ModelProto()
    fused.CopyFrom(model)
    assert fuse_rotary(fused) == 2 * layers  # queries and keys
    onnx.checker.check_model(fused)
    ops = _ops(fused)
    assert ops["RotaryEmbedding"] == 2 * layers
    assert ops["Neg"] == 0 and _ops(model)["Slice"] - ops["Slice"] == 4 * layers  # 2 per rotate_half
    assert ops["Cos"] == ops["Sin"] == 1  # one cache for every layer
    rotary = next(node for node in fused.graph.node if node.op_type == "RotaryEmbedding")
    assert rotary.domain == "com.microsoft"
    assert {a.name: onnx.helper.get_attribute_value(a) for a in rotary.attribute} == {"interleaved": 0}
    batch = _padded_batch(loaded)
    for expected, actual in zip(_run(model, batch), _run(fused, batch), strict=True):
        assert np.abs(expected - actual).max() < 1e-5
    # The attention fusion after it takes the rotated queries and keys, with no Transpose between.
    assert fuse_attention(fused, loaded.description["heads"]) == layers
    for expected, actual in zip(_run(model, batch), _run(fused, batch), strict=True):
        assert np.abs(expected - actual).max() < 1e-5
    view_of = {out: node for node in fused.graph.node for out in node.output}
    for node in fused.graph.node:
        if node.op_type == "MultiHeadAttention":
            for name in node.input[:2]:  # Reshape(Reshape(RotaryEmbedding))
                assert view_of[view_of[view_of[name].input[0]].input[0]].op_type == "RotaryEmbedding"


def test_the_stored_graph_keeps_the_fused_nodes_and_equals_pytorch(tiny, tmp_path):
    loaded, plain = tiny
    layers = loaded.description["layers"]
    result = optimize_onnx(plain, tmp_path / "model.onnx", num_heads=loaded.description["heads"],
                           hidden_size=loaded.hidden_size)
    assert result.fused["RotaryEmbedding"] == 2 * layers
    assert result.fused["MultiHeadAttention"] == layers
    assert result.applied[:2] == (f"rotary_fusion(RotaryEmbedding x{2 * layers})",
                                  f"attention_fusion(MultiHeadAttention x{layers})")
    stored = onnx.load(str(result.path))
    assert _ops(stored)["Transpose"] == 0  # the rotary and attention fusions' Transposes cancel
    family = loaded.family
    batches = [_padded_batch(loaded), _padded_batch(loaded, seed=1), _encode(loaded, ["M"])]
    report = verify_onnx(loaded.encoder, result.path, batches, atol=family.atol, min_cosine=family.min_cosine)
    assert report.passed, report.to_dict()
    assert max(check.max_abs_error for check in report.outputs) < 1e-4


def _second_halves(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The Slices rotate_half negates: x[..., h:]."""
    negated = {node.input[0] for node in model.graph.node if node.op_type == "Neg"}
    return [node for node in model.graph.node if node.op_type == "Slice" and node.output[0] in negated]


def _mutate_start(model: onnx.ModelProto) -> None:
    """rotate_half's second half starts one element early: x[..., h - 1:]."""
    starts = onnx.numpy_helper.to_array(next(i for i in model.graph.initializer
                                             if i.name == _second_halves(model)[0].input[1]))
    model.graph.initializer.append(numpy_helper.from_array(starts - 1, "mutated_start"))
    for node in _second_halves(model):
        node.input[1] = "mutated_start"


def _mutate_order(model: onnx.ModelProto) -> None:
    """Concat(x[..., :h], -x[..., h:]): not rotate_half."""
    for node in model.graph.node:
        if node.op_type == "Concat" and any(n.op_type == "Neg" and n.output[0] == node.input[0]
                                            for n in model.graph.node):
            node.input[0], node.input[1] = node.input[1], node.input[0]


def _mutate_frequencies(model: onnx.ModelProto) -> None:
    """Inverse frequencies of one value: angles broadcast over the head, not a [length, h] table."""
    product = next(node for node in model.graph.node if node.op_type == "Concat"
                   and len(node.input) == 2 and node.input[0] == node.input[1])
    multiply = next(node for node in model.graph.node if node.output[0] == product.input[0])
    model.graph.initializer.append(numpy_helper.from_array(np.array([0.5], dtype=np.float32), "mutated_frequency"))
    multiply.input[1] = "mutated_frequency"


def _mutate_cos_axes(model: onnx.ModelProto) -> None:
    """cos unsqueezed on the heads' axis of x's transpose: [1, length, 1, 2h]."""
    cos = next(node for node in model.graph.node if node.op_type == "Cos")
    unsqueeze = next(node for node in model.graph.node
                     if node.op_type == "Unsqueeze" and node.input[0] == cos.output[0])
    model.graph.initializer.append(numpy_helper.from_array(np.array([2], dtype=np.int64), "mutated_axes"))
    unsqueeze.input[1] = "mutated_axes"


@pytest.mark.parametrize("mutate", [_mutate_start, _mutate_order, _mutate_frequencies, _mutate_cos_axes],
                         ids=["slice_start", "concat_order", "frequencies", "cos_axes"])
def test_a_subgraph_that_differs_from_the_pattern_is_left_unchanged(tiny, mutate):
    _, plain = tiny
    model = onnx.load(str(plain))
    mutate(model)
    before = model.SerializeToString()
    assert fuse_rotary(model) == 0
    assert model.SerializeToString() == before


def test_a_subgraph_whose_values_are_read_elsewhere_is_left_alone(tiny):
    loaded, plain = tiny
    model = onnx.load(str(plain))
    neg = next(node for node in model.graph.node if node.op_type == "Neg")
    model.graph.output.append(onnx.helper.make_tensor_value_info(neg.output[0], onnx.TensorProto.FLOAT, None))
    assert fuse_rotary(model) == 2 * loaded.description["layers"] - 1
    assert _ops(model)["Neg"] == 1
