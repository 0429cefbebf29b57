"""Golden answers without a server (serving/golden.py): real ONNX Runtime sessions on small
hand-made graphs check themselves, refuse or warn, and int8 weight types per CPU kind (the int8
ESM-2 repository on an emulated CPU and served: tests/e2e/test_golden.py)."""


from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from bionemo_export.serving import golden as golden_module
from bionemo_export.serving import host as host_module
from bionemo_export.serving import onnx_session
from bionemo_export.serving.golden import CHECK_ENV, check_at_load, check_mode, read_golden, write_golden

WEIGHTS = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)


def matmul_graph(folder: Path, weights: np.ndarray = WEIGHTS) -> Path:
    """hiddens [B, L, 3] = x [B, L, 4] @ weights, saved as folder/model.onnx."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["hiddens"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "length", 4]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "length"])],
        [helper.make_tensor_value_info("hiddens", TensorProto.FLOAT, ["batch", "length", 3])],
        [numpy_helper.from_array(weights, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    return folder / "model.onnx"


def golden_inputs() -> dict[str, np.ndarray]:
    x = np.random.default_rng(1).standard_normal((2, 5, 4)).astype(np.float32)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=np.int64)
    return {"x": x, "attention_mask": mask}


def store(folder: Path, reference: np.ndarray, min_cosine: float = 0.999, atol: float = 1e-4) -> Path:
    inputs = golden_inputs()
    path = folder / golden_module.GOLDEN_FILE
    write_golden(str(path), inputs, {"hiddens": reference}, mask_input="attention_mask",
                 tolerances={"hiddens": (atol, min_cosine)}, figures={"hiddens": {"max_abs_error": 1e-7,
                                                                                  "min_cosine": 1.0}})
    return path


def session(graph: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])


def test_golden_answers_round_trip_without_pickle(tmp_path):
    graph = matmul_graph(tmp_path)
    path = store(tmp_path, golden_inputs()["x"] @ WEIGHTS)
    with np.load(path, allow_pickle=False) as stored:  # numpy alone reads it
        assert set(stored.files) == {"meta", "input:x", "input:attention_mask", "reference:hiddens"}
    golden = read_golden(str(path))
    assert golden.mask_input == "attention_mask" and golden.tolerances == {"hiddens": (1e-4, 0.999)}
    assert golden.build["cpu"]["features"] == host_module.cpu_description()["features"]
    checks = check_at_load(session(graph), str(graph), "m")
    assert [check.name for check in checks] == ["hiddens"] and checks[0].passed
    assert checks[0].figures.max_abs_error < 1e-5


def test_padded_positions_are_not_compared(tmp_path):
    graph = matmul_graph(tmp_path)
    reference = golden_inputs()["x"] @ WEIGHTS
    reference[1, 2:] = 99.0  # padding: whatever the graph answers there does not count
    store(tmp_path, reference)
    assert check_at_load(session(graph), str(graph), "m")[0].passed


def test_answers_outside_tolerance_refuse_the_model_naming_the_host_and_figures(tmp_path, monkeypatch):
    monkeypatch.delenv(CHECK_ENV, raising=False)
    graph = matmul_graph(tmp_path)
    reference = golden_inputs()["x"] @ WEIGHTS
    reference[0, 0] = -reference[0, 0]  # one position disagrees: cosine -1 there
    store(tmp_path, reference)
    with pytest.raises(RuntimeError) as refused:
        check_at_load(session(graph), str(graph), "esm_encoder")
    message = str(refused.value)
    assert message.startswith(f"esm_encoder: {graph} answers the build's golden inputs outside its tolerance")
    assert "hiddens: min cosine -1.000000 (required >= 0.999)" in message
    assert "(allowed 0.0001)" in message and "the build host measured min cosine 1.000000" in message
    assert f"This host: {host_module.describe_cpu()}" in message and "int8 dot products:" in message
    assert "The build host: " in message
    assert f"{CHECK_ENV}=warn" in message and "--golden-check warn" in message


def test_warn_serves_anyway_and_says_so(tmp_path, monkeypatch):
    graph = matmul_graph(tmp_path)
    store(tmp_path, -(golden_inputs()["x"] @ WEIGHTS))
    monkeypatch.setenv(CHECK_ENV, "warn")
    warnings: list[str] = []
    checks = check_at_load(session(graph), str(graph), "m", warn=warnings.append)
    assert not checks[0].passed
    assert len(warnings) == 1 and warnings[0].endswith(f"(served anyway: {CHECK_ENV}=warn)")
    monkeypatch.setenv(CHECK_ENV, "ignore")
    with pytest.raises(ValueError, match=f"^{CHECK_ENV}='ignore': choose one of refuse, warn$"):
        check_mode()


def test_a_swapped_graph_is_refused_with_what_differs(tmp_path, monkeypatch):
    """Golden answers beside a graph that takes other inputs (a file copied from another model)."""
    monkeypatch.delenv(CHECK_ENV, raising=False)
    graph = matmul_graph(tmp_path)
    inputs = {"input_ids": np.zeros((1, 3), dtype=np.int64)}
    write_golden(str(tmp_path / golden_module.GOLDEN_FILE), inputs, {"hiddens": np.zeros((1, 3, 3))},
                 mask_input="", tolerances={"hiddens": (1e-4, 0.999)})
    with pytest.raises(RuntimeError, match=r"hiddens: the graph's inputs \['x', 'attention_mask'\] and outputs "
                                           r"\['hiddens'\] are not those of its golden answers \(\['input_ids'\] -> "
                                           r"\['hiddens'\]\): it is not the graph the build verified"):
        check_at_load(session(graph), str(graph), "m")


def test_a_graph_without_golden_answers_loads_as_before(tmp_path):
    graph = matmul_graph(tmp_path)
    assert check_at_load(session(graph), str(graph), "m") == []


def test_a_tolerance_is_a_bound_the_figures_must_meet(tmp_path):
    graph = matmul_graph(tmp_path)
    reference = golden_inputs()["x"] @ WEIGHTS
    store(tmp_path, reference * 1.001, min_cosine=0.999, atol=1e-4)  # same direction, 0.1 % off
    golden = read_golden(str(tmp_path / golden_module.GOLDEN_FILE))
    [result] = golden.run(session(graph))
    assert result.figures.min_cosine > 0.99999 and not result.passed  # atol fails it
    store(tmp_path, reference * 1.001, min_cosine=0.999, atol=float("inf"))  # int8-style: cosine only
    [result] = read_golden(str(tmp_path / golden_module.GOLDEN_FILE)).run(session(graph))
    assert result.passed


def test_an_emulated_cpu_is_described_by_what_cpuid_says(monkeypatch):
    """qemu-user passes the host's /proc/cpuinfo through; CPUID (what ONNX Runtime reads) decides."""
    host_flags = {"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "amx_int8"}
    monkeypatch.setattr(host_module, "_cpuinfo", lambda: ("Some Xeon", host_flags))
    monkeypatch.setattr(host_module, "_cpuid_features", lambda: {"AVX2": True, "FMA3": True, "AVX512F": False})
    emulated = host_module.cpu_description()
    assert emulated == {"model": "Some Xeon (emulated: CPUID differs from /proc/cpuinfo)",
                        "features": ["avx2", "fma"], "vnni": False}
    assert host_module.describe_cpu(emulated).endswith("[avx2 fma; int8 dot products: no VNNI (saturating)]")
    monkeypatch.setattr(host_module, "_cpuid_features", lambda: {"AVX2": True, "AVX512F": True, "AVX512VNNI": True})
    native = host_module.cpu_description()
    features = native["features"]
    assert native["vnni"] and native["model"] == "Some Xeon" and isinstance(features, list) and "amx_int8" in features
    monkeypatch.setattr(host_module, "_cpuinfo", lambda: ("Zen 3", {"avx2", "fma"}))
    monkeypatch.setattr(host_module, "_cpuid_features", lambda: {"AVX2": True, "AVX512F": False})
    assert host_module.cpu_description()["vnni"] is False


def test_a_host_without_vnni_opens_the_portable_graph(tmp_path, monkeypatch):
    (tmp_path / host_module.NO_VNNI_FOLDER).mkdir()
    (tmp_path / host_module.NO_VNNI_FOLDER / "model.onnx").write_bytes(b"")
    cpu = {"model": "x", "features": ["avx2"], "vnni": False}
    monkeypatch.setattr(onnx_session, "cpu_description", lambda: cpu)
    here = str(tmp_path)
    assert onnx_session.graph_for_this_host(here, ["CPUExecutionProvider"]) == f"{here}/no-vnni/model.onnx"
    cpu["vnni"] = True
    assert onnx_session.graph_for_this_host(here, ["CPUExecutionProvider"]) == f"{here}/model.onnx"
    cpu["vnni"] = False
    shutil.rmtree(tmp_path / host_module.NO_VNNI_FOLDER)
    assert onnx_session.graph_for_this_host(here, ["CPUExecutionProvider"]) == f"{here}/model.onnx"


@pytest.mark.parametrize(("weights", "dtype"), [("int8", np.int8), ("uint8", np.uint8)])
def test_int8_weight_types(weights, dtype):
    from bionemo_export.exporters.optimize.quantization import quantize_int8

    w = np.random.default_rng(2).standard_normal((16, 8)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    quantized, record = quantize_int8(model, 0.0, None, external=False, weights=weights)
    stored = [numpy_helper.to_array(t) for t in quantized.graph.initializer if t.name.startswith("w")]
    assert {array.dtype for array in stored if array.ndim == 2} == {np.dtype(dtype)}
    assert record.weights == weights and f"{weights} weights" in record.method and record.matmuls_int8 == 1
    with pytest.raises(ValueError, match="int8 weights are one of int8, uint8, not 'int4'"):
        quantize_int8(model, 0.0, None, external=False, weights="int4")


def test_int8_slower_than_fp32_on_the_build_host_is_said(tmp_path, monkeypatch):
    """The decision, on measured figures replaced by a slow int8 (what an AVX2-only host may show)."""
    from bionemo_export.exporters.optimize import pipeline

    graph = matmul_graph(tmp_path / "plain")
    verified = pipeline.VerifiedGraph(graph, None, pipeline.OptimizationRecord(None))  # type: ignore[arg-type]
    monkeypatch.setattr(pipeline, "time_graphs", lambda graphs, batch: {name: 10.0 if name == "fp32" else 12.5
                                                                        for name in graphs})
    said: list[str] = []
    speed = pipeline._speed_on_this_host(graph, tmp_path / "fp32", verified, verified, golden_inputs(),
                                         {"optimize": False}, said.append)
    assert speed["int8_vs_fp32"] == 0.8 and len(said) == 1
    assert f"the int8 graph it would serve ({speed['served_here']}) runs at 0.80x the fp32 graph's speed" in said[0]
    assert "build with `precision` fp32 for hosts like this one" in said[0]
    monkeypatch.setattr(pipeline, "time_graphs", lambda graphs, batch: {name: 10.0 if name == "fp32" else 5.0
                                                                        for name in graphs})
    said.clear()
    assert pipeline._speed_on_this_host(graph, tmp_path / "fp32", verified, None, golden_inputs(),
                                        {"optimize": False}, said.append)["int8_vs_fp32"] == 2.0
    assert said == []


# -- compare, a slice at a time -----------------------------------------------------------------


def _compare_at_once(actual: np.ndarray, expected: np.ndarray, valid: np.ndarray | None) -> tuple[float, float]:
    """compare's figures as one float64 computation over every vector (what it did before slicing)."""
    from bionemo_export.serving.numerics import cosine_rows

    def rows(values: np.ndarray) -> np.ndarray:
        values = values.astype(np.float64)
        if valid is not None and values.shape[:2] == valid.shape:
            return values[valid].reshape(int(valid.sum()), -1)
        return values.reshape(values.shape[0], -1)

    a, e = rows(actual), rows(expected)
    return float(np.max(np.abs(a - e))), float(np.min(cosine_rows(a, e)))


@pytest.mark.parametrize("masked", [True, False], ids=["per-position", "per-item"])
@pytest.mark.parametrize("chunk", [8, 200, 1 << 24], ids=["piece-of-a-row", "rows", "whole"])
def test_compare_in_slices_gives_the_figures_of_one_computation(monkeypatch, masked, chunk):
    """Rows sliced, and rows longer than the chunk summed in pieces of their columns, give the same
    figures; a NaN anywhere still fails, a zero row still agrees only with a zero row."""
    monkeypatch.setattr(golden_module, "COMPARE_CHUNK_BYTES", chunk)
    rng = np.random.default_rng(1)
    expected = rng.standard_normal((3, 5, 4, 6)).astype(np.float32)
    actual = (expected + 0.01 * rng.standard_normal(expected.shape)).astype(np.float32)
    actual[2, 1], expected[2, 1] = 0.0, 0.0  # agree
    actual[1, 3] = 0.0  # one zero row against a nonzero one: cosine 0 at that position
    valid = np.ones((3, 5), bool)
    valid[0, 4] = False
    figures = golden_module.compare(actual, expected, valid if masked else None)
    max_abs, min_cos = _compare_at_once(actual, expected, valid if masked else None)
    assert figures.max_abs_error == max_abs and figures.min_cosine == pytest.approx(min_cos, abs=1e-12)
    actual[0, 2, 1, 5] = np.nan
    broken = golden_module.compare(actual, expected, valid if masked else None)
    assert np.isnan(broken.max_abs_error) and not broken.within(1.0, -1.0)
    only_padding = np.zeros((3, 5), bool)
    assert golden_module.compare(actual, expected, only_padding) == golden_module.Figures(actual.shape, 0.0, 1.0)


def test_comparing_large_outputs_costs_a_slice_not_the_output():
    """Finding (issue 46): two 150 MB attention maps compared at once peaked 1.5 GB above them (float64
    copies, differences, norms), the peak of a 150M build. Now the temporaries are a slice's."""
    import tracemalloc

    rng = np.random.default_rng(0)
    expected = rng.random((2, 16, 1024, 512), dtype=np.float32)  # 64 MiB: 2 rows of 32 MiB, over the chunk
    actual = expected + np.float32(1e-6)
    tracemalloc.start()
    try:
        figures = golden_module.compare(actual, expected)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert figures.min_cosine > 0.999999
    assert peak < 6 * golden_module.COMPARE_CHUNK_BYTES, f"{peak >> 20} MiB of temporaries, {expected.nbytes >> 20} MiB"
