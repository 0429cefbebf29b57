"""What a bulk job records of the repository it is answered by (client/job_identity.py): the
served configurations as built, their source_sha256 stamp, and the servers of one job compared."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from bionemo_export.client.job_identity import Asked, config_sha256, repository_sha256, served_identity, source_sha256

ENSEMBLE = {"name": "n_embeddings", "platform": "ensemble", "parameters": {"source_sha256": {"string_value": "ab"}},
            "ensemble_scheduling": {"step": [{"model_name": "n_tokenizer"}, {"model_name": "n_encoder"}]}}
TOKENIZER = {"name": "n_tokenizer", "backend": "python", "parameters": {"source_sha256": {"string_value": "ab"}}}
ENCODER = {"name": "n_encoder", "backend": "python", "parameters": {"source_sha256": {"string_value": "ab"},
                                                                    "bls_models": {"string_value": "n_helper"}}}
HELPER = {"name": "n_helper", "backend": "python", "parameters": {"source_sha256": {"string_value": "ab"}}}


class Configs:
    """A server as the job reads it before sending anything: model configurations by name."""

    def __init__(self, configs: list[dict[str, Any]], url: str = "grpc://a:8001") -> None:
        self.configs = {config["name"]: copy.deepcopy(config) for config in configs}
        self.url = url

    def model_config(self, model: str) -> dict:
        return self.configs[model]

    def max_batch_size(self, model: str) -> int:
        return int(self.configs[model].get("max_batch_size", 0))

    def submit(self, model: str, inputs: dict[str, Any], outputs: list[str] | None = None) -> Any:
        raise AssertionError("the repository's identity is read from its configurations: nothing is sent")


def _repository() -> Configs:
    return Configs([ENSEMBLE, TOKENIZER, ENCODER, HELPER])


def test_the_digest_covers_the_steps_and_the_models_they_call():
    digest = repository_sha256(_repository(), ["n_embeddings"])
    for model in ("n_tokenizer", "n_helper"):  # an ensemble's step, a Python model's BLS callee
        other = _repository()
        other.configs[model]["max_batch_size"] = 4
        assert repository_sha256(other, ["n_embeddings"]) != digest, model


def test_another_checkpoints_stamp_is_another_repository_and_is_read_by_name():
    other = _repository()
    for config in other.configs.values():
        config["parameters"]["source_sha256"] = {"string_value": "cd"}
    assert repository_sha256(other, ["n_embeddings"]) != repository_sha256(_repository(), ["n_embeddings"])
    assert (source_sha256(_repository(), "n_embeddings"), source_sha256(other, "n_embeddings")) == ("ab", "cd")
    assert source_sha256(Configs([{"name": "old"}]), "old") is None  # built before the stamp


def test_a_model_serve_reloaded_is_the_same_repository():
    """serve's supervisor reloads a healed model with a supervisor_generation parameter: a job
    resumed after that must not take it for another repository."""
    reloaded = _repository()
    reloaded.configs["n_encoder"]["parameters"]["supervisor_generation"] = {"string_value": "3"}
    assert repository_sha256(reloaded, ["n_embeddings"]) == repository_sha256(_repository(), ["n_embeddings"])
    assert config_sha256(reloaded, "n_encoder") == config_sha256(_repository(), "n_encoder")
    reloaded.configs["n_encoder"]["max_batch_size"] = 2  # anything else still counts
    assert config_sha256(reloaded, "n_encoder") != config_sha256(_repository(), "n_encoder")


def test_servers_of_different_repositories_are_refused_naming_them():
    class Pool:
        clients = [_repository(), Configs([ENSEMBLE, TOKENIZER, {**ENCODER, "max_batch_size": 2}, HELPER],
                                          url="grpc://b:8001")]

    with pytest.raises(ValueError, match="--triton-url grpc://b:8001 serves n_embeddings with other configurations "
                                         "than grpc://a:8001"):
        served_identity(Pool(), [Asked("n_embeddings", "sequences", {})], None)  # type: ignore[arg-type]
