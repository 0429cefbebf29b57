"""A tiny hand-made Python-backend model repository for runtime tests and the foundation demo.

Two models, small enough to load in a second on the embedded CPU server:
- `affine`:  x FP32 [-1] -> y = 2 x + 1, dynamic batching (max_batch_size 8);
- `reverse`: sequences BYTES [1] -> reversed BYTES [1] (UTF-8 strings reversed per item).
`broken_repository()` writes a model whose initialize() raises, for load-failure tests;
`slow_repository()` one whose instances take seconds to initialize, as a real model's weights do.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

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

LENGTH_ENCODER_MODEL_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils

WIDTH = {width}


class TritonPythonModel:
    """A stand-in encoder that costs the server nothing: row i's embedding is
    [len(sequence_i), sum of its code points, 0.5, 0.5, ...], so a bulk job's throughput and memory
    are the client's, and every answer can still be checked."""

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = pb_utils.get_input_tensor_by_name(request, "sequences").as_numpy()
            out = np.full((len(rows), WIDTH), 0.5, dtype=np.float32)
            for i, row in enumerate(rows):
                text = row[0].decode("utf-8")
                out[i, 0], out[i, 1] = len(text), sum(map(ord, text))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embeddings", out)]))
        return responses
'''


LENGTH_HIDDENS_MODEL_PY = '''\
import numpy as np
import triton_python_backend_utils as pb_utils

WIDTH = {width}


class TritonPythonModel:
    """The per-residue twin of LENGTH_ENCODER_MODEL_PY: residue j of sequence i is
    [ord(letter), j, 0.5, ...], padded to the request's longest sequence, with its mask."""

    def execute(self, requests):
        responses = []
        for request in requests:
            rows = [row[0].decode("utf-8") for row in
                    pb_utils.get_input_tensor_by_name(request, "sequences").as_numpy()]
            longest = max(map(len, rows))
            hiddens = np.full((len(rows), longest, WIDTH), 0.5, dtype=np.float32)
            mask = np.zeros((len(rows), longest), dtype=np.int32)
            for i, text in enumerate(rows):
                hiddens[i, :len(text), 0] = [ord(letter) for letter in text]
                hiddens[i, :len(text), 1] = np.arange(len(text))
                mask[i, :len(text)] = 1
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("hiddens", hiddens),
                                                         pb_utils.Tensor("mask", mask)]))
        return responses
'''


BROKEN_MODEL_PY = '''\
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("deliberately broken model: initialize() always fails")

    def execute(self, requests):
        return []
'''


SLOW_MODEL_PY = '''\
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """y = x, once initialize() has taken {seconds} s (a real model reading its weights)."""

    def initialize(self, args):
        time.sleep({seconds})

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "x")]) for r in requests]
'''


def _tensor(name: str, dtype: int, dims: list[int]) -> mc.ModelInput:
    return mc.ModelInput(name=name, data_type=dtype, dims=dims)


def _output(name: str, dtype: int, dims: list[int]) -> mc.ModelOutput:
    return mc.ModelOutput(name=name, data_type=dtype, dims=dims)


def _python_model(repo: Path, name: str, code: str, config: mc.ModelConfig, instances: int = 1) -> None:
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "1" / "model.py").write_text(textwrap.dedent(code))
    config.name = name
    config.backend = "python"
    config.instance_group.append(mc.ModelInstanceGroup(kind=mc.ModelInstanceGroup.KIND_CPU, count=instances))
    write_config(model_dir, config)


def tiny_repository(repo: Path) -> Path:
    """Write the `affine` and `reverse` models into `repo` and return it."""
    _python_model(repo, "affine", AFFINE_MODEL_PY, mc.ModelConfig(
        max_batch_size=8,
        input=[_tensor("x", mc.TYPE_FP32, [-1])],
        output=[_output("y", mc.TYPE_FP32, [-1])],
        dynamic_batching=mc.ModelDynamicBatching(),
    ))
    _python_model(repo, "reverse", REVERSE_MODEL_PY, mc.ModelConfig(
        max_batch_size=8,
        input=[_tensor("sequences", mc.TYPE_STRING, [1])],
        output=[_output("reversed", mc.TYPE_STRING, [1])],
    ))
    return repo


def broken_repository(repo: Path) -> Path:
    """Write a repository whose only model, `broken`, fails in initialize()."""
    _python_model(repo, "broken", BROKEN_MODEL_PY, mc.ModelConfig(
        max_batch_size=1,
        input=[_tensor("x", mc.TYPE_FP32, [1])],
        output=[_output("y", mc.TYPE_FP32, [1])],
    ))
    return repo


def slow_repository(repo: Path, seconds: float, instances: int = 2) -> Path:
    """Write a repository whose only model, `slow`, runs `instances` instances that each take
    `seconds` to initialize."""
    _python_model(repo, "slow", SLOW_MODEL_PY.format(seconds=seconds), mc.ModelConfig(
        max_batch_size=1,
        input=[_tensor("x", mc.TYPE_FP32, [1])],
        output=[_output("x", mc.TYPE_FP32, [1])],
    ), instances=instances)
    return repo


def length_encoder_repository(repo: Path, width: int = 32, max_batch_size: int = 256) -> Path:
    """Write `length_embeddings` (LENGTH_ENCODER_MODEL_PY: sequences -> [len, code point sum, 0.5...])
    and `length_hiddens` (its per-residue twin) into `repo` and return it: stand-in encoders for
    measuring the bulk-job client, not models."""
    _python_model(repo, "length_embeddings", LENGTH_ENCODER_MODEL_PY.format(width=width), mc.ModelConfig(
        max_batch_size=max_batch_size,
        input=[_tensor("sequences", mc.TYPE_STRING, [1])],
        output=[_output("embeddings", mc.TYPE_FP32, [width])],
        dynamic_batching=mc.ModelDynamicBatching(),
    ))
    _python_model(repo, "length_hiddens", LENGTH_HIDDENS_MODEL_PY.format(width=width), mc.ModelConfig(
        max_batch_size=max_batch_size,
        input=[_tensor("sequences", mc.TYPE_STRING, [1])],
        output=[_output("hiddens", mc.TYPE_FP32, [-1, width]), _output("mask", mc.TYPE_INT32, [-1])],
        dynamic_batching=mc.ModelDynamicBatching(),
    ))
    return repo
