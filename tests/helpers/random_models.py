"""Small random transformers models for tests: one definition of the tiny ESM-2 configuration and
of moving every parameter off its initial value (so that layer norms and biases are not trivial),
and the random ESM C and SaProt checkpoints that more than one module builds."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import transformers

ModuleT = TypeVar("ModuleT", bound=torch.nn.Module)


def perturb(model: ModuleT, seed: int) -> ModuleT:
    """Every parameter moved off its initial value (tied ones once), in eval mode; the model itself,
    typed as it was passed (an EsmForMaskedLM stays one for the type checker)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def tiny_esm_config(**overrides) -> transformers.EsmConfig:
    """A 2-layer, 32-wide ESM-2 configuration over the 33-token alphabet (rotary positions)."""
    settings = dict(vocab_size=33, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    position_embedding_type="rotary", pad_token_id=1, mask_token_id=32, token_dropout=False)
    return transformers.EsmConfig(**{**settings, **overrides})


def sharpened_tiny_esm(**overrides) -> transformers.EsmForMaskedLM:
    """A tiny ESM-2 masked LM (`tiny_esm_config(**overrides)`, initialised after seeding torch's
    global RNG with 0) with every parameter tripled, in eval mode: random initialisation mixes
    little context into each position and leaves the head nearly flat; larger weights make
    attention sharper and the scores of different residues differ measurably."""
    torch.manual_seed(0)
    model = transformers.EsmForMaskedLM(tiny_esm_config(**overrides)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3.0)
    return model


def esmc_checkpoint(folder: Path) -> tuple[Path, transformers.EsmcForMaskedLM]:
    """A random ESM C masked LM (2 layers, 128 wide, 64-wide heads; seed 5, every parameter moved
    off its initial value) written as a Hugging Face folder with its tokenizer, and the model:
    tests/e2e/test_esmc.py serves it and tests/export/test_layer_states.py builds its layers, the
    encoder graph exported once for both (the run's graph cache). The caller's RNG is left as it was."""
    from bionemo_export.testing.checkpoints import tiny_config

    model = _seeded(lambda: transformers.EsmcForMaskedLM(tiny_config(
        "esmc", hidden_size=128, num_heads=2, num_layers=2, intermediate_size=256)), seed=5, spread=0.1)
    model.save_pretrained(folder)
    transformers.EsmcTokenizer().save_pretrained(folder)
    return Path(folder), model


def saprot_checkpoint(folder: Path, seed: int = 13) -> tuple[Path, transformers.EsmForMaskedLM]:
    """A random SaProt (EsmForMaskedLM over SaProt's paired vocabulary, 2 layers, 64 wide; every
    parameter moved well off its initial value, so log-probabilities are far from uniform) written
    as a Hugging Face folder with its vocab.txt, and the model. Seed 13: tests/e2e/test_saprot.py
    serves it and tests/export/test_layer_states.py builds its layers (one encoder export for both).
    The caller's RNG is left as it was."""
    from bionemo_export.serving.tokenizers.structure_aware import saprot_vocabulary
    from bionemo_export.testing.checkpoints import save_huggingface, tiny_config

    model = _seeded(lambda: transformers.EsmForMaskedLM(tiny_config(
        "saprot", hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)), seed=seed, spread=0.3)
    save_huggingface(model, folder, saprot_vocabulary())
    return Path(folder), model


def _seeded(make: Callable[[], ModuleT], seed: int, spread: float) -> ModuleT:
    """`make()` initialised after seeding torch's RNG with `seed`, then every parameter moved by
    `spread` standard normal draws of that RNG, in eval mode; the caller's RNG left as it was. (Not
    `perturb`, which draws from a generator of its own: these are the weights the ESM C and SaProt
    tests were written against.)"""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = make().eval()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * spread)
    return model
