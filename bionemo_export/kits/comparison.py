"""How `verify` compares a served task with PyTorch: the figures of one comparison, one check's
record, and what every kit's `check` reads (`VerifyContext`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from bionemo_export.serving.numerics import cosine_rows, degenerate_rows

if TYPE_CHECKING:
    from bionemo_export.client import Seq2SeqClient
    from bionemo_export.model_repository.manifest import Manifest
    from bionemo_export.models import LoadedModel


@dataclass(frozen=True)
class TaskCheck:
    model: str
    batch: str
    """What was sent, e.g. "6 sequences, 5-118 residues"."""
    max_abs_error: float | None
    min_cosine: float | None
    mask_exact: bool | None
    passed: bool
    note: str = ""
    """For string outputs: how many matched the reference, or which method was checked."""
    problem: str | None = None
    """Why the check failed beyond the figures: a shape mismatch, degenerate rows (all zeros, constant, NaN/Inf)."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """Served vectors against the reference's: the figures, and what is wrong beyond them."""

    max_abs_error: float
    min_cosine: float
    problem: str | None = None

    def within(self, atol: float, min_cosine: float) -> bool:
        """Whether the served output passes (written so that NaN figures fail)."""
        return self.problem is None and self.max_abs_error <= atol and self.min_cosine >= min_cosine


def compare_outputs(served: np.ndarray, reference: np.ndarray) -> Comparison:
    """Compare served vectors (last axis) with the reference's: max abs error, min cosine
    (numerics.cosine_rows: a zero or non-finite row against a real one scores 0), and degenerate
    served rows (all zeros, constant, NaN/Inf where the reference's are not), which fail whatever
    the figures say."""
    served, reference = np.asarray(served), np.asarray(reference)
    if served.shape != reference.shape:  # e.g. a repository built from another checkpoint
        return Comparison(float("inf"), float("-inf"),
                          f"served shape {list(served.shape)} differs from the reference's {list(reference.shape)}")
    if served.size == 0:
        return Comparison(0.0, 1.0)
    error = float(np.max(np.abs(served.astype(np.float64) - reference)))  # NaN propagates
    cosine = float(np.min(cosine_rows(served, reference)))
    degenerate = degenerate_rows(served, reference)
    return Comparison(error, cosine, f"degenerate output: {degenerate}" if degenerate else None)


def describe_batch(batch: list[str]) -> str:
    lengths = [len(s) for s in batch]
    if len(batch) == 1:
        return f"1 sequence, {lengths[0]} residues"
    return f"{len(batch)} sequences, {min(lengths)}-{max(lengths)} residues"


def reference_encoding(loaded, batch: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch's (hiddens, embeddings, attention mask, residue mask) of `batch` through `loaded`'s encoder."""
    import torch

    encoded = loaded.tokenizer.encode(batch)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(
            torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
            torch.from_numpy(encoded.residue_mask))
    return hiddens.numpy(), embeddings.numpy(), encoded.attention_mask.astype(bool), encoded.residue_mask


def task_check(model: str, batch: list[str], found: Comparison, mask_exact: bool | None,
                limits: tuple[float, float], note: str) -> TaskCheck:
    return TaskCheck(model, describe_batch(batch), found.max_abs_error, found.min_cosine, mask_exact,
                     found.within(*limits), note, found.problem)


@dataclass(frozen=True)
class VerifyContext:
    """What each kit's `check` compares: the served repository's client, the checkpoint it was built
    from, and the sample batches and tolerances verify_repository chose."""

    client: Seq2SeqClient
    loaded: LoadedModel
    manifest: Manifest
    batches: list[list[str]]
    """Sample sequences: all together, then a few alone."""
    samples: list[str]
    tolerances: dict
    """task -> exporters.Tolerance, for the repository's precision (precision_checks)."""
    notes: dict[str, str]
    members: tuple[LoadedModel, ...] = ()
    """A checkpoint ensemble's members (`loaded` is the first); empty: one checkpoint."""

    def head_limits(self) -> tuple[float, float]:
        """(atol, min cosine) of a head's outputs: the hiddens' tolerance, whose errors they carry."""
        hiddens = self.tolerances.get("hiddens")
        return (hiddens.atol, hiddens.min_cosine) if hiddens else (self.loaded.family.atol,
                                                                     self.loaded.family.min_cosine)

    def family_limits(self) -> tuple[float, float]:
        """(atol, min cosine) of the family's fp32 graphs (those the build stores as exported in fp32)."""
        return self.loaded.family.atol, self.loaded.family.min_cosine
