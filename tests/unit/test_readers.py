"""Checkpoint readers, each on its own: which form a path is, and what the reader hands over."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from bionemo_export.models.readers import CheckpointError, read_checkpoint
from bionemo_export.serving.tokenizers import CharacterTokenizer, SmilesTokenizer
from bionemo_export.serving.tokenizers.protocol import Tokenizer
from bionemo_export.serving.tokenizers.sentencepiece_vocab import SentencePieceTokenizer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.nemo_archives import write_nemo


@pytest.fixture(scope="module")
def esm2_folder(tmp_path_factory):
    return save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2"), seed=1)


def test_huggingface_directory(esm2_folder):
    checkpoint = read_checkpoint(esm2_folder)
    assert (checkpoint.form, checkpoint.model_class, checkpoint.weights_name) == ("huggingface", "esm",
                                                                                  "model.safetensors")
    assert checkpoint.config["hidden_size"] == 32
    assert "vocab.txt" in checkpoint.files and "model.safetensors" not in checkpoint.files
    assert checkpoint.weights.keys() == load_file(esm2_folder / "model.safetensors").keys()


def test_huggingface_sharded_weights_and_torch_files(esm2_folder, tmp_path):
    folder = shutil.copytree(esm2_folder, tmp_path / "sharded")
    weights = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    keys = sorted(weights)
    torch.save({k: weights[k] for k in keys[: len(keys) // 2]}, folder / "pytorch_model-1.bin")
    torch.save({k: weights[k] for k in keys[len(keys) // 2:]}, folder / "pytorch_model-2.bin")
    index = {"weight_map": {k: f"pytorch_model-{1 + (i >= len(keys) // 2)}.bin" for i, k in enumerate(keys)}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    checkpoint = read_checkpoint(folder)
    assert checkpoint.weights_name == "pytorch_model.bin.index.json"
    assert checkpoint.weights.keys() == weights.keys()
    assert all(torch.equal(checkpoint.weights[k], weights[k]) for k in keys)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda f: (f / "config.json").unlink(), "has no config.json"),
    (lambda f: (f / "config.json").write_text("{"), "config.json is not valid JSON"),
    (lambda f: (f / "model.safetensors").unlink(), "has no weights"),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x01" * 64), "cannot read weights .*model.safetensors"),
])
def test_huggingface_errors_name_the_file(esm2_folder, tmp_path, edit, message):
    folder = shutil.copytree(esm2_folder, tmp_path / "broken")
    edit(folder)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(folder)


def test_saved_form(tmp_path):
    folder = save_random_checkpoint("megamolbart", tmp_path / "mmb", seed=1)
    checkpoint = read_checkpoint(folder)
    assert (checkpoint.form, checkpoint.model_class) == ("saved", "megamolbart")
    assert checkpoint.text("vocab.txt").splitlines()[:3] == ["<PAD>", "?", "^"]
    (folder / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match="has no vocab.txt"):
        read_checkpoint(folder)


@pytest.mark.parametrize("nested_folder", [False, True])
def test_nemo_archive(tmp_path, nested_folder):
    weights = {"model.a.weight": torch.ones(2, 2)}
    config = {"target": "pkg.ESM2nvModel", "tokenizer": {"vocab_file": "nemo:abc_vocab.txt"}}
    archive = write_nemo(tmp_path / "m.nemo", config, weights, {"abc_vocab.txt": b"x\ny\n"},
                         prefix="./model/" if nested_folder else "./")
    checkpoint = read_checkpoint(archive)
    assert (checkpoint.form, checkpoint.model_class, checkpoint.weights_name) == ("nemo", "pkg.ESM2nvModel",
                                                                                  "model_weights.ckpt")
    assert checkpoint.files == {"abc_vocab.txt": b"x\ny\n"}
    assert torch.equal(checkpoint.weights["model.a.weight"], torch.ones(2, 2))
    assert checkpoint.weights_path == f"{archive}:model_weights.ckpt"


def test_every_tokenizer_implements_the_protocol():
    pieces = ["<pad>", "</s>", "<unk>", "\u2581A", "\u2581C"]
    tokenizers = [
        CharacterTokenizer(["<pad>", "A"], residues="A", pad_token="<pad>", bos_token=None, eos_token=None,
                           unk_token=None, max_length=8),
        SentencePieceTokenizer(pieces, residues="AC", word_pieces=True, pad_token="<pad>", bos_token=None,
                               eos_token="</s>", unk_token="<unk>", max_length=8),
        SmilesTokenizer(["<PAD>", "?", "^", "&", "<MASK>", "<SEP>", "C", "O"], max_length=8),
    ]
    for tokenizer in tokenizers:
        assert isinstance(tokenizer, Tokenizer)
        rebuilt = type(tokenizer).from_dict(json.loads(json.dumps(tokenizer.to_dict())))
        assert rebuilt.to_dict() == tokenizer.to_dict()

