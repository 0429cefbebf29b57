"""bionemo_export.testing.checkpoints: a small random checkpoint for every registered family, that
the family reads, the same for the same seed and sizes, without touching the caller's random state."""

from __future__ import annotations

import filecmp

import pytest
import torch

from bionemo_export.models import REGISTRY, get_family
from bionemo_export.testing.checkpoints import FAMILIES, save_random_checkpoint, tiny_config


def test_every_registered_family_has_random_checkpoints():
    assert sorted(FAMILIES) == sorted(REGISTRY)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_random_checkpoint_loads_as_its_family_at_the_sizes_asked(family, tmp_path):
    folder = save_random_checkpoint(family, tmp_path / family, seed=3, hidden_size=48, num_layers=1)
    loaded = get_family(family).load(folder)
    assert loaded.family.name == family and loaded.hidden_size == 48
    assert loaded.description["layers"] == 1


def test_the_same_seed_writes_the_same_files_and_the_callers_rng_is_left_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first = save_random_checkpoint("esm2", tmp_path / "first", seed=5)
    assert torch.equal(torch.rand(3), expected)
    second = save_random_checkpoint("esm2", tmp_path / "second", seed=5)
    other = save_random_checkpoint("esm2", tmp_path / "other", seed=6)
    names = sorted(p.name for p in first.iterdir())
    assert names == ["config.json", "model.safetensors", "vocab.txt"]
    assert filecmp.cmpfiles(first, second, names, shallow=False)[0] == names
    assert not filecmp.cmp(first / "model.safetensors", other / "model.safetensors", shallow=False)


def test_prott5_is_an_encoder_alone_unless_decoder_layers_are_asked_for():
    assert not tiny_config("prott5").is_encoder_decoder
    full = tiny_config("prott5", num_decoder_layers=3)
    assert full.is_encoder_decoder and full.num_decoder_layers == 3


def test_an_unknown_family_or_size_is_named():
    with pytest.raises(ValueError, match=r"no random checkpoints for model family 'esm3'; known: bert, esm1, esm2"):
        tiny_config("esm3")
    with pytest.raises(TypeError, match="intermediate_size"):
        tiny_config("megamolbart", intermediate_size=64)
