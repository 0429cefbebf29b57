"""Brute-force references for SaProt, in transformers' own `EsmForMaskedLM`, independent of the
package's code: token ids read from the checkpoint's vocab.txt directly, SaProt's zero-shot
mutation score as westlake-repl/SaProt's `SaprotFoldseekMutationModel.predict_mut` computes it,
and the per-residue log-probabilities (each residue's 21 structure tokens summed in probability)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

STRUCTURE = "pynwrqhgdlvtmfsaeikc#"
"""The 21 structure letters in SaProt's order (utils/constants.py: foldseek_struc_vocab)."""
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


def vocab_ids(folder: Path) -> dict[str, int]:
    """{token: id} from the checkpoint's vocab.txt (one token per line)."""
    return {token: i for i, token in enumerate((Path(folder) / "vocab.txt").read_text().splitlines())}


def pairs(text: str, plain: bool = False) -> list[str]:
    """The tokens of a structure-aware string (`MdEv`: two characters each) or of plain residues
    (`ME`: each with the unknown structure letter `#`)."""
    if plain:
        return [residue + "#" for residue in text]
    assert len(text) % 2 == 0, text
    return [text[i:i + 2] for i in range(0, len(text), 2)]


def token_ids(vocab: dict[str, int], tokens: list[str]) -> torch.Tensor:
    """[1, L + 2]: <cls> tokens <eos>."""
    return torch.tensor([[vocab["<cls>"], *(vocab[t] for t in tokens), vocab["<eos>"]]])


def logits(reference, ids: torch.Tensor) -> torch.Tensor:
    """[L + 2, V] logits of transformers' EsmForMaskedLM for one row of ids."""
    with torch.inference_mode():
        return reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]


def residue_log_probs(reference, vocab: dict[str, int], tokens: list[str]) -> np.ndarray:
    """[L + 2, 20]: for each amino acid (AMINO_ACIDS' order), the log of the summed probability of
    its 21 structure tokens, the softmax over the 420 amino-acid tokens."""
    ids = [vocab[a + s] for a in AMINO_ACIDS for s in STRUCTURE]
    probs = torch.softmax(logits(reference, token_ids(vocab, tokens))[:, ids].double(), dim=-1)
    return torch.log(probs.reshape(-1, len(AMINO_ACIDS), len(STRUCTURE)).sum(-1)).numpy()


def predict_mut(reference, vocab: dict[str, int], tokens: list[str], variant: str) -> float:
    """SaProt's predict_mut: every mutated position's token replaced at once by '#' + its structure
    letter, one forward pass, softmax over the whole vocabulary; at each mutated position a residue's
    probability is the sum over its 21 tokens (ids vocab[aa + 'p'] onwards); the score is the sum of
    log(p_mt / p_wt)."""
    tokens = list(tokens)
    mutations = variant.split(":")
    for mutation in mutations:
        position = int(mutation[1:-1])
        tokens[position - 1] = "#" + tokens[position - 1][-1]
    probs = torch.softmax(logits(reference, token_ids(vocab, tokens)).double(), dim=-1)
    score = 0.0
    for mutation in mutations:
        wild, position, mutant = mutation[0], int(mutation[1:-1]), mutation[-1]
        start_wt, start_mt = vocab[wild + STRUCTURE[0]], vocab[mutant + STRUCTURE[0]]
        p_wt = probs[position, start_wt:start_wt + len(STRUCTURE)].sum()
        p_mt = probs[position, start_mt:start_mt + len(STRUCTURE)].sum()
        score += float(torch.log(p_mt / p_wt))
    return score


def marginal_scores(reference, vocab: dict[str, int], tokens: list[str], variants: list[str], method: str
                    ) -> np.ndarray:
    """ESM's predict.py methods over SaProt's per-residue marginals: wt-marginal reads every mutation
    from the unmasked sequence, masked-marginal from the copy that masks that position alone ('#' +
    its structure letter)."""
    unmasked = residue_log_probs(reference, vocab, tokens)
    scores = []
    for variant in variants:
        total = 0.0
        for mutation in variant.split(":"):
            wild, position, mutant = mutation[0], int(mutation[1:-1]), mutation[-1]
            if method == "wt-marginal":
                rows = unmasked
            else:
                copy = list(tokens)
                copy[position - 1] = "#" + copy[position - 1][-1]
                rows = residue_log_probs(reference, vocab, copy)
            total += rows[position, AMINO_ACIDS.index(mutant)] - rows[position, AMINO_ACIDS.index(wild)]
        scores.append(total)
    return np.array(scores)
