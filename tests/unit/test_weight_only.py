"""Weight-only quantization (exporters/optimize/weight_only.py) on small hand-built graphs: every
MatMul of constant weights becomes MatMulNBits with the bits, block size and accuracy level asked,
the weights shrink by what the format stores, the answers stay near fp32 (8 bits nearer than 4),
and the feed-forward outputs a candidate keeps stay fp32 (int8w) or 8-bit (int4)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper

from bionemo_export.exporters.optimize.weight_only import check_settings, quantize_weight_only
from tests.helpers.onnx_graphs import feed_forward_graph

WIDTH, INNER = 64, 256


def _feed_forward(blocks: int = 2) -> onnx.ModelProto:
    """x [n, 64] -> `blocks` feed-forward blocks (up MatMul "upB", erf GELU, down MatMul "downB"), each
    added to its input -> y. Weights drawn like a trained layer's (normal, 1/sqrt(K))."""
    return feed_forward_graph(WIDTH, INNER, blocks, seed=7, scaled=True, residual=True)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": x})[0])


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.parametrize(("precision", "bits"), [("int8w", 8), ("int4", 4)])
@pytest.mark.parametrize("block_size", [32, 64])
def test_every_constant_matmul_becomes_matmulnbits_and_the_weights_shrink_by_the_format(precision, bits, block_size):
    model = _feed_forward()
    shapes = [tuple(init.dims) for init in model.graph.initializer if init.name[:2] == "w_"]
    fp32_bytes = sum(4 * k * n for k, n in shapes)
    quantized, record = quantize_weight_only(_copy(model), precision, block_size=block_size, accuracy_level=4)
    nbits = [node for node in quantized.graph.node if node.op_type == "MatMulNBits"]
    assert len(nbits) == record.matmuls_quantized == 4 and record.matmuls_fp32 == 0
    assert not [node for node in quantized.graph.node if node.op_type == "MatMul"]
    for node in nbits:
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert (attributes["bits"], attributes["block_size"], attributes["accuracy_level"]) == (bits, block_size, 4)
    # Per column of K weights: bits/8 bytes a weight, and per block an fp32 scale and a zero point of
    # `bits` bits (packed two to a byte at 4 bits, a column's last byte maybe half used).
    expected = sum(n * (k * bits // 8 + 4 * (k // block_size) + -(-(k // block_size) * bits // 8)) for k, n in shapes)
    assert record.weight_bytes_fp32 == fp32_bytes
    assert record.weight_bytes == expected
    if bits == 4 and block_size == 32:
        assert record.ratio <= 0.2  # the bound on int4 weight files
    assert record.to_dict()["block_size"] == block_size and record.bits == bits


def test_eight_bits_answer_nearer_fp32_than_four_and_both_near_it():
    model = _feed_forward()
    x = np.random.default_rng(1).standard_normal((16, WIDTH)).astype(np.float32)
    exact = _run(model, x)
    errors = {precision: _relative_error(_run(quantize_weight_only(_copy(model), precision)[0], x), exact)
              for precision in ("int8w", "int4")}
    assert errors["int8w"] < 0.01 and errors["int4"] < 0.1, errors
    assert errors["int8w"] < errors["int4"] / 4, errors


def test_a_candidate_keeps_the_feed_forward_outputs_fp32_for_int8w_and_8_bit_for_int4():
    model = _feed_forward()
    kept_fp32, int8w = quantize_weight_only(_copy(model), "int8w", keep_share=1.0)
    assert sorted(int8w.kept) == ["down0", "down1"] and int8w.kept_as == "fp32"
    assert sorted(node.name for node in kept_fp32.graph.node if node.op_type == "MatMul") == ["down0", "down1"]
    assert int8w.matmuls_quantized == 2 and int8w.matmuls_fp32 == 2

    kept_8bit, int4 = quantize_weight_only(_copy(model), "int4", keep_share=0.5)
    assert int4.kept == ["down1"] and int4.kept_as == "8 bits"  # last layers first
    bits = {node.name: helper.get_attribute_value(next(a for a in node.attribute if a.name == "bits"))
            for node in kept_8bit.graph.node if node.op_type == "MatMulNBits"}
    assert sorted(bits.values()) == [4, 4, 4, 8] and bits[next(n for n in bits if n.startswith("down1"))] == 8
    x = np.random.default_rng(2).standard_normal((16, WIDTH)).astype(np.float32)
    exact = _run(model, x)
    all_4bit = _run(quantize_weight_only(_copy(model), "int4")[0], x)
    assert _relative_error(_run(kept_8bit, x), exact) < _relative_error(all_4bit, exact)


def test_settings_outside_the_choices_are_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"^`block_size` 48: choose one of 16, 32, 64, 128, 256$"):
        check_settings("int4", 48, 4)
    with pytest.raises(ValueError, match=r"^`accuracy_level` 5: choose one of 0, 1, 2, 3, 4$"):
        check_settings("int8w", 32, 5)
    with pytest.raises(ValueError, match="`precision` 'int8' is not weight-only: choose one of int8w, int4"):
        check_settings("int8", 32, 4)
    assert check_settings("int4", 16, 0) == 4


@pytest.mark.parametrize("precision, keep", [("int4", 0.5), ("int8w", 0.0)])
def test_weights_left_on_disk_are_read_one_at_a_time_into_the_same_bytes(tmp_path, monkeypatch, precision, keep):
    """A graph whose weights stay in their file (what a large model's build quantizes) is quantized
    one MatMul's weights at a time, with the int4 kept products' 8-bit pass too: never two fp32
    weights in memory at once, none left loaded, and the quantized graph the same bytes as with every
    weight in memory."""
    from onnx.external_data_helper import convert_model_to_external_data

    import bionemo_export.exporters.optimize.weight_only as weight_only
    from bionemo_export.exporters.external_data import save_streamed, tensors, unloaded

    in_memory = feed_forward_graph(64, 128, 3, seed=5, scaled=True, residual=True)
    on_disk = onnx.ModelProto()
    on_disk.CopyFrom(in_memory)
    convert_model_to_external_data(on_disk, all_tensors_to_one_file=True, location="weights.data", size_threshold=0)
    onnx.save_model(on_disk, str(tmp_path / "model.onnx"))
    structure = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert all(unloaded(tensor) for tensor in structure.graph.initializer)

    loaded, most = [], [0]
    original = weight_only.load_external_data_for_tensor
    fp32 = {t.name for t in in_memory.graph.initializer if t.name.startswith("w_")}

    def counting(tensor, base_dir):
        original(tensor, base_dir)
        loaded.append(tensor)
        most[0] = max(most[0], sum(t.HasField("raw_data") and t.name in fp32 for t in structure.graph.initializer))

    monkeypatch.setattr(weight_only, "load_external_data_for_tensor", counting)
    streamed, record = quantize_weight_only(structure, precision, keep_share=keep, source_dir=tmp_path)
    expected, expected_record = quantize_weight_only(in_memory, precision, keep_share=keep)
    assert len(loaded) == 6 and most[0] == 1  # every MatMul's weights, each alone
    assert record == expected_record and (record.kept_as, len(record.kept)) == (
        ("8 bits", 2) if precision == "int4" else ("fp32", 0))
    assert not fp32 & {t.name for t in streamed.graph.initializer}  # the fp32 weights are gone
    assert not [t.name for t in tensors(streamed) if t.HasField("raw_data") and unloaded(t)]
    mine = {t.name: t.raw_data for t in streamed.graph.initializer if t.HasField("raw_data")}
    assert mine and mine == {t.name: t.raw_data for t in expected.graph.initializer if t.name in mine}
    save_streamed(streamed, tmp_path / "quantized.onnx", source_dir=tmp_path)
    x = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    options = ort.SessionOptions()
    got = np.asarray(ort.InferenceSession(str(tmp_path / "quantized.onnx"), options).run(None, {"x": x})[0])
    want = np.asarray(ort.InferenceSession(expected.SerializeToString(), options).run(None, {"x": x})[0])
    np.testing.assert_array_equal(got, want)
