"""What a bulk job stores of each record (`client encode --include`, ESM extract.py's names).

    include = Include.parse("mean,per_tok", outputs={"hiddens", "mask"}, model="esm2nv_hiddens")
    pooled, residues = include.record(answer, row)

- `mean`: the mean of the residues' states: what an `N_embeddings` model answers (DESIGN.md: its
  embeddings are the mean of `hiddens` over `mask`), or computed here from an `N_hiddens` answer.
- `bos`: the state of the BOS/CLS token before the first residue (ESM's `<cls>`, BERT's `[CLS]`;
  ESM extract.py's `bos`). A model whose rows start with a residue (ProtT5) has none.
- `max`: the element-wise maximum over the residues' states.
- `per_tok`: every residue's state, stored ragged (job_files.py).

An `N_embeddings` model answers the mean only; the rest needs the model's `N_hiddens` sibling,
from whose one answer a job stores any of them at once (pooled and per-residue from one pass).
With `layers` (`--layers`), the job asks the repository's `N_layers` for those layers' poolings
(pooled rows only): a pooling of the last layer keeps its name, another layer's is stored under
`<pooling>@<layer>` (job_files.pooled_dataset: `embeddings_layer20`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.serving.layers import INCLUDE_CHOICES as CHOICES
from bionemo_export.serving.layers import (
    NO_BOS,
    PER_RESIDUE,
    POOLED_OUTPUTS,
    POOLINGS,
    normalize_layers,
    pool,
    starts_with_residue,
)
from bionemo_export.serving.responses import RequestError

__all__ = ["CHOICES", "PER_RESIDUE", "POOLINGS", "Include"]


@dataclass(frozen=True)
class Include:
    """The poolings and whether per-residue states are stored, checked against what the model answers."""

    poolings: tuple[str, ...]
    per_residue: bool
    model: str = ""
    layers: tuple[int, ...] = ()
    """An N_layers model's layers, 0..num_layers (num_layers: the last); (): not an N_layers job."""
    num_layers: int = 0

    @classmethod
    def parse(cls, text: str | None, outputs: Collection[str], model: str) -> Include:
        """`text` (comma-separated choices; None: what the model answers, the mean of an `N_embeddings`
        model or an `N_hiddens` model's per-residue states) for a model answering `outputs`."""
        per_residue_model = {"hiddens", "mask"} <= set(outputs)
        if not per_residue_model and "embeddings" not in outputs:
            raise InvalidInputError(f"--model {model} answers {', '.join(sorted(outputs))}: a bulk job needs an "
                                    "encoder that answers embeddings (N_embeddings) or hiddens and mask (N_hiddens)")
        if text is None:
            return cls(poolings=(), per_residue=True, model=model) if per_residue_model else \
                cls(poolings=("mean",), per_residue=False, model=model)
        chosen = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [part for part in chosen if part not in CHOICES]
        if unknown or not chosen:
            raise InvalidInputError(f"--include {text!r}: choose among {', '.join(CHOICES)} (comma-separated)")
        if not per_residue_model and set(chosen) != {"mean"}:
            raise InvalidInputError(f"--include {text}: {model} answers mean-pooled embeddings only; ask its N_hiddens "
                                    f"sibling (e.g. {model.removesuffix('_embeddings')}_hiddens) for "
                                    f"{', '.join(c for c in chosen if c != 'mean')}")
        return cls(poolings=tuple(p for p in POOLINGS if p in chosen), per_residue=PER_RESIDUE in chosen, model=model)

    @classmethod
    def for_layers(cls, text: str | None, layers: str, num_layers: int, model: str) -> Include:
        """`--include` (pooled choices; default mean) of `--layers` (comma-separated, ESM's numbering,
        negative from the end) for an N_layers model of `num_layers` blocks."""
        try:
            values = [int(part) for part in layers.split(",") if part.strip()]
            chosen = normalize_layers(values, num_layers, name="--layers")
        except ValueError:
            raise InvalidInputError(f"--layers {layers!r}: comma-separated layer numbers, e.g. -1,20") from None
        except RequestError as err:
            raise InvalidInputError(f"{model}: {err}") from None
        choices = [part.strip() for part in (text or "mean").split(",") if part.strip()]
        unknown = [part for part in choices if part not in CHOICES]
        if unknown or not choices:
            raise InvalidInputError(f"--include {text!r}: choose among {', '.join(CHOICES)} (comma-separated)")
        if PER_RESIDUE in choices:
            raise InvalidInputError(f"--include {text} --layers {layers}: a bulk job stores pooled rows of other "
                                    "layers (mean, bos, max); ask N_hiddens for the last layer's per-residue states, "
                                    f"or query {model} without a bulk --output")
        return cls(poolings=tuple(p for p in POOLINGS if p in choices), per_residue=False, model=model,
                   layers=tuple(dict.fromkeys(chosen)), num_layers=num_layers)

    def text(self) -> str:
        """The choices as --include takes them, in a fixed order (the run's fingerprint; with the
        layers of an N_layers job)."""
        text = ",".join([*self.poolings, *([PER_RESIDUE] if self.per_residue else [])])
        return f"{text};layers={','.join(map(str, self.layers))}" if self.layers else text

    def inputs(self, rows: int) -> dict[str, np.ndarray]:
        """The request inputs besides the sequences: an N_layers job's layers and include."""
        if not self.layers:
            return {}
        return {"layers": np.tile(np.array(self.layers, dtype=np.int32), (rows, 1)),
                "include": np.tile(np.array([p.encode() for p in self.poolings], dtype=np.object_), (rows, 1))}

    def key(self, pooling: str, layer: int) -> str:
        """Where a pooling of `layer` is stored: its own name for the last layer, else `<pooling>@<layer>`."""
        return pooling if layer == self.num_layers else f"{pooling}@{layer}"

    def record(self, outputs: Mapping[str, np.ndarray], row: int) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
        """(pooling -> [H], per-residue [L, H] or None) of batch row `row` of an answer."""
        if self.layers:  # an N_layers answer: each pooling [layers, H]
            return {self.key(pooling, layer): outputs[POOLED_OUTPUTS[pooling]][row][k]
                    for k, layer in enumerate(self.layers) for pooling in self.poolings}, None
        if "hiddens" not in outputs:  # an N_embeddings model: mean only (checked in parse)
            return {"mean": outputs["embeddings"][row]}, None
        states, mask = outputs["hiddens"][row], outputs["mask"][row].astype(bool)
        if "bos" in self.poolings and starts_with_residue(mask):
            raise InvalidInputError(f"--include bos: {self.model}'s {NO_BOS}")
        # N_layers' pooling (serving/layers.py), so that a job's rows equal what N_layers answers
        pooled = {pooling: pool(states, mask, pooling) for pooling in self.poolings}
        return pooled, states[mask] if self.per_residue else None
