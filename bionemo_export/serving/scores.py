"""N_scores run by the Python backend: variant-effect scores and pseudo-log-likelihoods from the
repository's masked-LM head, with the masked copies formed and batched inside the server.

Each request row is one wild type (`sequences` [batch, 1]) with optional `variants` [batch, V] and
`method` [batch, 1]; scoring.py checks and plans the row (ScoringError: INVALID_ARGUMENT naming
the variant) and turns log-probabilities into scores. The sequences the rows need (each wild
type, or one masked copy per position) go to N_logits through BLS in calls of `max_batch_size`
sequences, packed across the request's rows (scoring.pack_passes: a request of 32 wild types
scored by wt-marginal is one call of 32, not 32 calls of one); N_encoder packs each call under its
token budget. Only the site rows the scores read are kept ([positions, A]), never every copy's
[L, A].

Answers `scores` FP32 [batch, V] (one per variant) or [batch, 1] (pll): `variants` is one tensor,
so either every row has V variants or none has any (scoring.resolve_method refuses pll with
variants and the marginals without).

A checkpoint ensemble's N_scores (model_repository/member_ensemble.py: config parameter `members`
K) scores N_logits' mean of the members' log-probabilities, which equals the mean of the members'
scores, and answers `member_scores` FP32 [batch, K, V] too, each member's own scores, when the
request asks for that output (or names none): N_logits then sends its `member_log_probs` as well.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .responses import (
    RequestError,
    Responder,
    call_model,
    input_array,
    triton,
    wanted_outputs,
)
from .scoring import (
    METHODS,
    ScoringError,
    ScoringLimits,
    ScoringPlan,
    SplitStructure,
    pack_passes,
    plan_request,
)

INPUTS = ("sequences", "variants", "method")
"""N_scores' inputs (the task table's; this module cannot import it)."""
RunLogits = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]
"""sequences -> (log_probs [n, length, A], mask [n, length]), as N_logits answers them."""
RunMembers = Callable[[list[str]], tuple[np.ndarray, np.ndarray, np.ndarray]]
"""An ensemble's: sequences -> (log_probs, mask, member_log_probs [n, K, length, A])."""


def logits_caller(model_name: str) -> RunLogits:
    """The BLS call to the repository's N_logits model."""
    def run(sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        column = np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_)
        log_probs, mask = call_model(model_name, {"sequences": column}, ["log_probs", "mask"])
        return log_probs, mask
    return run


def structure_reader() -> SplitStructure:
    """SaProt's reader of structure-aware sequences (tokenizers/structure_aware.py), imported only
    by a structure-aware repository's N_scores."""
    from .tokenizers.structure_aware import split_pairs
    return split_pairs


def members_caller(model_name: str) -> RunMembers:
    """The BLS call to an ensemble's N_logits that asks for each member's log-probabilities too."""
    def run(sequences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        column = np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_)
        log_probs, mask, members = call_model(model_name, {"sequences": column},
                                              ["log_probs", "mask", "member_log_probs"])
        return log_probs, mask, members
    return run


def _column(value: np.ndarray | None, name: str, batch: int | None) -> np.ndarray | None:
    """Input `name`'s `value` as a 2-D array with `batch` rows (None: whatever it has), or None if absent."""
    if value is None:
        return None
    if value.ndim != 2 or (batch is not None and value.shape[0] != batch):
        rows = "batch" if batch is None else str(batch)
        raise RequestError(f"input '{name}' must have shape [{rows}, ...], got {list(value.shape)}")
    return value


class VariantScorer:
    """The N_scores model: `alphabet` is log_probs' last axis (N_logits'), `mask_char` the
    tokenizer's mask character, `limits` the work one request may ask for, `chunk` the most rows
    per N_logits call (its max_batch_size), `default_method` the method for variants when a request
    names none, `structure_aware` whether wild types are SaProt's structure-aware sequences. An
    ensemble's (`run_members`, `members` K) answers `member_scores` [batch, K, V] too when a request
    asks for it."""

    def __init__(self, run_logits: RunLogits, *, alphabet: Sequence[str], mask_char: str, limits: ScoringLimits,
                 chunk: int, responder: Responder, default_method: str = "wt-marginal",
                 structure_aware: bool = False, run_members: RunMembers | None = None, members: int = 0) -> None:
        self.run_logits, self.alphabet, self.mask_char = run_logits, tuple(alphabet), mask_char
        self.limits, self.chunk, self.responder = limits, chunk, responder
        if default_method not in METHODS or default_method == "pll":
            raise ValueError(f"parameter default_method is {default_method!r}, not one of the methods that score "
                             f"variants ({', '.join(m for m in METHODS if m != 'pll')}); rebuild the repository")
        self.default_method = default_method
        self.split_structure = structure_reader() if structure_aware else None
        if (run_members is None) != (members == 0):
            raise ValueError("an ensemble's scorer needs both `run_members` and its number of `members`")
        self.run_members, self.members = run_members, members
        self.outputs = ("scores", "member_scores") if members else ("scores",)

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        responses = []
        for request in requests:
            wanted = wanted_outputs(request, self.outputs)
            try:
                scores, members = self.answer(request, with_members="member_scores" in wanted)
            except ScoringError as err:  # the request's variants, method or sequence: INVALID_ARGUMENT
                responses.append(self.responder.error_response(RequestError(str(err))))
                continue
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses.append(self.responder.error_response(err))
                continue
            outputs = {"scores": scores, "member_scores": members}
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor(name, outputs[name]) for name in wanted]))
        return responses, 0

    def answer(self, request: Any, with_members: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
        """The scores of one Triton request, [batch, V] or [batch, 1], and with `with_members` (an
        ensemble's) each member's, [batch, K, V] or [batch, K, 1] (else None)."""
        return self.answer_inputs({name: input_array(request, name) for name in INPUTS}, with_members)

    def answer_inputs(self, inputs: Mapping[str, np.ndarray | None], with_members: bool = False
                      ) -> tuple[np.ndarray, np.ndarray | None]:
        """`answer` for a request's inputs by name (`sequences`, and `variants`, `method` unless
        left out): what the dev server (dev_server.py) hands over instead of a Triton request."""
        sequences = _column(inputs.get("sequences"), "sequences", None)
        if sequences is None or sequences.shape[1] != 1:
            raise RequestError(f"input 'sequences' must have shape [batch, 1], got "
                               f"{None if sequences is None else list(sequences.shape)}")
        batch = sequences.shape[0]
        variants = _column(inputs.get("variants"), "variants", batch)
        methods = _column(inputs.get("method"), "method", batch)
        if methods is not None and methods.shape[1] != 1:
            raise RequestError(f"input 'method' must have shape [{batch}, 1], got {list(methods.shape)}")
        plans = [plan_request(sequences[row, 0], None if variants is None else list(variants[row]),
                              None if methods is None else methods[row, 0], alphabet=self.alphabet,
                              mask_char=self.mask_char, limits=self.limits, default_method=self.default_method,
                              split_structure=self.split_structure)
                 for row in range(batch)]
        if not with_members:
            return np.stack(self.score(plans)).astype(np.float32), None
        scores, members = self.score_members(plans)
        return np.stack(scores).astype(np.float32), np.stack(members).astype(np.float32)

    def score(self, plans: Sequence[ScoringPlan]) -> list[np.ndarray]:
        """Each row's scores: the rows' sequences through N_logits in full calls (pack_passes),
        only the site rows kept."""
        def run(inputs: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            log_probs, mask = self.run_logits(inputs)
            return log_probs, mask, log_probs[:, None]

        return self._score(plans, run, 0)[0]

    def score_members(self, plans: Sequence[ScoringPlan]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """An ensemble's: (each row's scores, each row's members' scores [K, ...])."""
        if self.run_members is None:
            raise RequestError("output 'member_scores' is an ensemble's; this repository serves one checkpoint")
        return self._score(plans, self.run_members, self.members)

    def _score(self, plans: Sequence[ScoringPlan], run: RunMembers, members: int
               ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        # sites[0]: the mean's site rows per plan; sites[1 + k]: member k's.
        sites: list[list[list[np.ndarray]]] = [[[] for _ in plans] for _ in range(1 + members)]
        for call in pack_passes([plan.passes for plan in plans], self.chunk):
            inputs = [text for row, part in call for text in plans[row].inputs(self.mask_char, part)]
            log_probs, mask, each = run(inputs)
            if members and (each.ndim != 4 or each.shape[1] != members):
                raise RuntimeError(f"N_logits answered member_log_probs of shape {list(each.shape)} for "
                                   f"{members} members")
            start = 0
            for row, part in call:
                plan, count = plans[row], part.stop - part.start
                window = slice(start, start + count)
                sources = [log_probs[window]] + [each[window, k] for k in range(members)]
                for source, rows in zip(sources, sites):
                    rows[row].append(plan.site_log_probs(residue_rows(source, mask[window], len(plan.wild_type)),
                                                         part))
                start += count
        scores = [plan.scores(np.concatenate(row)) for plan, row in zip(plans, sites[0])]
        per_member = [np.stack([plan.scores(np.concatenate(sites[1 + k][index])) for k in range(members)])
                      for index, plan in enumerate(plans)] if members else []
        return scores, per_member


def residue_rows(log_probs: np.ndarray, mask: np.ndarray, residues: int) -> np.ndarray:
    """[n, residues, A]: each sequence's residue rows (its mask), in order, from N_logits'
    log_probs [n, length, A] (length: the call's longest sequence, specials included); every one
    of the n sequences has `residues` residues (copies of one wild type)."""
    counts = mask.sum(axis=1)
    if not (counts == residues).all():
        raise RuntimeError(f"N_logits answered {counts.tolist()} residue rows for sequences of {residues}")
    return log_probs[mask].reshape(mask.shape[0], residues, log_probs.shape[-1])
