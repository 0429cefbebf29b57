"""Client helpers with the names BioNeMo's notebooks use: sequences -> embeddings / hidden states."""

from __future__ import annotations

import numpy as np

from .triton import DEFAULT_URL, TritonClient, strings_to_tensor


class EncoderClient:
    """Query the public encoder models `N_embeddings` and `N_hiddens` of a repository built with `--name N`."""

    def __init__(self, name: str, url: str = DEFAULT_URL, *, timeout_s: float = 300.0) -> None:
        self.name = name
        self.client = TritonClient(url, timeout_s=timeout_s)

    def seqs_to_embedding(self, sequences: list[str]) -> np.ndarray:
        """FP32 [batch, hidden]: mean of the hidden states over each sequence's residues."""
        out = self.client.infer(f"{self.name}_embeddings", {"sequences": strings_to_tensor(sequences)}, ["embeddings"])
        return out["embeddings"]

    def seqs_to_hidden(self, sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(hiddens FP32 [batch, length, hidden], mask BOOL [batch, length]); mask is True on residues."""
        out = self.client.infer(f"{self.name}_hiddens", {"sequences": strings_to_tensor(sequences)},
                                ["hiddens", "mask"])
        return out["hiddens"], out["mask"]

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "EncoderClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def masked_mean(hiddens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Client-side pooling, as BioNeMo's notebooks do it: mean over the positions where mask is True."""
    weights = mask.astype(hiddens.dtype)[..., None]
    return (hiddens * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)
