"""What a bulk job knows of the repository its servers serve, so that a resume never mixes two models.

A Triton server lets a client read each model's configuration, not the repository's files: the
manifest stays on the serving host. So a job identifies what answers it by what the configurations say:

- `repository_sha256` (in the run's fingerprint): the SHA-256 of the configurations of the models
  it asks and of every model they call (an ensemble's steps, a Python model's `bls_models`): a
  repository rebuilt with another layout, backend, batch size or tokenizer is another job. Every
  configuration a build writes carries `source_sha256` (the digest of the checkpoints manifest.json
  records, and the precision: serving/parameters.py), so a repository rebuilt from another
  checkpoint under the same names is another job too; the asked model's stamp is also a key of its
  own in the fingerprint, so that the refusal names it. The parameter serve's supervisor adds when it
  reloads a model (`supervisor_generation`) is left out: a reload is the same repository.
- `probe answers` (in the journal's notes, compared within a tolerance): what each asked model
  answers for one record of the input (the first with a sequence, whatever the shard), reduced to
  PROBE_VALUES values: for repositories built before the stamp, whose configurations are the same
  whatever checkpoint they were built from. A tolerance, not a digest: the same weights answer with
  float differences on another host or after a restart.

Every server of a job is asked at start, and servers that serve different repositories are refused
then, naming them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.serving.parameters import BLS_MODELS, SOURCE_SHA256

from .records import Record
from .repository import strings_column
from .triton import InferenceError, Inferrer

PROBE_VALUES = 64
"""Values of each probe answer kept: spread over the answer, enough to tell two checkpoints apart."""
PROBE_COSINE = 0.999
"""How alike two probe answers of the same weights are at least (float differences between hosts
are ~1e-6 relative; two random or trained checkpoints' answers differ at the first digit)."""
RELOADED = "supervisor_generation"
"""The config parameter serve's supervisor sets on a model it reloads (runtime/supervisor.GENERATION):
not part of what the repository is."""


@dataclass(frozen=True)
class Asked:
    """A model a job asks, and the extra inputs of its requests besides the sequences."""

    model: str
    input_name: str
    extra: dict[str, np.ndarray]


def servers_of(client: Inferrer) -> list[tuple[str, Inferrer]]:
    """(URL, client) of each server behind `client` (a ServerPool's, or the one TritonClient)."""
    clients = getattr(client, "clients", None)
    if clients is not None:
        return [(str(getattr(one, "url", index)), one) for index, one in enumerate(clients)]
    return [(str(getattr(client, "url", "the server")), client)]


def repository_sha256(client: Inferrer, models: Sequence[str]) -> str:
    """The SHA-256 of the served configurations of `models` and of every model they call, by name."""
    configs: dict[str, Any] = {}
    waiting = list(models)
    while waiting:
        model = waiting.pop()
        if model in configs:
            continue
        config = configs[model] = _as_built(client.model_config(model))
        steps = (config.get("ensemble_scheduling") or {}).get("step", [])
        waiting += [step["model_name"] for step in steps if "model_name" in step]
        called = ((config.get("parameters") or {}).get(BLS_MODELS) or {}).get("string_value", "")
        waiting += [name.strip() for name in called.split(",") if name.strip()]
    return hashlib.sha256(json.dumps(configs, sort_keys=True).encode()).hexdigest()


def _as_built(config: dict[str, Any]) -> dict[str, Any]:
    """`config` without what serving added to it (RELOADED)."""
    parameters = config.get("parameters") or {}
    if RELOADED not in parameters:
        return config
    return {**config, "parameters": {k: v for k, v in parameters.items() if k != RELOADED}}


def config_sha256(client: Inferrer, model: str) -> str:
    """The SHA-256 of the configuration the server serves `model` with, as built (a run's fingerprint)."""
    return hashlib.sha256(json.dumps(_as_built(client.model_config(model)), sort_keys=True).encode()).hexdigest()


def source_sha256(client: Inferrer, model: str) -> str | None:
    """The `source_sha256` stamp `model` is served with; None for a repository built before it."""
    return ((client.model_config(model).get("parameters") or {}).get(SOURCE_SHA256) or {}).get("string_value")


def probe_answers(client: Inferrer, asked: Sequence[Asked], probe: Record) -> dict[str, Any]:
    """model -> {"record": the probe's index, "values": PROBE_VALUES values of its answer} for each
    model that answers the probe (a model that refuses it is left out: nothing to compare)."""
    found: dict[str, Any] = {}
    for one in asked:
        try:
            answer = client.submit(one.model, {one.input_name: strings_column([probe.sequence]), **one.extra}).result()
        except InferenceError:
            continue
        values = np.concatenate([np.asarray(answer[name], dtype=np.float64).reshape(-1) for name in sorted(answer)
                                 if name != "mask" and np.asarray(answer[name]).dtype.kind == "f"] or [np.zeros(0)])
        if len(values):
            picked = values[np.linspace(0, len(values) - 1, min(PROBE_VALUES, len(values))).astype(np.int64)]
            found[one.model] = {"record": probe.index, "values": [float(f"{v:.7g}") for v in picked]}
    return found


def answers_differ(recorded: dict[str, Any], found: dict[str, Any]) -> list[str]:
    """The models whose probe answers in `found` are not those `recorded` (another checkpoint)."""
    differing = []
    for model, was in recorded.items():
        now = found.get(model)
        if now is None or now.get("record") != was.get("record"):
            continue  # not asked the same probe: nothing to compare
        a, b = np.asarray(was["values"]), np.asarray(now["values"])
        if a.shape != b.shape or not _alike(a, b):
            differing.append(model)
    return differing


def _alike(a: np.ndarray, b: np.ndarray) -> bool:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    if norms == 0.0:
        return bool(np.allclose(a, b, atol=1e-6))
    cosine = float(a @ b) / norms
    size_a, size_b = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return cosine >= PROBE_COSINE and abs(size_a - size_b) <= 0.01 * size_a


def served_identity(client: Inferrer, asked: Sequence[Asked], probe: Record | None) -> tuple[str, dict[str, Any]]:
    """(repository_sha256, probe answers) of the repository every server of `client` serves; a
    server that serves another repository than the first is refused, naming both."""
    servers = servers_of(client)
    models = [one.model for one in asked]
    first_url, first = servers[0]
    digest = repository_sha256(first, models)
    answers = probe_answers(first, asked, probe) if probe is not None else {}
    for url, other in servers[1:]:
        if repository_sha256(other, models) != digest:
            raise InvalidInputError(f"--triton-url {url} serves {', '.join(models)} with other configurations than "
                                    f"{first_url}: the servers of one job must serve the same repository; give "
                                    "servers of one build")
        differing = answers_differ(answers, probe_answers(other, asked, probe)) if probe is not None else []
        if differing:
            raise InvalidInputError(f"--triton-url {url} answers {', '.join(differing)} otherwise than {first_url} "
                                    "(another checkpoint under the same names): the servers of one job must serve the "
                                    "same repository; give servers of one build")
    return digest, answers
