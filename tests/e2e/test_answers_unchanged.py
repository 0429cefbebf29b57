"""Behaviour unchanged across the task-kit refactor: repositories built by the code before it
(BASELINE, read from this clone's git history) and by the code now, from the same checkpoints, have
equal config.pbtxt files field by field (but for the one parameter added since, `served_model`,
which the served package's static model.py reads), and a real tritonserver serving each gives exactly the
same answers to every public model (bit for bit: the same host, the same ONNX Runtime).

Two repositories: a tiny ESM-2 with its masked-LM and contact heads (embeddings, hiddens, logits,
scores, contacts, layers, attentions) and the small MegaMolBART trained to copy SMILES (embeddings,
hiddens, decodes, samplings, layers: its decodes are real molecules), built without graph optimization.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import json_format

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import Seq2SeqClient
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.models import SERVED_MODEL

BASELINE = "841b0ac4456a1066e64382dfadc84685ac026c4a"
"""The last commit before task kits (issue 48's first commit came after it)."""
ROOT = Path(__file__).resolve().parents[2]
PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "GVLE", "MSEQNNTEMTFQIQRIYTKDISFEAPNAPHVFQKDW"]
SMILES = ["CCO", "c1ccccc1O", "CC(=O)Nc1ccc(O)cc1"]

BUILD = '''
import sys
from pathlib import Path
import bionemo_export
from bionemo_export.build import BuildRequest, build_repository

expected, *builds = sys.argv[1:]
assert Path(bionemo_export.__file__).resolve().is_relative_to(Path(expected).resolve()), bionemo_export.__file__
for family, checkpoint, out in zip(builds[::3], builds[1::3], builds[2::3]):
    build_repository(BuildRequest(family=family, checkpoint=Path(checkpoint), name="same", out=Path(out),
                                  backend="python", optimize=False))
'''


def _baseline_package(folder: Path) -> Path:
    """BASELINE's bionemo_export, extracted from git into `folder`; skipped where this checkout
    has no such history (a shallow or exported copy)."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", BASELINE, "bionemo_export"],
                                 capture_output=True, check=True, timeout=120).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        pytest.skip(f"no git history with {BASELINE[:7]} here: {err}")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def _build_baseline(source: Path, builds: list[tuple[str, Path, Path]]) -> None:
    """Build each (family, checkpoint, out) with the package under `source`, in one subprocess that
    imports it first. The baseline exports its own graphs (no graph cache: the cache key digests the
    package's source, so this code's entries could never be served to it nor its to this code)."""
    arguments = [str(part) for build in builds for part in build]
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(BUILD), str(source / "bionemo_export"), *arguments],
                         cwd=source, env={**os.environ, "PYTHONPATH": str(source), "BIONEMO_EXPORT_GRAPH_CACHE": ""},
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory, esm2_checkpoint, esm2_repository, trained_megamolbart) -> dict[str, tuple[Path, Path]]:
    """family -> (the baseline's repository, this code's), built from one checkpoint each: the
    session's ESM-2 and the committed MegaMolBART copy model. This code builds here, with the run's
    graph cache: the session repository (asked for first) and test_e2e_megamolbart.py export the
    same graphs."""
    work = tmp_path_factory.mktemp("unchanged")
    baseline = _baseline_package(work / "baseline")
    checkpoints = {"esm2": esm2_checkpoint, "megamolbart": trained_megamolbart}
    _build_baseline(baseline, [(family, checkpoint, work / f"{family}_before")
                               for family, checkpoint in checkpoints.items()])
    for family, checkpoint in checkpoints.items():
        build_repository(BuildRequest(family=family, checkpoint=checkpoint, name="same", out=work / f"{family}_after",
                                      backend="python", optimize=False))
    return {family: (work / f"{family}_before", work / f"{family}_after") for family in checkpoints}


def _configs(repository: Path) -> dict[str, dict]:
    return {path.parent.name: json_format.MessageToDict(read_config(path.parent))
            for path in sorted(repository.glob("*/config.pbtxt"))}


@pytest.mark.parametrize("family", ["esm2", "megamolbart"])
def test_the_configs_are_equal_field_by_field(built, family):
    before, after = (_configs(repository) for repository in built[family])
    assert sorted(before) == sorted(after)
    # Added since: each Python model's static model.py hands it to the class this parameter names.
    for model, config in after.items():
        served = config.get("parameters", {}).pop(SERVED_MODEL, None)
        assert (served is not None) == (config.get("backend") == "python"), model
    for model in before:
        fields = set(before[model]) | set(after[model])
        differing = {field: (before[model].get(field), after[model].get(field)) for field in sorted(fields)
                     if before[model].get(field) != after[model].get(field)}
        assert differing == {}, f"{model}: {differing}"


def _answers(client: Seq2SeqClient, family: str) -> dict[str, object]:
    """Every public model's answers to fixed inputs."""
    if family == "megamolbart":
        hiddens, mask = client.seqs_to_hidden(SMILES)
        return {"embeddings": client.seqs_to_embedding(SMILES), "hiddens": (hiddens, mask),
                "decodes": client.hidden_to_seqs(hiddens, mask),
                "samplings": client.sample_seqs(SMILES, sampling_method="beam-search-perturbate", seed=7,
                                                num_samples=2, beam_size=2),
                "layers": client.layer_embeddings(SMILES, [0, 1, -1], ["mean", "max", "per_tok"])}
    return {"embeddings": client.seqs_to_embedding(PROTEINS), "hiddens": client.seqs_to_hidden(PROTEINS),
            "logits": client.seqs_to_log_probs(PROTEINS),
            "scores": (client.score_variants(PROTEINS[0], ["M1A", "K2G:T3P"], "masked-marginal"),
                       client.pseudo_log_likelihood(PROTEINS[:2])),
            "contacts": client.predict_contacts(PROTEINS),
            "layers": client.layer_embeddings(PROTEINS, [0, 1, -1], ["mean", "max", "bos", "per_tok"]),
            "attentions": client.attention_maps(PROTEINS, [1, -1])}


def _same(before: object, after: object, where: str) -> list[str]:
    """Where `before` and `after` differ (arrays bit for bit, strings exactly)."""
    if isinstance(before, dict) and isinstance(after, dict):
        if sorted(before) != sorted(after):
            return [f"{where}: outputs {sorted(before)} != {sorted(after)}"]
        return [d for key in before for d in _same(before[key], after[key], f"{where}.{key}")]
    if isinstance(before, list | tuple) and isinstance(after, list | tuple):
        if len(before) != len(after):
            return [f"{where}: {len(before)} items != {len(after)}"]
        return [d for i, (b, a) in enumerate(zip(before, after)) for d in _same(b, a, f"{where}[{i}]")]
    if isinstance(before, np.ndarray) or isinstance(after, np.ndarray):
        b, a = np.asarray(before), np.asarray(after)
        return [] if b.shape == a.shape and b.dtype == a.dtype and np.array_equal(b, a) else [f"{where}: differs"]
    return [] if before == after else [f"{where}: {before!r} != {after!r}"]


@pytest.mark.parametrize("family", ["esm2", "megamolbart"])
def test_the_served_answers_are_identical(built, family, triton_install, tmp_path):
    answers = []
    for repository in built[family]:
        with TritonServer(repository, install=triton_install, log_file=tmp_path / f"{repository.name}.log") as server:
            with Seq2SeqClient("same", f"grpc://{server.endpoints.grpc_url}") as client:
                answers.append(_answers(client, family))
    assert set(answers[0]) >= {"embeddings", "layers"}
    assert _same(answers[0], answers[1], family) == []
