"""A small MegaMolBART that really reconstructs SMILES, trained in about a minute on a CPU.

Random weights decode noise, which cannot show that a served decode loop is right. This module
trains a small model on the autoencoding objective (encoder input: the SMILES tokens; decoder:
`^` + tokens -> tokens + `&`, teacher-forced cross-entropy) so that greedy decoding of its hidden
states gives the input back, and saves it in the saved form that `MegaMolBartFamily.load` reads.

No data set can be downloaded here, so the SMILES come from a small deterministic generator of
drug-like strings (chains, branches, aromatic and aliphatic rings, heteroatoms, a few bracket
atoms) plus a dozen well-known drugs.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from bionemo_export.models.megamolbart import (
    DEFAULT_VOCAB_SMILES,
    SAMPLE_SMILES,
    MegaMolBart,
    MegaMolBartConfig,
    save,
)
from bionemo_export.serving.tokenizers.smiles import SmilesTokenizer, build_vocab

DRUGS = [
    "CC(=O)Oc1ccccc1C(=O)O",  # aspirin
    "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",  # caffeine
    "CC(C)Cc1ccc(cc1)[C@@H](C)C(=O)O",  # ibuprofen
    "CC(=O)Nc1ccc(O)cc1",  # paracetamol
    "CN1CCC[C@H]1c1cccnc1",  # nicotine
    "COc1ccc2[nH]cc(CCNC(C)=O)c2c1",  # melatonin
    "CN(C)C(=N)NC(=N)N",  # metformin
    "Clc1ccc(cc1)C(c1ccccc1)N1CCNCC1",  # norchlorcyclizine
    "OC(=O)Cc1ccccc1Nc1c(Cl)cccc1Cl",  # diclofenac
    "CNCCC(Oc1ccc(cc1)C(F)(F)F)c1ccccc1",  # fluoxetine
    "NC(=O)c1cccnc1",  # nicotinamide
    "O=C(O)c1ccccc1O",  # salicylic acid
]
"""Real drug SMILES, part of every training set."""

_CHAIN_ATOMS = ["C", "C", "C", "C", "C", "N", "N", "O", "S", "[C@@H]", "[C@H]"]
_TERMINALS = ["F", "Cl", "Br", "O", "N", "C", "C(=O)O", "C(F)(F)F", "OC", "C#N", "C(=O)N",
              "[N+](=O)[O-]", "S(=O)(=O)N"]
_AROMATIC_RINGS = [["c"] * 5, ["c", "c", "n", "c", "c"], ["c", "c", "o", "c"], ["c", "c", "s", "c"],
                   ["c", "c", "[nH]", "c"], ["c", "n", "c", "n", "c"]]
"""Ring members after the first atom: benzene, pyridine, furan, thiophene, pyrrole, pyrimidine."""


class _Molecules:
    """Random drug-like SMILES from a seeded generator: a chain of atoms with bonds, branches,
    aromatic or saturated rings (which may carry a terminal group or another ring), and terminal
    groups. Valid-looking rather than chemically checked: they exercise the tokens and structure
    of SMILES, which is all a copy model needs."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def smiles(self) -> str:
        return self._chain(depth=0)

    def _chain(self, depth: int) -> str:
        pieces = [self.rng.choice(_CHAIN_ATOMS)]
        for _ in range(self.rng.randint(1, 4)):
            kind = self.rng.random()
            if kind < 0.3:
                pieces.append(self._ring(digit=1))
            elif kind < 0.5 and depth < 2:
                pieces.append(f"({self._chain(depth + 1)})")
            else:
                bond = self.rng.choice(["", "", "", "", "=", "#"]) if pieces[-1] == "C" else ""
                pieces.append(bond + self.rng.choice(_CHAIN_ATOMS))
        if self.rng.random() < 0.4:
            pieces.append(self.rng.choice(_TERMINALS))
        return "".join(pieces)

    def _ring(self, digit: int) -> str:
        """A ring closed by `digit`; it may carry a terminal group or a ring closed by digit + 1."""
        if self.rng.random() < 0.65:
            first, members = "c", list(self.rng.choice(_AROMATIC_RINGS))
        else:
            first, members = "C", ["C"] * self.rng.randint(2, 4) + [self.rng.choice(["C", "N", "O"])]
            self.rng.shuffle(members)
        kind = self.rng.random()
        if kind < 0.25 and digit < 3:
            members[self.rng.randrange(len(members) - 1)] += f"({self._ring(digit + 1)})"
        elif kind < 0.6:
            members[self.rng.randrange(len(members) - 1)] += f"({self.rng.choice(_TERMINALS)})"
        return f"{first}{digit}{''.join(members)}{digit}"


def generate_smiles(count: int, *, seed: int = 0, min_length: int = 6, max_length: int = 40) -> list[str]:
    """`count` distinct generated SMILES of `min_length`..`max_length` characters, deterministic
    for a seed."""
    molecules = _Molecules(seed)
    found: dict[str, None] = {}  # an ordered set
    while len(found) < count:
        smiles = molecules.smiles()
        if min_length <= len(smiles) <= max_length:
            found[smiles] = None
    return list(found)


def training_smiles(count: int = 4000, *, seed: int = 0) -> list[str]:
    """The default training set: the family's sample sequences (so that checks of a repository
    built from the model can expect them back), the real drugs, then generated SMILES.

    Thousands rather than hundreds: trained on 400, a model reconstructed 99% of them but only
    45% of unseen ones (it memorised); on 4000 it learns to copy (98-100% of unseen ones at
    train_copy_model's defaults)."""
    known = list(dict.fromkeys([*SAMPLE_SMILES, *DRUGS]))
    return known + [s for s in generate_smiles(count, seed=seed) if s not in known][: count - len(known)]


def train_copy_model(
    out: Path,
    *,
    smiles: Sequence[str] | None = None,
    vocab: Sequence[str] | None = None,
    seed: int = 0,
    steps: int = 1000,
    batch_size: int = 64,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    ffn_size: int = 128,
    learning_rate: float = 3e-3,
    max_position_embeddings: int = 128,
) -> Path:
    """Train a small MegaMolBART to reconstruct `smiles` (default: `training_smiles()`) and save it
    to `out` in the saved form. Deterministic for a seed (on one machine and thread count).

    `vocab` defaults to the tokens of `smiles` plus those of the random checkpoints' default
    vocabulary, so that the family's sample_sequences() tokenize (the untrained tokens are never
    produced). Positions beyond the training lengths are untrained too: reconstruction is good up
    to the longest training SMILES, whatever max_position_embeddings allows."""
    smiles = list(smiles) if smiles is not None else training_smiles()
    vocab = list(vocab) if vocab is not None else build_vocab([*smiles, *DEFAULT_VOCAB_SMILES])
    # One position fewer than the decoder has: it also reads the begin token.
    tokenizer = SmilesTokenizer(vocab, max_length=max_position_embeddings - 1)
    config = MegaMolBartConfig(
        vocab_size=len(vocab), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
        ffn_size=ffn_size, max_position_embeddings=max_position_embeddings,
    )
    with torch.random.fork_rng():  # seeded without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = MegaMolBart(config)
        _train(model, tokenizer, smiles, steps=steps, batch_size=batch_size, learning_rate=learning_rate)
    return save(model.eval(), vocab, out)


def _train(
    model: MegaMolBart, tokenizer: SmilesTokenizer, smiles: list[str], *, steps: int, batch_size: int,
    learning_rate: float,
) -> None:
    """AdamW with a linear warm-up and cosine decay, on random batches."""
    encoded = tokenizer.encode(smiles)
    input_ids = torch.from_numpy(encoded.input_ids)
    attention_mask = torch.from_numpy(encoded.attention_mask)
    lengths = attention_mask.sum(dim=1)
    decoder_in, target = _teacher_forcing(input_ids, lengths, tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min((step + 1) / warmup, 0.5 * (1 + math.cos(math.pi * step / steps)))
    )
    model.train()
    for _, batch in zip(range(steps), _batches(len(smiles), batch_size)):
        # Trim the batch to its longest sequence: shorter tensors, the same loss.
        length = int(lengths[batch].max())
        logits = model(
            input_ids[batch, :length], attention_mask[batch, :length], decoder_in[batch, : length + 1]
        )
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), target[batch, : length + 1].flatten(), ignore_index=tokenizer.pad_id
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()


def _batches(count: int, batch_size: int) -> Iterator[torch.Tensor]:
    """Endless random batches of indices, a new permutation every epoch. (Batching by length
    would halve the padding, but here it cost half the final accuracy at the same step count.)"""
    while True:
        yield from torch.randperm(count).split(batch_size)


def _teacher_forcing(
    input_ids: torch.Tensor, lengths: torch.Tensor, tokenizer: SmilesTokenizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoder input `^` + tokens, target tokens + `&`), padded like `input_ids` plus one column."""
    if tokenizer.end_id is None:
        raise ValueError(f"teacher forcing needs an end token; the tokenizer's end_token is {tokenizer.end_token!r}")
    target = torch.nn.functional.pad(input_ids, (0, 1), value=tokenizer.pad_id)
    target[torch.arange(len(lengths)), lengths] = tokenizer.end_id
    decoder_in = torch.nn.functional.pad(input_ids, (1, 0), value=tokenizer.begin_id)
    return decoder_in, target
