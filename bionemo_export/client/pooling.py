"""What a bulk job stores of each record (`client encode --include`, ESM extract.py's names).

    include = Include.parse("mean,per_tok", outputs={"hiddens", "mask"}, model="esm2nv_hiddens")
    pooled, residues = include.record(answer, row)

- `mean`: the mean of the residues' states: what an `N_embeddings` model answers (DESIGN.md: its
  embeddings are the mean of `hiddens` over `mask`), or computed here from an `N_hiddens` answer.
- `bos`: the state of the BOS/CLS token before the first residue (ESM's `<cls>`, BERT's `[CLS]`;
  ESM extract.py's `bos`). A model whose rows start with a residue (ProtT5) has none.
- `max`: the element-wise maximum over the residues' states.
- `per_tok`: every residue's state, stored ragged (job_files.py).
- `contacts`: the record's [L, L] contact map (ESM extract.py's `contacts`), asked of the
  repository's `N_contacts` (a second model beside the encoder), stored ragged (job_files.py).

An `N_embeddings` model answers the mean only; the rest needs the model's `N_hiddens` sibling,
from whose one answer a job stores any of them at once (pooled and per-residue from one pass).
With `layers` (`--layers`), the job asks the repository's `N_layers` for those layers' poolings
(pooled rows only): a pooling of the last layer keeps its name, another layer's is stored under
`<pooling>@<layer>` (job_files.pooled_dataset: `embeddings_layer20`). `contacts` goes with any of
them, or alone (then no encoder is asked).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.serving.layers import (
    INCLUDE_CHOICES,
    NO_BOS,
    PER_RESIDUE,
    POOLED_OUTPUTS,
    POOLINGS,
    normalize_layers,
    pool,
    starts_with_residue,
)
from bionemo_export.serving.responses import RequestError
from bionemo_export.tasks import sibling_model

from .triton import Inferrer, ModelNotServedError

__all__ = ["CHOICES", "CONTACTS", "PER_RESIDUE", "POOLINGS", "Include", "include_choices", "served_contacts_model"]

CONTACTS = "contacts"
"""ESM extract.py's name for the contact map, answered by the repository's N_contacts (not N_layers)."""
CHOICES = (*INCLUDE_CHOICES, CONTACTS)
"""What `--include` takes: N_layers' choices (the encoder's) and contacts."""


@dataclass(frozen=True)
class Include:
    """The poolings, and whether per-residue states and contact maps are stored, checked against
    what the model answers."""

    poolings: tuple[str, ...]
    per_residue: bool
    model: str = ""
    layers: tuple[int, ...] = ()
    """An N_layers model's layers, 0..num_layers (num_layers: the last); (): not an N_layers job."""
    num_layers: int = 0
    contacts: bool = False
    """Whether each record's contact map is stored (asked of the repository's N_contacts)."""

    @property
    def encodes(self) -> bool:
        """Whether `model` is asked at all: something besides contact maps is stored."""
        return bool(self.poolings or self.per_residue)

    @classmethod
    def parse(cls, text: str | None, outputs: Collection[str], model: str) -> Include:
        """`text` (comma-separated choices; None: what the model answers, the mean of an `N_embeddings`
        model, an `N_hiddens` model's per-residue states, an `N_contacts` model's maps) for a model
        answering `outputs`. `contacts` alone asks no encoder, whatever `model` is."""
        chosen = None if text is None else include_choices(text)
        encoder = None if chosen is None else [c for c in chosen if c != CONTACTS]
        contacts = chosen is not None and CONTACTS in chosen
        if CONTACTS in outputs:  # -m N_contacts: its maps, nothing of an encoder
            if encoder:
                raise InvalidInputError(f"--include {text}: {model} answers contact maps only; name the repository's "
                                        f"encoder with -m (e.g. {sibling_model(model, 'embeddings')} or "
                                        f"{sibling_model(model, 'hiddens')}) for {', '.join(encoder)}")
            return cls(poolings=(), per_residue=False, model=model, contacts=True)
        if encoder == []:  # --include contacts alone: N_contacts is the only model asked
            return cls(poolings=(), per_residue=False, model=model, contacts=True)
        per_residue_model = {"hiddens", "mask"} <= set(outputs)
        if not per_residue_model and "embeddings" not in outputs:
            raise InvalidInputError(f"--model {model} answers {', '.join(sorted(outputs))}: a bulk job needs an "
                                    "encoder that answers embeddings (N_embeddings) or hiddens and mask (N_hiddens)")
        if encoder is None:
            return cls(poolings=(), per_residue=True, model=model) if per_residue_model else \
                cls(poolings=("mean",), per_residue=False, model=model)
        if not per_residue_model and set(encoder) != {"mean"}:
            raise InvalidInputError(f"--include {text}: {model} answers mean-pooled embeddings only; ask its N_hiddens "
                                    f"sibling (e.g. {sibling_model(model, 'hiddens')}) for "
                                    f"{', '.join(c for c in encoder if c != 'mean')}")
        return cls(poolings=tuple(p for p in POOLINGS if p in encoder), per_residue=PER_RESIDUE in encoder,
                   model=model, contacts=contacts)

    @classmethod
    def for_layers(cls, text: str | None, layers: str, num_layers: int, model: str) -> Include:
        """`--include` (pooled choices, and contacts; default mean) of `--layers` (comma-separated,
        ESM's numbering, negative from the end) for an N_layers model of `num_layers` blocks."""
        try:
            values = [int(part) for part in layers.split(",") if part.strip()]
            chosen = normalize_layers(values, num_layers, name="--layers")
        except ValueError:
            raise InvalidInputError(f"--layers {layers!r}: comma-separated layer numbers, e.g. -1,20") from None
        except RequestError as err:
            raise InvalidInputError(f"{model}: {err}") from None
        choices = include_choices(text or "mean")
        pooled = [c for c in choices if c != CONTACTS]
        if PER_RESIDUE in pooled:
            raise InvalidInputError(f"--include {text} --layers {layers}: a bulk job stores pooled rows of other "
                                    "layers (mean, bos, max); ask N_hiddens for the last layer's per-residue states, "
                                    f"or query {model} without a bulk --output")
        if not pooled:
            raise InvalidInputError(f"--include {text} --layers {layers}: name a pooling of those layers (mean, bos, "
                                    "max) beside contacts, or leave out --layers")
        return cls(poolings=tuple(p for p in POOLINGS if p in pooled), per_residue=False, model=model,
                   layers=tuple(dict.fromkeys(chosen)), num_layers=num_layers, contacts=CONTACTS in choices)

    def text(self) -> str:
        """The choices as --include takes them, in a fixed order (the run's fingerprint; with the
        layers of an N_layers job)."""
        text = ",".join([*self.poolings, *([PER_RESIDUE] if self.per_residue else []),
                         *([CONTACTS] if self.contacts else [])])
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


def served_contacts_model(client: Inferrer, model: str) -> str:
    """The N_contacts model of the repository that serves `model` (what -m names), which `--include
    contacts` asks; InvalidInputError naming it and the fix where the server does not serve it."""
    contacts = sibling_model(model, CONTACTS)
    try:
        client.model_config(contacts)
    except ModelNotServedError:  # Triton's "Request for unknown model"
        raise InvalidInputError(
            f"--include contacts asks {contacts}, which the server does not serve: build the repository with --tasks "
            "...,contacts (bionemo-export build repo ... --tasks embeddings,hiddens,contacts, from an ESM checkpoint "
            "with its contact head)") from None
    return contacts


def include_choices(text: str) -> list[str]:
    """--include's comma-separated choices; InvalidInputError naming an unknown one, and the choices."""
    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen or any(part not in CHOICES for part in chosen):
        raise InvalidInputError(f"--include {text!r}: choose among {', '.join(CHOICES)} (comma-separated)")
    return chosen
