"""model_repository/reader.py: a repository's models read from disk, no server (tiny repositories
written here, and a planner's seq2seq plan written as config.pbtxt files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.model_repository.pbtxt import write_config
from bionemo_export.model_repository.reader import (
    RepositoryModels,
    RepositoryReadError,
    callees,
    config_json,
    dependencies,
    is_public,
)
from bionemo_export.serving.parameters import BLS_MODELS


def _ensemble(name: str, steps: list[str]) -> mc.ModelConfig:
    return mc.ModelConfig(name=name, platform="ensemble", max_batch_size=8, ensemble_scheduling=mc.ModelEnsembling(
        step=[mc.ModelEnsembling.Step(model_name=step, model_version=-1) for step in steps]))


def toy_repository(root: Path) -> Path:
    """toy_embeddings (ensemble: tokenizer, encoder), toy_decodes (Python, BLS: toy_step, which is an
    ensemble running toy_encoder), toy_encoder batched with a queue of at most 4, toy_tokenizer unbounded."""
    write_config(root / "toy_embeddings", _ensemble("toy_embeddings", ["toy_tokenizer", "toy_encoder"]))
    write_config(root / "toy_tokenizer", mc.ModelConfig(name="toy_tokenizer", backend="python", max_batch_size=8))
    write_config(root / "toy_encoder", mc.ModelConfig(
        name="toy_encoder", backend="onnxruntime", max_batch_size=8, dynamic_batching=mc.ModelDynamicBatching(
            default_queue_policy=mc.ModelQueuePolicy(max_queue_size=4))))
    decodes = mc.ModelConfig(name="toy_decodes", backend="python", max_batch_size=8)
    decodes.parameters[BLS_MODELS].string_value = "toy_step"
    write_config(root / "toy_decodes", decodes)
    write_config(root / "toy_step", _ensemble("toy_step", ["toy_encoder"]))
    return root


def test_the_call_graph_follows_ensemble_steps_and_bls_callees(tmp_path):
    models = RepositoryModels.read(toy_repository(tmp_path))
    assert models.runs("toy_embeddings") == ["toy_embeddings", "toy_tokenizer", "toy_encoder"]
    # toy_decodes names toy_step only in its `bls_models` parameter: Triton does not know the call
    assert models.runs("toy_decodes") == ["toy_decodes", "toy_encoder", "toy_step"]
    assert callees(models.configs["toy_decodes"]) == ["toy_step"]
    assert models.runs("toy_encoder") == ["toy_encoder"] and models.runs("absent") == []


def test_public_and_internal_models_by_name_without_a_manifest(tmp_path):
    models = RepositoryModels.read(toy_repository(tmp_path))
    assert models.public == ("toy_decodes", "toy_embeddings")
    assert models.internal == ("toy_encoder", "toy_step", "toy_tokenizer")
    assert models.tasks == ("decodes", "embeddings")
    assert is_public("toy_embeddings") and not is_public("toy_encoder")


def test_the_manifest_names_the_public_models_when_there_is_one(tmp_path):
    toy_repository(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "name": "toy", "family": "esm2", "tasks": ["embeddings"], "public_models": ["toy_embeddings"]}))
    models = RepositoryModels.read(tmp_path)
    assert models.public == ("toy_embeddings",) and models.tasks == ("embeddings",)
    assert "toy_decodes" in models.internal


def test_queue_limits_are_the_bounded_queues_only(tmp_path):
    models = RepositoryModels.read(toy_repository(tmp_path))
    assert models.queue_limits() == {"toy_encoder": 4}
    assert models.queue_limits(["toy_tokenizer"]) == {}


def test_an_unreadable_config_is_named(tmp_path):
    toy_repository(tmp_path)
    (tmp_path / "toy_step" / "config.pbtxt").write_text("platform: ensemble {")
    with pytest.raises(RepositoryReadError, match=r"toy_step/config\.pbtxt is not a readable Triton model"):
        RepositoryModels.read(tmp_path)


def test_disk_and_server_configurations_walk_alike(tmp_path):
    """A config.pbtxt read from disk is the JSON Triton's model-config API serves: one walk for both."""
    toy_repository(tmp_path)
    decodes = config_json(mc.ModelConfig(name="toy_decodes", backend="python"))
    assert dependencies("toy_decodes", {"toy_decodes": decodes}.get) == []
    served = {"toy_decodes": {"parameters": {BLS_MODELS: {"string_value": "toy_step"}}},
              "toy_step": {"ensemble_scheduling": {"step": [{"model_name": "toy_encoder"}]}}}
    assert dependencies("toy_decodes", served.get) == RepositoryModels.read(tmp_path).runs("toy_decodes")[1:]
