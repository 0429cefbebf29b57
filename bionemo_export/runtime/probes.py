"""Ask a served model whether it answers: one tiny real request (a probe), with a verdict that
tells a dead model from a busy one (a probe turned away by admission control: alive and
saturated). The `health` command probes every public model once; serve's supervisor
(runtime/supervisor.py) probes idle ones.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bionemo_export.client.triton import (
    TURNED_AWAY,
    InferenceError,
    ServerUnreachableError,
    TritonClient,
    strings_to_tensor,
)
from bionemo_export.errors import InvalidInputError
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.reader import PUBLIC_SUFFIXES, is_public, parameter
from bionemo_export.tasks import task_of
from bionemo_export.tensors import DType

# Optional config parameter of a public model: the sequence its probe sends.
HEALTH_PROBE = "health_probe"
# Valid in every alphabet served here: cysteine for protein models, methane for SMILES models.
PROBE_SEQUENCE = "C"
# How a request to a model instance whose stub process died fails, naming the instance
# (<model>_<group>_<index>): never transient (the Python backend does not restart stubs), so no
# second probe is needed to confirm it, and the model to reload is known.
DEAD_STUB = re.compile(r"Stub process '(?P<instance>[^']+)' is not healthy")


@dataclass(frozen=True)
class ProbeResult:
    """One probe of one model: did it answer, how long it took, and the error if not."""

    model: str
    ok: bool
    seconds: float
    error: str = ""

    @property
    def turned_away(self) -> bool:
        """Admission control refused the probe (client/triton.py's TURNED_AWAY): the model is alive
        and saturated."""
        return not self.ok and any(marker in self.error for marker in TURNED_AWAY)

    @property
    def dead_instance(self) -> str | None:
        """The instance (<model>_<group>_<index>) whose stub the error says died, if it says so."""
        match = DEAD_STUB.search(self.error)
        return match.group("instance") if match else None

    def line(self) -> str:
        """One line for people and logs: `ok    esm2_embeddings  0.012 s`, `busy  ...` (turned away
        by admission control) or `FAIL  ...  error`."""
        word = "ok" if self.ok else "busy" if self.turned_away else "FAIL"
        return f"{word:<5} {self.model}  {self.seconds:.3f} s" + (f"  {self.error}" if self.error else "")


def probe_inputs(config: dict, metadata: dict) -> dict[str, np.ndarray]:
    """The smallest valid request for a public model, from its task's required inputs (tasks.py):
    one sequence (the config's `health_probe` parameter, else "C"); for hidden states, one position
    of zeros [1, 1, H] (H from the model's metadata) with its mask True. Optional inputs keep their
    defaults."""
    name = metadata.get("name", "")
    task = task_of(name)
    if task is None:
        raise InvalidInputError(f"{name}: not a public model (a name ending in {', '.join(PUBLIC_SUFFIXES)})")
    served = {tensor["name"]: tensor for tensor in metadata.get("inputs", ())}
    probe: dict[str, np.ndarray] = {}
    for tensor in task.required_inputs:
        if tensor.dtype is DType.BYTES:
            probe[tensor.name] = strings_to_tensor([parameter(config, HEALTH_PROBE) or PROBE_SEQUENCE])
            continue
        # Every other required input is per position ([-1] or [-1, H]): one position.
        dims = list(served.get(tensor.name, {}).get("shape", [-1, *tensor.shape()]))[1:]
        if any(d < 1 for d in dims[1:]):
            raise ValueError(f"{name}: the {tensor.name} input has no fixed size after its length: {dims}")
        value = np.ones if tensor.dtype is DType.BOOL else np.zeros
        probe[tensor.name] = value((1, 1, *dims[1:]), dtype=tensor.dtype.numpy)
    return probe


def one_line(err: BaseException) -> str:
    """An error as one line of at most 400 characters, for logs and probe results (the server's
    own message for a Triton error, else the exception's type and message)."""
    text = str(err) if isinstance(err, (InferenceError, ServerUnreachableError)) else f"{type(err).__name__}: {err}"
    return " ".join(text.split())[:400]


def probe_model(client: TritonClient, model: str) -> ProbeResult:
    """Send `model` its probe request and report whether it answered (within the client's timeout)."""
    start = time.monotonic()
    try:
        client.infer(model, probe_inputs(client.model_config(model), client.model_metadata(model)))
    except Exception as err:  # whatever went wrong, the model did not answer
        return ProbeResult(model, False, time.monotonic() - start, one_line(err))
    return ProbeResult(model, True, time.monotonic() - start)


def public_models(client: TritonClient, repository: Path | None = None) -> list[str]:
    """The public models: the `public_models` of the repository's manifest.json when there is one,
    else every model of the server's index named like a public one."""
    if repository is not None:
        try:
            listed = Manifest.read(repository).public_models
        except (OSError, ValueError):  # no manifest, or not one: ask the server
            listed = None
        if listed:
            return list(listed)
    return list(dict.fromkeys(m["name"] for m in client.repository_index() if is_public(m["name"])))


def instance_model(instance: str) -> str:
    """The model an instance name (<model>_<group>_<index>) belongs to."""
    return re.sub(r"_\d+_\d+$", "", instance)
