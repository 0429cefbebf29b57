"""The key padding folded into the attention heads (exporters/optimize/padding_mask.py): real
encoders' fused graphs lose every attention_bias (so ONNX Runtime's CPU attention takes its flash
path) and compute the same values; a bias that is not a key-padding mask is left as it is."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bionemo_export.exporters import export_onnx
from bionemo_export.exporters.graph_cache import GraphCache
from bionemo_export.exporters.optimize.candidates import fuse_graph, optimize_onnx
from bionemo_export.exporters.optimize.padding_mask import fold_padding_mask
from bionemo_export.models import get_family
from bionemo_export.testing.checkpoints import save_random_checkpoint

AMINO_ACIDS = list("ACDEFGHIKLMNPQRSTVWY")


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    return [np.asarray(out) for out in session.run(None, {k: v for k, v in feeds.items() if k in names})]


def _attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if node.op_type == "MultiHeadAttention"]


# ------------------------------------------------------------------------------ real encoders
@pytest.fixture(scope="module", params=("esm2", "esmc", "bert"))
def fused(request, tmp_path_factory, graph_cache):
    """(loaded tiny random model, its export after the attention fusion)."""
    folder = tmp_path_factory.mktemp(request.param)
    family = get_family(request.param)
    loaded = family.load(save_random_checkpoint(family.name, folder / "checkpoint", seed=0))
    exported = export_onnx(loaded.encoder, loaded.inputs, loaded.outputs,
                           _encode(loaded, family.sample_sequences()), folder / "model.onnx",
                           cache=GraphCache(graph_cache))
    description = loaded.description
    graph = fuse_graph(exported.path, num_heads=description["heads"], hidden_size=description["hidden"])
    return loaded, graph.model, exported.path


def _encode(loaded, sequences: list[str]) -> dict[str, np.ndarray]:
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def test_every_attention_of_an_encoder_loses_its_bias_and_computes_the_same(fused):
    loaded, model, _ = fused
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    layers = loaded.description["layers"]
    assert fold_padding_mask(folded) == layers
    onnx.checker.check_model(folded)
    for node in _attention_nodes(folded):  # query, key, value only: ONNX Runtime's flash condition
        assert len(node.input) == 3 and all(node.input)
    rng = np.random.default_rng(0)
    batch = _encode(loaded, ["".join(rng.choice(AMINO_ACIDS, size=n)) for n in (23, 5, 17, 1)])
    assert (batch["attention_mask"] == 0).sum() > 40  # rows with much padding
    for expected, actual in zip(_run(model, batch), _run(folded, batch), strict=True):
        assert np.abs(expected - actual).max() < 1e-5


def test_the_stored_cpu_graph_is_folded_and_fp16_is_not(fused, tmp_path):
    loaded, _, plain = fused
    description = loaded.description
    stored = optimize_onnx(plain, tmp_path / "fp32" / "model.onnx", num_heads=description["heads"],
                           hidden_size=description["hidden"])
    assert f"padding_mask_folding(MultiHeadAttention x{description['layers']})" in stored.applied
    assert all(len(node.input) == 3 for node in _attention_nodes(onnx.load(str(stored.path))))
    half = optimize_onnx(plain, tmp_path / "fp16" / "model.onnx", num_heads=description["heads"],
                         hidden_size=description["hidden"], precision="fp16")
    assert not any(step.startswith("padding_mask_folding") for step in half.applied)


# ------------------------------------------------------------------------------ made-up graphs
B, L, HEADS, HEAD = 3, 6, 2, 4
WIDTH = HEADS * HEAD


def _attention_graph(bias_nodes: list[onnx.NodeProto], bias: str, *, extra_inputs=(), scale: float | None = 0.5,
                     initializers=()) -> onnx.ModelProto:
    """MultiHeadAttention(query, key, value, attention_bias=Expand(`bias`)) on inputs x_q, x_k, x_v
    [B, L, WIDTH] and attention_mask INT64 [B, L]; `bias_nodes` compute `bias` ([B, 1, 1|L, L])."""
    flat = numpy_helper.from_array(np.array([0, 0, -1], np.int64), "flat")
    nodes = [helper.make_node("Reshape", ["x_q", "flat"], ["q"]), helper.make_node("Reshape", ["x_k", "flat"], ["k"]),
             *bias_nodes,
             helper.make_node("Shape", [bias], ["lead"], start=0, end=2),
             helper.make_node("Shape", ["q"], ["queries"], start=1, end=2),
             helper.make_node("Shape", ["k"], ["keys"], start=1, end=2),
             helper.make_node("Concat", ["lead", "queries", "keys"], ["target"], axis=0),
             helper.make_node("Expand", [bias, "target"], ["bias_full"])]
    attention = helper.make_node("MultiHeadAttention", ["q", "k", "x_v", "", "", "bias_full"], ["out"],
                                 domain="com.microsoft", num_heads=HEADS)
    if scale is not None:
        attention.attribute.append(helper.make_attribute("scale", scale))
    nodes.append(attention)
    inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "length", WIDTH])
              for name in ("x_q", "x_k", "x_v")]
    inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "length"]))
    inputs.extend(extra_inputs)
    graph = helper.make_graph(nodes, "attention", inputs,
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
                              [flat, *initializers])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _padding_bias(kept: float = 0.0, fill: float = float(np.finfo(np.float32).min)) -> tuple[list, list]:
    constants = [numpy_helper.from_array(np.array(kept, np.float32), "kept"),
                 numpy_helper.from_array(np.array(fill, np.float32), "fill"),
                 numpy_helper.from_array(np.array([1, 2], np.int64), "axes")]
    nodes = [helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
             helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"]),
             helper.make_node("Where", ["keep4", "kept", "fill"], ["bias"])]
    return nodes, constants


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {name: rng.standard_normal((B, L, WIDTH), dtype=np.float32)
                                    for name in ("x_q", "x_k", "x_v")}
    mask = np.ones((B, L), np.int64)
    mask[1, 4:] = 0
    mask[2, 1:] = 0
    feeds["attention_mask"] = mask
    return feeds


def _unchanged(model: onnx.ModelProto) -> bool:
    before = model.SerializeToString()
    return fold_padding_mask(model) == 0 and model.SerializeToString() == before


def test_a_made_up_key_padding_mask_is_folded_exactly():
    nodes, constants = _padding_bias()
    model = _attention_graph(nodes, "bias", initializers=constants)
    folded = onnx.ModelProto()
    folded.CopyFrom(model)
    assert fold_padding_mask(folded) == 1
    feeds = _feeds()
    (expected,), (actual,) = _run(model, feeds), _run(folded, feeds)
    valid = feeds["attention_mask"].astype(bool)
    assert np.abs(expected[valid] - actual[valid]).max() < 1e-5


def test_a_causal_mask_is_not_folded():
    nodes, constants = _padding_bias()
    causal = numpy_helper.from_array(np.tril(np.ones((L, L), bool)), "causal")
    nodes[-1] = helper.make_node("And", ["keep4", "causal"], ["visible"])
    nodes.append(helper.make_node("Where", ["visible", "kept", "fill"], ["bias"]))
    assert _unchanged(_attention_graph(nodes, "bias", initializers=[*constants, causal]))


def test_a_bias_read_from_another_input_is_not_folded():
    nodes, constants = _padding_bias()
    nodes[-1] = helper.make_node("Where", ["keep4", "kept", "fill"], ["padding"])
    nodes.append(helper.make_node("Add", ["padding", "position_bias"], ["bias"]))
    position = helper.make_tensor_value_info("position_bias", TensorProto.FLOAT, [1, 1, L, L])
    assert _unchanged(_attention_graph(nodes, "bias", extra_inputs=[position], initializers=constants))


@pytest.mark.parametrize("kept, fill", [(0.5, -1e9), (0.0, -10.0)])
def test_a_bias_that_is_not_zero_or_very_negative_is_not_folded(kept, fill):
    nodes, constants = _padding_bias(kept, fill)
    assert _unchanged(_attention_graph(nodes, "bias", initializers=constants))


def test_an_attention_without_a_stated_scale_is_not_folded():
    # Its scale, 1 / sqrt(head size), would change with the widened heads.
    nodes, constants = _padding_bias()
    assert _unchanged(_attention_graph(nodes, "bias", initializers=constants, scale=None))


def test_a_graph_without_the_padding_input_is_not_folded():
    nodes, constants = _padding_bias()
    model = _attention_graph(nodes, "bias", initializers=constants)
    assert fold_padding_mask(model, padding_input="input_mask") == 0
