"""Brute-force references for the masked-LM tasks, in transformers' own `EsmForMaskedLM`: one
masked copy at a time, ESM's predict.py formula over the whole vocabulary, AntiBERTy's PLL (mean
log-probability, special tokens excluded from the softmax). Independent of the package's code."""

from __future__ import annotations

import numpy as np
import torch

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
"""The 33 ESM token ids, written out (docs/reference/tokenizers.md)."""


def reference_token_probs(reference, sequence: str, masked: int | None = None) -> torch.Tensor:
    """log_softmax over the whole vocabulary, [L + 2, V], of <cls> sequence <eos> (position
    `masked` replaced by <mask>), from transformers' EsmForMaskedLM."""
    tokens = ["<cls>", *(("<mask>" if i == masked else c) for i, c in enumerate(sequence)), "<eos>"]
    ids = torch.tensor([[ESM_VOCAB.index(t) for t in tokens]])
    with torch.inference_mode():
        return torch.log_softmax(reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0], dim=-1)


def brute_force(reference, wild_type: str, variants: list[str], method: str) -> np.ndarray:
    """ESM's predict.py: token_probs[1 + i, mt] - token_probs[1 + i, wt], summed over a variant's
    mutations; masked-marginal reads position i from the copy that masks i (one pass per mutation)."""
    unmasked = reference_token_probs(reference, wild_type)
    scores = []
    for variant in variants:
        total = 0.0
        for mutation in variant.split(":"):
            wt, position, mt = mutation[0], int(mutation[1:-1]), mutation[-1]
            i = position - 1
            probs = unmasked if method == "wt-marginal" else reference_token_probs(reference, wild_type, i)
            total += float(probs[1 + i, ESM_VOCAB.index(mt)] - probs[1 + i, ESM_VOCAB.index(wt)])
        scores.append(total)
    return np.array(scores)


def brute_force_pll(reference, sequence: str, alphabet: tuple[str, ...]) -> float:
    """AntiBERTy's pseudo_log_likelihood: each residue masked in turn, log-softmax over the
    alphabet's tokens only, the mean of the true residue's log-probability."""
    ids = [ESM_VOCAB.index(c) for c in alphabet]
    total = 0.0
    for i, residue in enumerate(sequence):
        tokens = ["<cls>", *(("<mask>" if j == i else c) for j, c in enumerate(sequence)), "<eos>"]
        input_ids = torch.tensor([[ESM_VOCAB.index(t) for t in tokens]])
        with torch.inference_mode():
            logits = reference(input_ids=input_ids, attention_mask=torch.ones_like(input_ids)).logits[0, 1 + i, ids]
        total += float(torch.log_softmax(logits, dim=-1)[alphabet.index(residue)])
    return total / len(sequence)


def reference_log_probs(reference, sequence: str, alphabet: tuple[str, ...]) -> np.ndarray:
    """[L + 2, A]: log_softmax over the alphabet's tokens of <cls> sequence <eos>, where `_` is <mask>."""
    tokens = ["<cls>", *("<mask>" if c == "_" else c for c in sequence), "<eos>"]
    ids = torch.tensor([[ESM_VOCAB.index(t) for t in tokens]])
    with torch.inference_mode():
        logits = reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    return torch.log_softmax(logits[:, [ESM_VOCAB.index(a) for a in alphabet]], dim=-1).numpy()
