"""BioNeMo's way of serving, kept as a development mode and as the baseline every speed claim is
measured against: a PyTriton process whose inference callables run the PyTorch model in Python.

`bionemo-export dev-server --model FAMILY --checkpoint PATH --name N` binds the same public
models, with the same tensors, as a repository built from that checkpoint with `--name N`
(the task table, tasks.py): `N_embeddings` and `N_hiddens`; for encoder-decoder families
`N_decodes` and `N_samplings`; with a masked-LM head `N_logits` and `N_scores` (checked, planned
and scored by the repository's own serving/scores.py and scoring.py); with a fine-tuned head `N_predictions`
(labels named by serving/labels.py); with ESM's contact head `N_contacts` (serving/contacts.py's checks and
batching over the PyTorch head); `N_layers` (serving/layers.py's choices and pooling over the PyTorch
encoder's every layer); `N_attentions` for transformers encoders (serving/attentions.py's choices and
limit over the eager twin's probabilities). With `--checkpoint` once per member, a checkpoint ensemble
as `build repo` makes one (models/members.py checks the members alike): `N_logits` and `N_scores`
only, the mean of the members' log-probabilities (serving/member_mean.py's, as the repository's
N_member_mean) and the scores of that mean, with each member's as `member_log_probs` and
`member_scores`. Any client can be pointed at either and gets the same answers (the
encoder within the family's tolerance, decodes and seeded samples equal), because both use the
package's tokenizers and its one decoding and sampling implementation (serving/search.py with
SAMPLING_DEFAULTS and the repository's GenerationLimits); only the graph runner differs (PyTorch
here, ONNX Runtime in the repository).

As BioNeMo's servers: max_batch_size 10 (by default) with dynamic batching and no queue delay.
Unlike them: decodes and samplings are bound only for families that decode, every request's
hidden states are cropped to its own longest sequence, and sampling takes every option the
repository's N_samplings takes, parsed by the repository's own module (serving/request_options.py),
so a bad option gets the same message from both. Limits of the mode (PyTriton 0.7): an error comes back with a
traceback around its message, and fails every request the batcher handed over with it.

PyTriton 0.7 protects Triton's statistics endpoint with a token, which perf_analyzer over gRPC
cannot pass (docs/reference/platform.md): the endpoints are left unprotected, as tritonserver's own are.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.kits import kit_of
from bionemo_export.kits.dev import MAX_BATCH_SIZE, DevAnswers, Requests
from bionemo_export.models.base import LoadedModel, load_checkpoint
from bionemo_export.models.members import ENSEMBLE_TASKS, MemberFacts, check_members
from bionemo_export.tasks import TASKS
from bionemo_export.tensors import DType


@dataclass(frozen=True)
class Binding:
    """One Triton model of the dev server: its name, callable and tensors (PyTriton's terms)."""

    name: str
    infer: Callable[[Requests], list[dict[str, np.ndarray]]]
    inputs: list[tuple[str, Any, tuple[int, ...], bool]]
    """(name, dtype, shape without the batch axis, optional)."""
    outputs: list[tuple[str, Any, tuple[int, ...]]]


class DevModels(DevAnswers):
    """The inference callables of the public models over one loaded checkpoint (PyTorch, fp32):
    each task's kit answers it (kits/: `TaskKit.answer`), from the PyTorch model and the shared
    encoding of DevAnswers. Each takes a list of requests (what PyTriton hands over together) and
    answers one dict per request: plain functions of numpy arrays, usable without a server."""

    @property
    def tasks(self) -> tuple[str, ...]:
        """The public models this checkpoint serves, as a repository built from it would: each task
        whose entry's requirements the checkpoint carries (tasks.py `Task.requires`); an ensemble's,
        those of them it serves (models/members.py `ENSEMBLE_TASKS`). Each is answered by its kit
        (`answer`)."""
        servable = self.loaded.servable()
        return tuple(task for task in servable if task in ENSEMBLE_TASKS) if self.members else servable

    def answer(self, task: str, requests: Requests) -> list[dict[str, np.ndarray]]:
        """The answers of the public model of `task` to `requests` (its kit's `answer`), one dict
        per request; InvalidInputError for a task this checkpoint does not serve."""
        if task not in self.tasks:
            raise InvalidInputError(f"{self.loaded.checkpoint} serves {', '.join(self.tasks)}; not {task}")
        return kit_of(task).answer(self, task, requests)

    def bindings(self, name: str) -> list[Binding]:
        """The public models of this checkpoint under the name prefix `name`, with the tensors the
        task table (tasks.py) declares: a repository's public models, one for one."""
        loaded = self.loaded
        sizes = {"H": loaded.hidden_size, "A": len(loaded.alphabet), "K": len(self.members)}
        classifier = getattr(loaded, "classifier", None)
        if classifier is not None:
            sizes["C"] = classifier.num_labels
        bindings = []
        for task in (TASKS[t] for t in self.tasks):
            outputs = [(t.name, _dtype(t.dtype), t.shape(sizes))
                       for t in (*task.outputs, *(task.member_tensors(sizes) if self.members else ()))]
            # A per-token head's rows are laid out like hiddens.
            if task.name == "predictions" and classifier is not None and classifier.per_token:
                outputs = [("logits", np.float32, (-1, sizes["C"])), ("mask", np.bool_, (-1,)),
                           ("label", bytes, (-1,))]
            bindings.append(Binding(task.model(name), functools.partial(self.answer, task.name),
                                    [(t.name, _dtype(t.dtype), t.shape(sizes), t.optional) for t in task.inputs],
                                    outputs))
        return bindings


def load_models(checkpoints: Sequence[Path], family: str | None = None, *,
                progress: Callable[[str], None] = lambda message: None, **options: Any) -> DevModels:
    """DevModels over `checkpoints`: one checkpoint, or a checkpoint ensemble's members in the
    build's order (several, as `build repo` takes them), each loaded in turn and checked against
    those before it (models/members.py: a member that differs, or one given twice, is refused
    naming it before the next is loaded). `options`: DevModels' (max_decode_length, limits)."""
    if not checkpoints:
        raise InvalidInputError("give `checkpoint` once (or once per member of an ensemble)")
    loaded: list[LoadedModel] = []
    for number, path in enumerate(checkpoints, 1):
        member = f" (ensemble member {number} of {len(checkpoints)})" if len(checkpoints) > 1 else ""
        progress(f"loading {path}{member} ...")
        loaded.append(load_checkpoint(path, family))
        if len(loaded) > 1:
            check_members([MemberFacts.of(model) for model in loaded])
    return DevModels(loaded[0], members=tuple(loaded) if len(loaded) > 1 else (), **options)


def _dtype(dtype: DType) -> Any:
    """PyTriton's type for a task-table dtype (bytes for BYTES)."""
    return bytes if dtype is DType.BYTES else dtype.numpy


# ------------------------------------------------------------------------------------ server
@dataclass(frozen=True)
class Ports:
    host: str = "127.0.0.1"
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def serve(models: DevModels, name: str, ports: Ports = Ports(), *, max_batch_size: int = MAX_BATCH_SIZE,
          on_ready: Callable[[list[str]], None] | None = None, stop: threading.Event | None = None) -> None:
    """Serve `models` under the prefix `name` with PyTriton until SIGINT/SIGTERM (or `stop` is
    set); `on_ready(model names)` is called once every model answers."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    from bionemo_export.runtime.discovery import _python_stub_env

    if max_batch_size < 1:
        raise InvalidInputError(f"max_batch_size must be at least 1, got {max_batch_size}")
    # PyTriton starts its tritonserver from this process: give its Python stubs this interpreter's
    # environment and libpython (docs/reference/platform.md), as the project's own server runner does.
    for key, value in _python_stub_env().items():
        os.environ[key] = value + (os.pathsep + os.environ[key] if os.environ.get(key) else "")
    # pytriton's @kwonly_dataclass hides TritonConfig's dataclass fields from type checkers.
    config = TritonConfig(http_address=ports.host, http_port=ports.http,  # pyright: ignore[reportCallIssue]
                          grpc_address=ports.host, grpc_port=ports.grpc,  # pyright: ignore[reportCallIssue]
                          metrics_port=ports.metrics)  # pyright: ignore[reportCallIssue]
    stopping = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        # Our own handlers whatever we inherited: a script's `dev-server &` starts us with SIGINT ignored.
        previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
            batching = ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher())
            bindings = models.bindings(name)
            for binding in bindings:
                triton.bind(model_name=binding.name, infer_func=binding.infer, config=batching,
                            inputs=[Tensor(name=n, dtype=d, shape=s, optional=o) for n, d, s, o in binding.inputs],
                            outputs=[Tensor(name=n, dtype=d, shape=s) for n, d, s in binding.outputs])
            triton.run()
            if on_ready is not None:
                on_ready([binding.name for binding in bindings])
            stopping.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

