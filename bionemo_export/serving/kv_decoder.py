"""A `StepDecoder` over the two exported decoder graphs, whatever runs them.

The decode loop (search.py) sees one protocol: start / step / select. This module implements it
once for MegaMolBART-style graphs:

    cross_kv(hiddens)                                      -> cross_k, cross_v
    decoder_step(tokens, enc_mask, cross_k, cross_v, past_k, past_v) -> logits, present_k, present_v

with key/value tensors laid out [layers, batch, heads, length, head_dim]. Subclasses only say how
a graph is run: through Triton BLS (the generated N_decodes / N_samplings models), ONNX Runtime
(benchmarks), or PyTorch (the reference). numpy + stdlib only: this file is copied verbatim into
generated model folders.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

CROSS_KV_OUTPUTS = ("cross_k", "cross_v")
STEP_OUTPUTS = ("logits", "present_k", "present_v")


@dataclass(frozen=True)
class KVCache:
    """Everything the decoder needs between steps, for the rows still being decoded."""

    enc_mask: np.ndarray  # bool [B, S]
    cross_k: np.ndarray  # float32 [layers, B, heads, S, head_dim]
    cross_v: np.ndarray
    past_k: np.ndarray  # float32 [layers, B, heads, P, head_dim]; P = tokens decoded so far
    past_v: np.ndarray


class KVCacheDecoder:
    """Implements start/step/select; subclasses implement `run(graph, inputs) -> outputs`."""

    cross_kv_graph = "cross_kv"
    step_graph = "decoder_step"

    def run(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        """Run `graph` ("cross_kv" or "decoder_step") on `inputs`; return `outputs` in order."""
        raise NotImplementedError

    def start(self, hiddens: np.ndarray, mask: np.ndarray) -> KVCache:
        hiddens = np.ascontiguousarray(hiddens, dtype=np.float32)
        cross_k, cross_v = self.run(self.cross_kv_graph, {"hiddens": hiddens}, CROSS_KV_OUTPUTS)
        layers, batch, heads, _, head_dim = cross_k.shape
        empty = np.zeros((layers, batch, heads, 0, head_dim), dtype=np.float32)
        return KVCache(mask.astype(bool), cross_k, cross_v, empty, empty)

    def step(self, cache: KVCache, tokens: np.ndarray) -> tuple[np.ndarray, KVCache]:
        logits, present_k, present_v = self.run(
            self.step_graph,
            {
                "tokens": tokens.astype(np.int64).reshape(-1, 1),
                "enc_mask": cache.enc_mask,
                "cross_k": cache.cross_k,
                "cross_v": cache.cross_v,
                "past_k": cache.past_k,
                "past_v": cache.past_v,
            },
            STEP_OUTPUTS,
        )
        return logits, replace(cache, past_k=present_k, past_v=present_v)

    def select(self, cache: KVCache, rows: np.ndarray) -> KVCache:
        # Batch is axis 0 of the mask and axis 1 of every key/value tensor.
        return KVCache(
            cache.enc_mask[rows],
            np.ascontiguousarray(cache.cross_k[:, rows]),
            np.ascontiguousarray(cache.cross_v[:, rows]),
            np.ascontiguousarray(cache.past_k[:, rows]),
            np.ascontiguousarray(cache.past_v[:, rows]),
        )


class OnnxRuntimeDecoder(KVCacheDecoder):
    """The graphs run in-process with ONNX Runtime sessions (benchmarks, export checks)."""

    def __init__(self, sessions: dict) -> None:
        self.sessions = sessions  # {"cross_kv": InferenceSession, "decoder_step": InferenceSession}

    def run(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        return self.sessions[graph].run(list(outputs), inputs)
