"""Graphs rewritten with their weights left on disk (exporters/external_data.py): only small
tensors are read in, and a save copies the referenced weights into the new graph's own data file,
page-aligned, the same values, whichever folder the source lies in."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from bionemo_export.exporters.external_data import (
    ALIGNMENT,
    SMALL_TENSOR_BYTES,
    load_structure,
    load_weights,
    save_streamed,
    tensors,
    unloaded,
)


def _graph(folder):
    """x [b, 512] @ big [512, 1024] + small [1024], with both weights in model.onnx.data."""
    rng = np.random.default_rng(0)
    big = rng.standard_normal((512, 1024)).astype(np.float32)  # 2 MiB: over SMALL_TENSOR_BYTES
    small = rng.standard_normal(1024).astype(np.float32)  # 4 KiB
    assert big.nbytes > SMALL_TENSOR_BYTES > small.nbytes
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "big"], ["h"]), helper.make_node("Add", ["h", "small"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 1024])],
        [numpy_helper.from_array(big, "big"), numpy_helper.from_array(small, "small")])
    folder.mkdir()
    path = folder / "model.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path),
                    save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data",
                    size_threshold=0)
    return path, big, small


def _run(path, x):
    return np.asarray(ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0])


def test_a_graph_is_loaded_without_its_large_weights_and_saved_with_them_copied(tmp_path):
    source, big, small = _graph(tmp_path / "source")
    model = load_structure(source)
    held = {tensor.name: not unloaded(tensor) for tensor in tensors(model)}
    assert held == {"big": False, "small": True}
    target = tmp_path / "elsewhere" / "copy.onnx"
    target.parent.mkdir()
    written = save_streamed(model, target, source_dir=source.parent)
    assert written >= big.nbytes + small.nbytes
    copy = onnx.load(str(target), load_external_data=False)
    for tensor in copy.graph.initializer:
        entries = {entry.key: entry.value for entry in tensor.external_data}
        assert entries["location"] == "copy.onnx.data" and int(entries["offset"]) % ALIGNMENT == 0
    loaded = onnx.load(str(target))
    values = {tensor.name: numpy_helper.to_array(tensor) for tensor in loaded.graph.initializer}
    assert np.array_equal(values["big"], big) and np.array_equal(values["small"], small)
    x = np.random.default_rng(1).standard_normal((3, 512)).astype(np.float32)
    assert np.array_equal(_run(target, x), _run(source, x))


def test_load_weights_reads_every_reference_into_the_graph(tmp_path):
    source, big, _ = _graph(tmp_path / "source")
    model = load_structure(source)
    load_weights(model, source.parent)
    assert not any(unloaded(tensor) for tensor in tensors(model))
    assert np.array_equal(numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "big")), big)
