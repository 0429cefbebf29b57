"""A tiny hand-made Python-backend model repository for runtime tests and the foundation demo.

Two models, small enough to load in a second on the embedded CPU server:
- `affine`:  x FP32 [-1] -> y = 2 x + 1, dynamic batching (max_batch_size 8);
- `reverse`: sequences BYTES [1] -> reversed BYTES [1] (UTF-8 strings reversed per item).
`broken_repository()` writes a model whose initialize() raises, for load-failure tests.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# Generated protobuf code defines its classes and enum values at import time and tritonclient ships
# no stubs for it, so the type checker sees none of its names: hence the ignores on `mc.` below.
from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.model_repository.pbtxt import write_config

AFFINE_MODEL_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """y = 2 x + 1, element-wise."""

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "x").as_numpy()
            y = (2.0 * x + 1.0).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("y", y)]))
        return responses
'''

REVERSE_MODEL_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Reverse each UTF-8 string."""

    def execute(self, requests):
        responses = []
        for request in requests:
            items = pb_utils.get_input_tensor_by_name(request, "sequences").as_numpy()
            out = np.array([[s[0].decode("utf-8")[::-1].encode("utf-8")] for s in items], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("reversed", out)]))
        return responses
'''

BROKEN_MODEL_PY = '''\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("deliberately broken model: initialize() always fails")

    def execute(self, requests):
        return []
'''


def _tensor(name: str, dtype: int, dims: list[int]) -> mc.ModelInput:  # pyright: ignore[reportAttributeAccessIssue]
    return mc.ModelInput(name=name, data_type=dtype, dims=dims)  # pyright: ignore[reportAttributeAccessIssue]


def _output(name: str, dtype: int, dims: list[int]) -> mc.ModelOutput:  # pyright: ignore[reportAttributeAccessIssue]
    return mc.ModelOutput(name=name, data_type=dtype, dims=dims)  # pyright: ignore[reportAttributeAccessIssue]


def _python_model(repo: Path, name: str, code: str, config: mc.ModelConfig) -> None:  # pyright: ignore[reportAttributeAccessIssue]
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(code))
    config.name = name
    config.backend = "python"
    config.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=1))  # pyright: ignore[reportAttributeAccessIssue]
    write_config(model_dir, config)


def tiny_repository(repo: Path) -> Path:
    """Write the `affine` and `reverse` models into `repo` and return it."""
    _python_model(repo, "affine", AFFINE_MODEL_PY, mc.ModelConfig(  # pyright: ignore[reportAttributeAccessIssue]
        max_batch_size=8,
        input=[_tensor("x", mc.TYPE_FP32, [-1])],  # pyright: ignore[reportAttributeAccessIssue]
        output=[_output("y", mc.TYPE_FP32, [-1])],  # pyright: ignore[reportAttributeAccessIssue]
        dynamic_batching=mc.ModelDynamicBatching(),  # pyright: ignore[reportAttributeAccessIssue]
    ))
    _python_model(repo, "reverse", REVERSE_MODEL_PY, mc.ModelConfig(  # pyright: ignore[reportAttributeAccessIssue]
        max_batch_size=8,
        input=[_tensor("sequences", mc.TYPE_STRING, [1])],  # pyright: ignore[reportAttributeAccessIssue]
        output=[_output("reversed", mc.TYPE_STRING, [1])],  # pyright: ignore[reportAttributeAccessIssue]
    ))
    return repo


def broken_repository(repo: Path) -> Path:
    """Write a repository whose only model, `broken`, fails in initialize()."""
    _python_model(repo, "broken", BROKEN_MODEL_PY, mc.ModelConfig(  # pyright: ignore[reportAttributeAccessIssue]
        max_batch_size=1,
        input=[_tensor("x", mc.TYPE_FP32, [1])],  # pyright: ignore[reportAttributeAccessIssue]
        output=[_output("y", mc.TYPE_FP32, [1])],  # pyright: ignore[reportAttributeAccessIssue]
    ))
    return repo
