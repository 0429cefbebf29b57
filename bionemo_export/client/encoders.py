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


class Seq2SeqClient(EncoderClient):
    """Adds the decoding models `N_decodes` and `N_samplings` of an encoder-decoder repository."""

    def hidden_to_seqs(self, hiddens: np.ndarray, mask: np.ndarray | None = None) -> list[str]:
        """Greedy-decode hidden states [batch, length, hidden] (mask: True on real tokens; all True
        when omitted) into strings."""
        hiddens = np.asarray(hiddens, dtype=np.float32)
        if mask is None:
            mask = np.ones(hiddens.shape[:2], dtype=bool)
        out = self.client.infer(f"{self.name}_decodes", {"hiddens": hiddens, "mask": np.asarray(mask, dtype=bool)},
                                ["sequences"])
        return [row[0].decode("utf-8") for row in out["sequences"]]

    def sample_seqs(self, sequences: list[str], *, num_samples: int | None = None,
                    scaled_radius: float | None = None, sampling_method: str | None = None,
                    seed: int | None = None, top_k: int | None = None, top_p: float | None = None,
                    temperature: float | None = None, beam_size: int | None = None) -> list[list[str]]:
        """New sequences sampled around each input: [batch][outputs]. Unset options take the
        server's defaults (greedy-perturbate, 1 sample, scaled_radius 1.0)."""
        batch = len(sequences)
        inputs = {"sequences": strings_to_tensor(sequences)}
        options = {"num_samples": (num_samples, np.int32), "scaled_radius": (scaled_radius, np.float32),
                   "seed": (seed, np.int64), "top_k": (top_k, np.int32), "top_p": (top_p, np.float32),
                   "temperature": (temperature, np.float32), "beam_size": (beam_size, np.int32)}
        for name, (value, dtype) in options.items():
            if value is not None:
                inputs[name] = np.full((batch, 1), value, dtype=dtype)
        if sampling_method is not None:
            inputs["sampling_method"] = strings_to_tensor([sampling_method] * batch)
        out = self.client.infer(f"{self.name}_samplings", inputs, ["generated"])
        return [[item.decode("utf-8") for item in row] for row in out["generated"]]
