"""The PyTorch reference for decoding and sampling, used by tests, `verify` and benchmarks.

- `reference_greedy`: greedy decoding with the decoder WITHOUT a cache (every step recomputes
  all positions with `decoder_full`): an implementation independent of the served one (KV cache,
  exported graphs, search.py), so that agreement means something.
- `TorchDecoder`: the StepDecoder of kv_decoder.py over the PyTorch modules, for running the
  package's sampling algorithms (search.py) on the reference model with a seed: the served
  samplings must reproduce it exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bionemo_export.models.base import LoadedModel, Seq2SeqModules
from bionemo_export.serving.kv_decoder import KVCacheDecoder
from bionemo_export.serving.search import SAMPLING_DEFAULTS, generate


class TorchDecoder(KVCacheDecoder):
    """cross_kv and decoder_step run by PyTorch."""

    def __init__(self, seq2seq: Seq2SeqModules) -> None:
        self.modules = {"cross_kv": seq2seq.cross_kv, "decoder_step": seq2seq.decoder_step}

    def run(self, graph: str, inputs: dict[str, np.ndarray], outputs: tuple[str, ...]) -> list[np.ndarray]:
        with torch.inference_mode():
            result = self.modules[graph](*(torch.from_numpy(np.ascontiguousarray(v)) for v in inputs.values()))
        return [tensor.float().numpy() for tensor in result]


def encode_hiddens(loaded: LoadedModel, sequences: Sequence[str | bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(hiddens [B,S,H], mask [B,S]) from the PyTorch encoder."""
    encoded = loaded.tokenizer.encode(list(sequences))
    with torch.inference_mode():
        hiddens, _ = loaded.encoder(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
                                    torch.from_numpy(encoded.residue_mask))
    return hiddens.numpy(), encoded.residue_mask


def reference_greedy(seq2seq: Seq2SeqModules, hiddens: np.ndarray, mask: np.ndarray,
                     max_length: int | None = None) -> list[list[int]]:
    """Greedy decode every row with the uncached decoder; stops a row at its end token (not
    included) or after `max_length` tokens."""
    limit = max_length or seq2seq.max_decode_length
    batch = hiddens.shape[0]
    tokens = torch.full((batch, 1), seq2seq.begin_id, dtype=torch.long)
    memory, enc_mask = torch.from_numpy(hiddens).float(), torch.from_numpy(mask).bool()
    finished = torch.zeros(batch, dtype=torch.bool)
    with torch.inference_mode():
        for _ in range(limit):
            logits = seq2seq.decoder_full(tokens, memory, enc_mask)[:, -1]
            next_tokens = logits.argmax(-1)
            next_tokens[finished] = seq2seq.end_id
            tokens = torch.cat([tokens, next_tokens[:, None]], dim=1)
            finished |= next_tokens == seq2seq.end_id
            if finished.all():
                break
    rows = []
    for row in tokens[:, 1:].tolist():
        rows.append(row[: row.index(seq2seq.end_id)] if seq2seq.end_id in row else row)
    return rows


def reference_decode(loaded: LoadedModel, hiddens: np.ndarray, mask: np.ndarray,
                     max_length: int | None = None) -> list[str]:
    """Strings decoded greedily from hidden states by the reference."""
    seq2seq, tokenizer = loaded.decoding()
    return [tokenizer.decode(row) for row in reference_greedy(seq2seq, hiddens, mask, max_length)]


def reference_sample(loaded: LoadedModel, sequences: Sequence[str], *, seed: int, method: str = "greedy-perturbate",
                     max_length: int | None = None, **parameters) -> list[list[str]]:
    """What N_samplings answers for `sequences` with `seed`, computed with PyTorch."""
    seq2seq, tokenizer = loaded.decoding()
    hiddens, mask = encode_hiddens(loaded, sequences)
    options = {**SAMPLING_DEFAULTS, "sampling_method": method, **parameters}
    method = options.pop("sampling_method")
    ids = generate(TorchDecoder(seq2seq), hiddens, mask, method=method, rng=np.random.default_rng(seed),
                   begin_id=seq2seq.begin_id, end_id=seq2seq.end_id,
                   max_length=max_length or seq2seq.max_decode_length, **options)
    return [[tokenizer.decode(sample) for sample in row] for row in ids]


def decoder_check_batches(loaded: LoadedModel, encoder_batches: list[dict]) -> tuple[list[dict], list[dict]]:
    """Inputs for checking the exported cross_kv and decoder_step graphs against PyTorch: the
    reference encoder's hidden states of the encoder check batches, and decoder steps both on an
    empty cache (first step) and on a cache of a few steps (later steps)."""
    seq2seq, _ = loaded.decoding()
    decoder = TorchDecoder(seq2seq)
    cross_batches, step_batches = [], []
    for batch in encoder_batches:
        with torch.inference_mode():
            hiddens, _ = loaded.encoder(*(torch.from_numpy(batch[name]) for name in
                                          ("input_ids", "attention_mask", "residue_mask")))
        hiddens = hiddens.numpy()
        cross_batches.append({"hiddens": hiddens})
        cache = decoder.start(hiddens, batch["residue_mask"])
        tokens = np.full(len(hiddens), seq2seq.begin_id, dtype=np.int64)
        steps = {}
        for step in range(4):
            if step in (0, 3):
                steps[step] = {"tokens": tokens[:, None], "enc_mask": cache.enc_mask,
                               "cross_k": cache.cross_k, "cross_v": cache.cross_v,
                               "past_k": cache.past_k, "past_v": cache.past_v}
            logits, cache = decoder.step(cache, tokens)
            tokens = logits.argmax(-1).astype(np.int64)
        # A later step first: the first batch is also the export's tracing sample, and
        # torch.export would specialize a cache length of 0 instead of keeping it dynamic.
        step_batches += [steps[3], steps[0]]
    return cross_batches, step_batches
