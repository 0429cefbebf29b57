"""Model families esm2 and bert: registry, random and real checkpoints, strict loading, the pooled
encoder's outputs, and the errors for bad checkpoints."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bionemo_export.models import REGISTRY, LoadedModel, get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.models.esm2 import ALPHABET
from bionemo_export.serving.tokenizers import CharacterTokenizer
from bionemo_export.testing.checkpoints import save_random_checkpoint

FAMILIES = ("esm2", "bert")
BACKBONES = {"esm2": transformers.EsmModel, "bert": transformers.BertModel}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A small random checkpoint per family."""
    return {
        name: save_random_checkpoint(name, tmp_path_factory.mktemp(name), seed=7)
        for name in FAMILIES
    }


def run(model: LoadedModel, sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """hiddens, embeddings and residue_mask for a batch, as the exported graph would see it."""
    encoded = model.tokenizer.encode(sequences)
    inputs = (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)
    with torch.no_grad():
        hiddens, embeddings = model.encoder(*(torch.from_numpy(a) for a in inputs))
    return hiddens, embeddings, encoded.residue_mask


def copy_checkpoint(src: Path, dst: Path, edit_weights=None, edit_config=None) -> Path:
    """A copy of a random checkpoint with its weights and/or config.json changed."""
    shutil.copytree(src, dst)
    if edit_weights:
        weights = load_file(dst / "model.safetensors")
        edit_weights(weights)
        save_file(weights, dst / "model.safetensors")
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_registry_lists_the_families():
    assert {"esm2", "bert"} <= set(REGISTRY)
    with pytest.raises(ValueError, match=r"unknown model family 'esm3'; known families: .*bert, .*esm2"):
        get_family("esm3")


@pytest.mark.parametrize("name", FAMILIES)
def test_random_checkpoint_loads(tiny, name):
    model = get_family(name).load(tiny[name])
    assert model.family.name == name and model.hidden_size == 32
    assert model.description == {
        "architecture": BACKBONES[name].__name__, "layers": 2, "hidden": 32, "heads": 4,
        "parameters": model.description["parameters"],
        "checkpoint_form": "huggingface directory (model.safetensors)",
    }
    assert model.description["parameters"] > 10_000
    assert not model.encoder.training
    assert all(p.dtype == torch.float32 and p.isfinite().all() for p in model.encoder.parameters())
    assert [t.name for t in model.outputs] == ["hiddens", "embeddings"]
    assert model.outputs[0].dims == ("batch", "length", 32)


def test_the_same_seed_gives_the_same_checkpoint(tiny, tmp_path):
    again = save_random_checkpoint("esm2", tmp_path, seed=7)
    first, second = load_file(tiny["esm2"] / "model.safetensors"), load_file(again / "model.safetensors")
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.parametrize("name", FAMILIES)
def test_outputs_equal_transformers_own_loading(tiny, name):
    """Our strict key mapping gives exactly what transformers' from_pretrained gives."""
    model = get_family(name).load(tiny[name])
    sequences = model.family.sample_sequences()
    hiddens, _, _ = run(model, sequences)
    reference = BACKBONES[name].from_pretrained(tiny[name], add_pooling_layer=False).eval()
    encoded = model.tokenizer.encode(sequences)
    with torch.no_grad():
        expected = reference(
            input_ids=torch.from_numpy(encoded.input_ids),
            attention_mask=torch.from_numpy(encoded.attention_mask),
        ).last_hidden_state
    torch.testing.assert_close(hiddens, expected, rtol=0, atol=1e-6)


def test_real_antiberty_loads_strictly(antiberty):
    assert antiberty.hidden_size == 512 and antiberty.description["layers"] == 8
    assert antiberty.description["checkpoint_form"] == "huggingface directory (pytorch_model.bin)"
    assert 25_000_000 < antiberty.description["parameters"] < 27_000_000
    assert antiberty.tokenizer.max_length == 512 and antiberty.tokenizer.residues == "ACDEFGHIKLMNPQRSTVWY"
    hiddens, embeddings, _ = run(antiberty, antiberty.family.sample_sequences())
    assert torch.isfinite(hiddens).all() and torch.isfinite(embeddings).all()
    assert hiddens.shape[-1] == 512


def test_antiberty_checkpoint_names_the_package_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install antiberty==0\.1\.3"):
        antiberty_checkpoint()


@pytest.mark.parametrize("name", FAMILIES)
def test_sample_sequences_are_valid_and_varied(tiny, name):
    model = get_family(name).load(tiny[name])
    sequences = model.family.sample_sequences()
    lengths = sorted(map(len, sequences))
    assert len(sequences) >= 5 and lengths[0] <= 5 and lengths[-1] >= 100
    model.tokenizer.encode(sequences)  # raises on any invalid residue


@pytest.mark.parametrize("name", FAMILIES)
def test_embeddings_are_the_mean_of_hiddens_over_residues(tiny, name):
    model = get_family(name).load(tiny[name])
    hiddens, embeddings, residue_mask = run(model, model.family.sample_sequences())
    for i, mask in enumerate(residue_mask):
        torch.testing.assert_close(embeddings[i], hiddens[i, torch.from_numpy(mask)].mean(dim=0))


@pytest.mark.parametrize("name", [*FAMILIES, "antiberty"])
def test_batching_with_padding_changes_nothing(tiny, antiberty, name):
    model = antiberty if name == "antiberty" else get_family(name).load(tiny[name])
    sequences = model.family.sample_sequences()
    hiddens, embeddings, residue_mask = run(model, sequences)
    for i, sequence in enumerate(sequences):
        alone_hiddens, alone_embeddings, alone_mask = run(model, [sequence])
        torch.testing.assert_close(
            hiddens[i, torch.from_numpy(residue_mask[i])], alone_hiddens[0, torch.from_numpy(alone_mask[0])],
            rtol=0, atol=1e-5,
        )
        torch.testing.assert_close(embeddings[i], alone_embeddings[0], rtol=0, atol=1e-5)


def test_esm2_reads_unprefixed_keys_from_pytorch_model_bin(tiny, tmp_path):
    """An EsmModel saved on its own (no `esm.` prefix) as pytorch_model.bin gives the same model."""
    model = get_family("esm2").load(tiny["esm2"])
    shutil.copy(tiny["esm2"] / "config.json", tmp_path)
    torch.save(model.encoder.get_submodule("backbone").state_dict(), tmp_path / "pytorch_model.bin")
    again = get_family("esm2").load(tmp_path)
    assert again.description["checkpoint_form"] == "huggingface directory (pytorch_model.bin)"
    sequences = model.family.sample_sequences()
    torch.testing.assert_close(run(again, sequences)[0], run(model, sequences)[0], rtol=0, atol=0)


def test_sharded_weights_are_read(tiny, tmp_path):
    model = get_family("bert").load(tiny["bert"])
    sharded = copy_checkpoint(tiny["bert"], tmp_path / "sharded")
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    keys = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for shard, names in shards.items():
        save_file({k: weights[k] for k in names}, sharded / shard)
    weight_map = {k: shard for shard, names in shards.items() for k in names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    again = get_family("bert").load(sharded)
    assert again.description["checkpoint_form"] == "huggingface directory (model.safetensors.index.json)"
    torch.testing.assert_close(run(again, ["EVQLV"])[0], run(model, ["EVQLV"])[0], rtol=0, atol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_max_length_may_be_lowered_not_raised(tiny, name):
    family = get_family(name)
    limit = {"esm2": 1024, "bert": 512}[name]
    assert family.load(tiny[name]).tokenizer.max_length == limit
    lowered = family.load(tiny[name], max_length=100).tokenizer
    assert isinstance(lowered, CharacterTokenizer) and lowered.max_residues == 98
    with pytest.raises(ValueError, match=f"max_length {limit + 1} exceeds .* \\({limit} tokens\\)"):
        family.load(tiny[name], max_length=limit + 1)


def drop_a_layer_weight(weights):
    del weights[next(k for k in weights if k.endswith("intermediate.dense.weight"))]


def add_a_stray_key(weights):
    weights["roberta.extra.weight"] = torch.zeros(2)


@pytest.mark.parametrize(
    ("name", "break_it", "message"),
    [
        ("esm2", lambda d: (d / "config.json").unlink(), "has no config.json"),
        ("esm2", lambda d: (d / "model.safetensors").unlink(),
         "has no weights: expected model.safetensors or pytorch_model.bin"),
        ("esm2", lambda d: (d / "config.json").write_text("{not json"), "config.json is not valid JSON"),
        ("bert", lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "cannot read weights"),
        ("esm2", lambda d: (d / "vocab.txt").write_text("<cls>\n<pad>\n<eos>\n<unk>\nA\n"),
         "vocab.txt is not the ESM-2 alphabet: line 5 is 'A', expected 'L'"),
        ("esm2", lambda d: (d / "vocab.txt").write_text("\n".join([*ALPHABET, "<extra>"])),
         "vocab.txt has 34 tokens; the ESM-2 alphabet has 33"),
        ("bert", lambda d: (d / "vocab.txt").unlink(), "no vocab.txt in"),
        ("bert", lambda d: (d / "vocab.txt").write_text("[PAD]\n[CLS]\nA\n"),
         "lacks the special tokens ['[UNK]', '[SEP]']"),
    ],
)
def test_broken_checkpoint_files_are_named(tiny, tmp_path, name, break_it, message):
    broken = copy_checkpoint(tiny[name], tmp_path / "broken")
    break_it(broken)
    with pytest.raises(ValueError) as raised:
        get_family(name).load(broken)
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("name", "edit_weights", "edit_config", "message"),
    [
        ("esm2", drop_a_layer_weight, None, "missing keys: encoder.layer.0.intermediate.dense.weight"),
        ("bert", drop_a_layer_weight, None, "missing keys: encoder.layer.0.intermediate.dense.weight"),
        ("bert", add_a_stray_key, None, "unexpected keys: roberta.extra.weight"),
        ("esm2", None, lambda c: c.update(intermediate_size=48),
         "wrong shapes: encoder.layer.0.intermediate.dense.bias is (64,), expected (48,)"),
        ("esm2", None, lambda c: c.update(num_hidden_layers=3), "missing keys: encoder.layer.2."),
        ("bert", None, lambda c: c.update(model_type="esm"), "has model_type 'esm', expected 'bert'"),
        ("bert", None, lambda c: c.update(vocab_size=20),
         "the vocabulary has 25 tokens but config.json's vocab_size is 20"),
    ],
)
def test_weights_must_match_the_config_exactly(
    tiny, tmp_path, name, edit_weights, edit_config, message
):
    broken = copy_checkpoint(tiny[name], tmp_path / "broken", edit_weights, edit_config)
    with pytest.raises(ValueError) as raised:
        get_family(name).load(broken)
    assert message in str(raised.value)


def test_a_file_is_not_a_checkpoint_directory(tiny):
    with pytest.raises(ValueError, match="is not a directory"):
        get_family("esm2").load(tiny["esm2"] / "model.safetensors")
