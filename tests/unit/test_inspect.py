"""`bionemo-export inspect`: what the tool sees before it builds, on one screen or as JSON; a
checkpoint the build would refuse is reported (exit 1) with the reason, not raised."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from bionemo_export.checkpoint_report import inspect_checkpoint
from bionemo_export.cli.main import app
from bionemo_export.models.megamolbart import load_model
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.nemo_archives import (
    esm2_to_megatron,
    esm2nv_config,
    megamolbart_config,
    megamolbart_to_nemo,
    pad_rows,
    tensor_parallel_shards,
    write_nemo,
    write_nemo_ranks,
)

runner = CliRunner()


@pytest.fixture(scope="module")
def esm2_dir(tmp_path_factory):
    return save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2"), seed=1)


def test_a_hugging_face_directory(esm2_dir):
    result = runner.invoke(app, ["inspect", str(esm2_dir)])
    assert result.exit_code == 0, result.output
    assert "family      esm2" in result.output
    assert "tasks       embeddings, hiddens, logits, scores, contacts, layers, attentions" in result.output
    # ESM's contact head is read (N_contacts, built by default), not left out.
    assert "and when --tasks names them" not in result.output and "contact yes" in result.output
    assert "contact_head" not in result.output
    assert f"build with  bionemo-export build repo --checkpoint {esm2_dir} --model esm2" in result.output
    report = json.loads(runner.invoke(app, ["inspect", str(esm2_dir), "--json"]).output)
    assert report["ok"] and report["form"] == "huggingface" and report["parallel"] == {}
    assert report["keys"]["stored"] == report["keys"]["mapped"] + len(report["keys"]["left_out"])
    assert report["tokenizer"]["vocabulary"] == 33 and report["heads"]["masked-LM"] == "yes"


def test_a_tensor_parallel_esm2nv_archive_with_extra_state(esm2_dir, tmp_path):
    config = transformers.EsmConfig.from_pretrained(esm2_dir)
    weights = esm2_to_megatron(load_file(esm2_dir / "model.safetensors"), config.num_hidden_layers,
                               config.num_attention_heads)
    for key in ("model.language_model.embedding.word_embeddings.weight", "model.lm_head.bias"):
        weights[key] = pad_rows(weights[key][:33], 256)
    shards = tensor_parallel_shards(weights, 2)
    for shard in shards:
        shard["model.language_model.encoder.layers.0.self_attention.core_attention._extra_state"] = torch.zeros(0)
    archive = write_nemo_ranks(tmp_path / "tp2.nemo", {**esm2nv_config(config), "tensor_model_parallel_size": 2},
                               {f"mp_rank_{r:02d}": s for r, s in enumerate(shards)})
    report = inspect_checkpoint(archive)
    assert report.ok and report.family == "esm2" and report.parallel == {"tensor": 2, "pipeline": 1}
    assert set(report.keys["skipped"]) == {f"mp_rank_0{r}/model.language_model.encoder.layers.0.self_attention."
                                           "core_attention._extra_state" for r in (0, 1)}
    assert "model.language_model.rotary_pos_emb.inv_freq" in report.keys["left_out"]
    assert "2 tensor x 1 pipeline ranks, merged on import" in report.render()
    assert report.tasks == ["embeddings", "hiddens", "logits", "scores", "layers", "attentions"]


def test_a_megamolbart_archive_says_which_output_head(tmp_path):
    folder = save_random_checkpoint("megamolbart", tmp_path / "mmb", seed=2)
    model, vocab, _ = load_model(folder)
    config, artifacts = megamolbart_config(model.config, vocab)
    archive = write_nemo(tmp_path / "mmb.nemo", config,
                         megamolbart_to_nemo(model.state_dict(), model.config, head="bias"), artifacts)
    report = inspect_checkpoint(archive)
    assert report.ok and report.family == "megamolbart"
    assert report.heads["output head"] == "bias, weight tied to the token embeddings"
    assert report.heads["decoder"] == "yes" and report.tasks == ["embeddings", "hiddens", "decodes", "samplings",
                                                                  "layers"]


def edited_copy(source: Path, out: Path, edit) -> Path:
    """A copy of the checkpoint folder `source` whose weights `edit(weights)` changed."""
    shutil.copytree(source, out)
    weights = load_file(out / "model.safetensors")
    edit(weights)
    save_file(weights, out / "model.safetensors")
    return out


def test_what_would_stop_a_build_is_reported_not_raised(esm2_dir, tmp_path):
    broken = edited_copy(esm2_dir, tmp_path / "broken",
                         lambda weights: weights.pop("esm.encoder.layer.0.attention.self.query.weight"))
    result = runner.invoke(app, ["inspect", str(broken)])
    assert result.exit_code == 1
    assert "problem     " in result.output
    assert "missing keys: encoder.layer.0.attention.self.query.weight" in result.output
    assert "  missing: 1: encoder.layer.0.attention.self.query.weight" in result.output
    assert "build with" not in result.output
    report = json.loads(runner.invoke(app, ["inspect", str(broken), "--json"]).output)
    assert report["keys"]["missing"] == ["encoder.layer.0.attention.self.query.weight"]
    assert report["keys"]["unexpected"] == [] and not report["ok"]


def test_unexpected_and_mis_shaped_keys_are_listed(esm2_dir, tmp_path):
    def edit(weights):
        weights["esm.encoder.layer.0.attention.self.extra.weight"] = torch.zeros(2)
        weights["esm.encoder.layer.1.output.dense.bias"] = torch.zeros(3)

    broken = edited_copy(esm2_dir, tmp_path / "odd", edit)
    report = inspect_checkpoint(broken)
    assert report.keys["unexpected"] == ["encoder.layer.0.attention.self.extra.weight"]
    assert report.keys["wrong_shapes"] == ["encoder.layer.1.output.dense.bias is (3,), expected (32,)"]


def test_a_family_that_does_not_read_it(esm2_dir):
    report = inspect_checkpoint(esm2_dir, "prott5")
    assert not report.ok and "model_type" in report.problems[0]
