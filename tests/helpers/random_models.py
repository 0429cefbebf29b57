"""Small random transformers models for tests: one definition of the tiny ESM-2 configuration and
of moving every parameter off its initial value (so that layer norms and biases are not trivial)."""

from __future__ import annotations

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
