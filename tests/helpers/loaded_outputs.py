"""What a loaded model (models.LoadedModel) computes in PyTorch for some sequences: its tokens, its
encoder's hidden states and embeddings and its masked-LM head's log-probabilities, for tests that
compare a checkpoint form with its own reference implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bionemo_export.models.lm_head import MaskedLMHead


@dataclass
class LoadedOutputs:
    encoded: Any
    """The tokenizer's Encoded rows (input_ids, attention_mask, residue_mask)."""
    hiddens: torch.Tensor
    embeddings: torch.Tensor
    log_probs: torch.Tensor
    """[batch, length, alphabet]: log_softmax over the head's alphabet rows (`alphabet_ids`)."""
    alphabet_ids: list[int]

    @property
    def real(self) -> torch.Tensor:
        """Where the attention mask is set: the tokens to compare."""
        return torch.tensor(self.encoded.attention_mask).bool()


def masked_lm_outputs(loaded: Any, sequences: list[str]) -> LoadedOutputs:
    """`loaded`'s encoder and masked-LM head on `sequences` (`_` is the mask character)."""
    encoded = loaded.tokenizer.encode(sequences)
    head = loaded.lm_head
    assert isinstance(head, MaskedLMHead)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(torch.tensor(encoded.input_ids), torch.tensor(encoded.attention_mask),
                                             torch.tensor(encoded.residue_mask))
        log_probs = head(hiddens)
    return LoadedOutputs(encoded, hiddens, embeddings, log_probs, list(head.alphabet_ids))
