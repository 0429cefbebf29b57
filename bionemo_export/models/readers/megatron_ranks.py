"""Megatron's ways of storing one model's weights in a NeMo 1 `.nemo` archive, brought to one
canonical single-rank state dict, without NeMo or Megatron (docs/reference/checkpoint-layouts.md):

- `megatron_amp_O2: true` wraps the model in a Float16Module: every key gains `.module.` after its
  top prefix (`model.module.language_model...`); it is taken out.
- `megatron_legacy: true` stores a fused `query_key_value` as [all q; all k; all v] (and a
  cross-attention `key_value` as [all k; all v]); it is regrouped per head, [q_h; k_h; v_h] for
  h = 0..heads-1, the layout every family reads. Done on each tensor-parallel rank's own heads,
  before the ranks are joined.
- Model-parallel archives hold one `model_weights.ckpt` per rank folder: `mp_rank_{tp:02d}/` when
  the pipeline size is 1, else `tp_rank_{tp:02d}_pp_rank_{pp:03d}/`. Tensor-parallel shards are
  joined the way Megatron split them (`split_axis`): column-parallel weights and biases (fused QKV,
  cross-attention query/key_value, `dense_h_to_4h`) and vocabulary-parallel tensors (word
  embeddings, LM-head and tokens-head rows) along the rows, each rank holding whole heads;
  row-parallel weights (`self_attention.dense`, `inter_attention.dense`, `dense_4h_to_h`) along the
  columns, their biases replicated; everything else is replicated and checked equal on every rank.
  Pipeline stages each number their layers from 0: they are renumbered stack by stack, and tensors
  that several stages hold (rotary tables, the last stage's copy of the word embeddings) are kept
  once, checked equal.

Memory: the merged tensors are allocated once and filled rank by rank; one rank's file is in
memory at a time, so the peak is the merged weights plus one shard.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .base import CheckpointError

if TYPE_CHECKING:
    import torch

RANK_FOLDER = re.compile(r"^(?:mp_rank_(?P<mp>\d{2})|tp_rank_(?P<tp>\d{2})_pp_rank_(?P<pp>\d{3}))$")
"""The rank folders NeMo writes (nlp_overrides.py): mp_rank_XX, or tp_rank_XX_pp_rank_XXX."""
FUSED = {"query_key_value": ("query", "key", "value"), "key_value": ("key", "value")}
"""Megatron's fused attention projections and the projections each holds, in order."""
COLUMN_PARALLEL = ("query_key_value", "key_value", "query", "dense_h_to_4h", "word_embeddings", "tokens_head")
"""Modules split on their output rows (weight and bias). `query` is the cross-attention query;
`word_embeddings` and `tokens_head` are split by vocabulary."""
ROW_PARALLEL = ("self_attention.dense", "inter_attention.dense", "mlp.dense_4h_to_h")
"""Modules whose weight is split on its input columns (their bias is replicated)."""
VOCAB_BIAS = "lm_head.bias"
"""The masked-LM head's bias (one row per vocabulary entry), split like the word embeddings."""
LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")


@dataclass(frozen=True, order=True)
class Rank:
    """One rank folder of a model-parallel archive."""

    pipeline: int
    tensor: int
    folder: str


def find_ranks(names: Iterable[str], weights_name: str) -> dict[Rank, str]:
    """The rank folders among member `names` that hold `weights_name`: {rank: member name}."""
    ranks: dict[Rank, str] = {}
    for name in names:
        parts = name.split("/")
        if len(parts) < 2 or parts[-1] != weights_name or not (match := RANK_FOLDER.match(parts[-2])):
            continue
        tensor = int(match["mp"] if match["mp"] is not None else match["tp"])
        pipeline = int(match["pp"]) if match["pp"] is not None else 0
        ranks[Rank(pipeline, tensor, parts[-2])] = name
    return ranks


def check_grid(ranks: Iterable[Rank], config: Mapping[str, Any], source: str) -> tuple[int, int]:
    """(tensor size, pipeline size) of a complete grid of rank folders, agreeing with the config's
    `tensor_model_parallel_size` / `pipeline_model_parallel_size` when it has them."""
    ranks = list(ranks)
    styles = {"mp_rank" if rank.folder.startswith("mp_rank_") else "tp_rank" for rank in ranks}
    if len(styles) > 1:
        raise CheckpointError(f"{source} mixes mp_rank_XX and tp_rank_XX_pp_rank_XXX folders; one checkpoint uses one")
    tensor = max(rank.tensor for rank in ranks) + 1
    pipeline = max(rank.pipeline for rank in ranks) + 1
    have = {(rank.tensor, rank.pipeline) for rank in ranks}
    for pp in range(pipeline):
        for tp in range(tensor):
            if (tp, pp) not in have:
                folder = f"mp_rank_{tp:02d}" if styles == {"mp_rank"} else f"tp_rank_{tp:02d}_pp_rank_{pp:03d}"
                raise CheckpointError(f"{source} has no {folder}/ (found {len(ranks)} rank folders for a "
                                      f"{tensor} x {pipeline} tensor x pipeline grid); the archive is incomplete")
    for key, found in (("tensor_model_parallel_size", tensor), ("pipeline_model_parallel_size", pipeline)):
        declared = config.get(key)
        if declared is not None and int(declared) != found:
            raise CheckpointError(f"{source}: model_config.yaml says {key} {declared}, but the archive has "
                                  f"{found} {'tensor' if 'tensor' in key else 'pipeline'} ranks")
    return tensor, pipeline


# ------------------------------------------------------------------------ per-rank normalization
def strip_module_infix(weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without the `.module.` that megatron_amp_O2's Float16Module puts after the top prefix."""
    out = {}
    for key, tensor in weights.items():
        top, _, rest = key.partition(".")
        out[f"{top}.{rest[len('module.'):]}" if rest.startswith("module.") else key] = tensor
    return out


def regroup_legacy_qkv(weights: dict[str, torch.Tensor], heads_of: Callable[[str], int], source: str) -> None:
    """Fused projections stored the megatron_legacy way, [all q; all k; all v], regrouped per head
    in place. `heads_of(key)` is the number of heads the tensor holds (this rank's share)."""
    for key, tensor in weights.items():
        module, _, leaf = key.rpartition(".")
        names = FUSED.get(module.rpartition(".")[2])
        if names is None or leaf not in ("weight", "bias"):
            continue
        parts = len(names)
        heads = heads_of(key)
        rows = tensor.shape[0]
        if rows % (parts * heads):
            raise CheckpointError(f"{source}: {key} has {rows} rows, not a multiple of {parts} x {heads} heads")
        grouped = tensor.reshape(parts, heads, rows // (parts * heads), *tensor.shape[1:]).transpose(0, 1)
        weights[key] = grouped.reshape(tensor.shape).contiguous()


# --------------------------------------------------------------------------------- tensor parallel
def split_axis(key: str) -> int | None:
    """The axis Megatron split `key` on across tensor-parallel ranks, None when replicated."""
    module, _, leaf = key.rpartition(".")
    if key == VOCAB_BIAS or key.endswith("." + VOCAB_BIAS) or module.rpartition(".")[2] in COLUMN_PARALLEL:
        return 0
    if leaf == "weight" and module.endswith(ROW_PARALLEL):
        return 1
    return None


class _TensorParallelJoin:
    """Joins the tensor-parallel shards of one pipeline stage, rank by rank, into tensors allocated
    once at their full size."""

    def __init__(self, size: int, source: str) -> None:
        self.size = size
        self.source = source
        self.joined: dict[str, torch.Tensor] = {}
        self.first: Rank | None = None

    def _axis(self, key: str, tensor: torch.Tensor) -> int | None:
        """The axis `tensor` (one rank's shard of `key`) was split on; None when kept whole."""
        axis = split_axis(key) if self.size > 1 else None
        return axis if axis is not None and tensor.dim() > axis else None

    def add(self, rank: Rank, weights: Mapping[str, torch.Tensor]) -> None:
        import torch

        if self.first is None:
            self.first = rank
            for key, tensor in weights.items():
                axis = self._axis(key, tensor)
                if axis is None:
                    self.joined[key] = tensor
                    continue
                shape = list(tensor.shape)
                shape[axis] *= self.size
                full = torch.empty(shape, dtype=tensor.dtype)
                full.narrow(axis, rank.tensor * tensor.shape[axis], tensor.shape[axis]).copy_(tensor)
                self.joined[key] = full
            return
        where = f"{self.source}: {rank.folder}/"
        if missing := sorted(self.joined.keys() - weights.keys()):
            raise CheckpointError(f"{where} lacks {missing[0]}, which {self.first.folder}/ has"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if extra := sorted(weights.keys() - self.joined.keys()):
            raise CheckpointError(f"{where} has {extra[0]}, which {self.first.folder}/ lacks"
                                  + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        for key, tensor in weights.items():
            full = self.joined[key]
            axis = self._axis(key, tensor)
            if axis is None:
                if tensor.shape != full.shape or not torch.equal(tensor, full):
                    raise CheckpointError(f"{where}{key} differs from {self.first.folder}/'s; Megatron keeps it "
                                          "whole on every tensor-parallel rank, so the ranks are not one model")
                continue
            width = full.shape[axis] // self.size
            expected = list(full.shape)
            expected[axis] = width
            if list(tensor.shape) != expected:
                raise CheckpointError(f"{where}{key} is {tuple(tensor.shape)}, but {self.first.folder}/'s is "
                                      f"{tuple(expected)}; shards of one tensor have one shape")
            full.narrow(axis, rank.tensor * width, width).copy_(tensor)


# ------------------------------------------------------------------------------ pipeline stages
def _layer_counts(weights: Iterable[str]) -> dict[str, int]:
    """{stack prefix: number of layers} of one stage's keys (`...encoder.layers.{i}.*`)."""
    counts: dict[str, int] = {}
    for key in weights:
        if match := LAYER.search(key):
            prefix = key[: match.start(2)]
            counts[prefix] = max(counts.get(prefix, 0), int(match[2]) + 1)
    return counts


def _renumber(key: str, offsets: Mapping[str, int]) -> str:
    match = LAYER.search(key)
    if not match:
        return key
    prefix = key[: match.start(2)]
    return f"{prefix}{int(match[2]) + offsets.get(prefix, 0)}{key[match.end(2):]}"


def _is_head_copy(key: str) -> bool:
    """The last pipeline stage's copy of the word embeddings for a tied output layer
    (`model.word_embeddings.weight`): directly under the top module, not under an embedding."""
    return key.count(".") == 2 and key.endswith(".word_embeddings.weight")


def merge_ranks(ranks: Mapping[Rank, str], load: Callable[[Rank, str], dict[str, torch.Tensor]],
                source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(one state dict, entries skipped) of every rank's weights. `load(rank, member)` returns a
    rank's normalized state dict; ranks are loaded one at a time."""
    import torch

    tensor_size = max(rank.tensor for rank in ranks) + 1
    merged: dict[str, torch.Tensor] = {}
    holder: dict[str, str] = {}
    skipped: dict[str, str] = {}
    offsets: dict[str, int] = {}
    for pipeline in sorted({rank.pipeline for rank in ranks}):
        join = _TensorParallelJoin(tensor_size, source)
        stage = sorted(rank for rank in ranks if rank.pipeline == pipeline)
        for rank in stage:
            join.add(rank, load(rank, ranks[rank]))
        counts = _layer_counts(join.joined)
        for key, tensor in join.joined.items():
            name = _renumber(key, offsets)
            if name in merged:  # held by an earlier stage too: one tensor, the same everywhere
                if merged[name].shape != tensor.shape or not torch.equal(merged[name], tensor):
                    raise CheckpointError(f"{source}: {name} differs between {holder[name]}/ and {stage[0].folder}/; "
                                          "pipeline stages must hold the same copy")
                continue
            merged[name] = tensor
            holder[name] = stage[0].folder
        for prefix, count in counts.items():
            offsets[prefix] = offsets.get(prefix, 0) + count
        del join
    for key in [key for key in merged if _is_head_copy(key)]:
        copies = [other for other in merged if other != key and other.endswith("embedding.word_embeddings.weight")
                  and merged[other].shape == merged[key].shape and torch.equal(merged[other], merged[key])]
        if copies:
            skipped[key] = f"the last pipeline stage's copy of {copies[0]}"
            del merged[key]
    return merged, skipped
