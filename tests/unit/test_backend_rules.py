"""What each serving backend owns (model_repository/backends.py): its consistency rules, whether `auto`
picks it, what a deployment image needs, its help; and that adding a backend is one class.

The consistency rules run on a tiny repository written here: one graph model over a two-op ONNX
graph (input_ids [batch, length] -> hiddens [batch, length]), planned by the backend itself. Each
rule a backend brought out of consistency.py is broken on purpose and must be reported;
tests/export/test_backends.py breaks the others on built repositories.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from bionemo_export.model_repository import backends
from bionemo_export.model_repository.backends import (
    BACKENDS,
    ENGINE_FILE,
    GraphModel,
    OnnxRuntimeBackend,
    ServingBackend,
    ShapeRange,
    TritonRuntimeBackend,
    backend_help,
    deployment_note,
    get_backend,
    graph_backend,
    resolve_auto,
)
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.options import RoleOptions
from bionemo_export.model_repository.pbtxt import read_config, write_config
from bionemo_export.model_repository.plan import ModelPlan, RepositoryPlan
from bionemo_export.tensors import DType, TensorSpec

MAX_LENGTH = 64


def _graph(path: Path, axes: tuple[str | None, str | None] = ("batch", "length")) -> Path:
    """input_ids (INT64) -> hiddens (FP32), both of shape `axes` (None: an unnamed dynamic axis)."""
    node = helper.make_node("Cast", ["input_ids"], ["hiddens"], to=TensorProto.FLOAT)
    dims = [axis if axis is not None else "" for axis in axes]
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, dims)],
                              [helper.make_tensor_value_info("hiddens", TensorProto.FLOAT, dims)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if None in axes:  # make_tensor_value_info names every str axis: clear the unnamed one
        for value in (*model.graph.input, *model.graph.output):
            for dim, axis in zip(value.type.tensor_type.shape.dim, axes):
                if axis is None:
                    dim.ClearField("dim_param")
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def _repository(root: Path, backend: str, axes: tuple[str | None, str | None] = ("batch", "length")) -> Path:
    """A one-model repository whose graph model `m_encoder` the backend `backend` planned."""
    graph = _graph(root.parent / f"{root.name}-graph" / "model.onnx", axes)
    plan = ModelPlan(name="m_encoder", inputs=[TensorSpec("input_ids", DType.INT64, (-1,))],
                     outputs=[TensorSpec("hiddens", DType.FP32, (-1,))], max_batch_size=8)
    shapes = ShapeRange(axes={"input_ids": ("batch", "length")}, sizes={"batch": (1, 8), "length": (1, MAX_LENGTH)},
                        split_axis="length")
    planned = get_backend(backend).plan_graph(GraphModel(plan=plan, role=RoleOptions(), what="encoder",
                                                         onnx_files={"model.onnx": graph}, shapes=shapes,
                                                         python_model=lambda: ({}, {"model.py": "# model.py\n"})))
    root.mkdir()
    RepositoryPlan([planned]).write(root)
    Manifest(name="m", family="esm2", tasks=["hiddens"], max_length=MAX_LENGTH).write(root)
    return root


def _edit_recipe(root: Path, change: Callable[[dict], None]) -> None:
    path = root / "m_encoder" / "1" / ENGINE_FILE
    recipe = json.loads(path.read_text())
    change(recipe)
    path.write_text(json.dumps(recipe))


@pytest.mark.parametrize("backend", ["native", "tensorrt", "python"])
def test_a_repository_each_backend_plans_is_consistent(tmp_path, backend):
    root = _repository(tmp_path / "repo", backend)
    assert check_repository(root) == []
    config = read_config(root / "m_encoder")
    owner = graph_backend(ModelPlan.from_config(config))
    # A Python model is not one the graph rules apply to: the Python backend owns no config.
    assert (owner.name if owner else None) == (None if backend == "python" else backend)


def test_an_onnx_runtime_model_must_load_its_graph(tmp_path):
    root = _repository(tmp_path / "repo", "native")
    config = read_config(root / "m_encoder")
    config.default_model_filename = "other.onnx"
    write_config(root / "m_encoder", config)
    assert check_repository(root) == ["m_encoder: default_model_filename 'other.onnx' is not the graph model.onnx"]


def test_a_graph_model_without_its_graph_is_found(tmp_path):
    root = _repository(tmp_path / "repo", "native")
    (root / "m_encoder" / "1" / "model.onnx").unlink()
    assert check_repository(root) == ["m_encoder: no 1/model.onnx to check the config against"]


def test_a_tensorrt_model_needs_its_recipe_and_profiles(tmp_path):
    root = _repository(tmp_path / "repo", "tensorrt")
    _edit_recipe(root, lambda recipe: recipe.update(profiles=[]))
    assert check_repository(root) == [f"m_encoder: {ENGINE_FILE} has no optimization profiles"]
    (root / "m_encoder" / "1" / ENGINE_FILE).unlink()
    assert check_repository(root) == [f"m_encoder: {ENGINE_FILE} is missing (the TensorRT build recipe)"]


@pytest.mark.parametrize("change, finding", [
    (lambda profile: profile.pop("input_ids"), "profile 0 has no shapes for input 'input_ids'"),
    (lambda profile: profile["input_ids"].update(min=[1]), "input 'input_ids': rank differs from the graph's"),
    (lambda profile: profile["input_ids"].update(opt=[9, 64]), "input 'input_ids': min [1, 1] <= opt [9, 64] <= "
                                                                  "max [8, 64] does not hold"),
])
def test_a_tensorrt_profile_that_disagrees_with_the_graph_is_found(tmp_path, change, finding):
    root = _repository(tmp_path / "repo", "tensorrt")
    _edit_recipe(root, lambda recipe: change(recipe["profiles"][0]))
    assert any(finding in line for line in check_repository(root)), check_repository(root)


def test_a_tensorrt_graph_axis_without_a_name_or_a_caller_range_is_found(tmp_path):
    unnamed = _repository(tmp_path / "unnamed", "tensorrt", axes=("batch", None))
    assert f"m_encoder: {ENGINE_FILE}: input 'input_ids' has an unnamed dynamic axis" in check_repository(unnamed)
    unknown = _repository(tmp_path / "unknown", "tensorrt", axes=("batch", "residues"))
    assert check_repository(unknown) == [f"m_encoder: {ENGINE_FILE}: no known caller range for the graph axes "
                                         "['residues']"]


def test_auto_picks_the_preferred_backend_the_server_can_load():
    assert resolve_auto(None) == "python"  # no tritonserver found: the embedded CPU server runs python
    assert resolve_auto(lambda backend: backend in ("python", "onnxruntime")) == "native"
    assert resolve_auto(lambda backend: backend in ("python", "tensorrt")) == "python"  # engines come later
    assert "auto: native when the found tritonserver can load it, else python" in backend_help()


def test_what_a_deployment_image_needs_is_the_backends():
    note = deployment_note("python")
    assert note is not None and "onnxruntime" in note and "native backend" in note
    assert deployment_note("native") is None and deployment_note("tensorrt") is None and deployment_note(None) is None


def test_adding_a_backend_is_one_class(tmp_path):
    class CustomBackend(TritonRuntimeBackend):
        name = "custom"
        help = "a platform of one's own"
        triton_backend = "custom"
        platform = "custom_platform"
        model_file = "model.onnx"
        auto_preference = -1

        def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
            return "custom"

    try:
        assert BACKENDS["custom"] is CustomBackend and isinstance(get_backend("custom"), ServingBackend)
        assert "custom: a platform of one's own" in backend_help()
        assert resolve_auto(lambda backend: backend == "custom") == "custom"
        assert resolve_auto(lambda backend: backend == "onnxruntime") == "native"
        assert graph_backend(ModelPlan(name="x", inputs=[], outputs=[], max_batch_size=0,
                                       platform="custom_platform")) is CustomBackend
        with pytest.raises(TypeError, match="defined twice"):
            type("Again", (OnnxRuntimeBackend,), {"name": "custom"})
    finally:
        del BACKENDS["custom"]
    assert list(BACKENDS) == ["python", "native", "tensorrt"] and list(backends.BackendChoice) == [
        "auto", "python", "native", "tensorrt"]


def test_the_checks_import_onnx_only_to_read_a_graph():
    code = ("import sys; import bionemo_export.model_repository.consistency, bionemo_export.model_repository.options; "
            "print('onnx' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
