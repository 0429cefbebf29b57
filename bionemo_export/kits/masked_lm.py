"""logits and scores: the masked-LM head's graph after the encoder's, its Python models (N_logits,
N_scores), compared with PyTorch's encoder and head and with ESM's scoring formula computed here."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.exporters.lm_head import lm_head_check_batches
from bionemo_export.model_repository.masked_lm import MASKED_LM_TASKS, MaskedLMHead, plan_masked_lm_models
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.model_repository.plan import ModelPlan
from bionemo_export.models import LoadedModel
from bionemo_export.serving.member_mean import mean_log_probs
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.scores import INPUTS as SCORES_INPUTS
from bionemo_export.serving.scores import VariantScorer
from bionemo_export.serving.scoring import ScoringLimits
from bionemo_export.tasks import Graph

from .base import Answers, GraphExport, PlanContext, Requests, TaskKit, register_kit
from .comparison import TaskCheck, VerifyContext, compare_outputs, describe_batch, task_check
from .dev import DevAnswers


def masked_lm_head(loaded: LoadedModel, onnx_file: Path = Path("lm_head.onnx")) -> MaskedLMHead:
    """What the masked-LM planners need of a checkpoint's head (also a checkpoint ensemble's, build.py)."""
    return MaskedLMHead(onnx_file, tuple(loaded.alphabet), getattr(loaded.tokenizer, "mask_char", None),
                        default_method=loaded.family.scoring_default,
                        structure_aware=bool(getattr(loaded.tokenizer, "structure_aware", False)))


@register_kit
class MaskedLMKit(TaskKit):
    """N_logits (the head's log-probabilities) and N_scores (variant effects and PLLs over N_logits)."""

    tasks = MASKED_LM_TASKS
    # Small and position-wise: checked on batches of hidden states of its own.
    graphs = {Graph.LM_HEAD: GraphExport(lambda loaded, batches: (loaded.lm_head, loaded.lm_head_inputs,
                                                                  loaded.lm_head_outputs,
                                                                  lm_head_check_batches(loaded)))}

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        loaded = context.loaded
        return plan_masked_lm_models(context.name, hidden_size=loaded.hidden_size,
                                     head=masked_lm_head(loaded, context.graph_files(Graph.LM_HEAD)["model.onnx"]),
                                     tasks=context.tasks, options=context.serving,
                                     max_length=loaded.tokenizer.max_length)

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        return verify_masked_lm(context.client, context.loaded, tasks, context.batches, context.head_limits(),
                                members=context.members)

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return _logits(dev, requests) if task == "logits" else _scores(dev, requests)


def _logits(dev: DevAnswers, requests: Requests) -> Answers:
    """The masked-LM head's log-probabilities over the alphabet, rows laid out like hiddens; an
    ensemble's: the mean of its members' (serving/member_mean.py, as N_member_mean computes it)
    and each member's as `member_log_probs` [K, length, A]."""
    answers = []
    for each, mask in dev.log_probs(requests):
        if dev.members:
            mean, stacked = mean_log_probs(each)
            answers.append({"log_probs": mean, "mask": mask, "member_log_probs": stacked})
        else:
            answers.append({"log_probs": each[0], "mask": mask})
    return answers


def _scores(dev: DevAnswers, requests: Requests) -> Answers:
    """Variant scores or PLLs by the repository's own N_scores (serving/scores.py's VariantScorer:
    the same checks, plans, messages and calls of a repository's max_batch_size copies), each
    call's log-probabilities from the PyTorch encoder and head; an ensemble's: the scores of
    the members' mean and each member's as `member_scores` [K, V]."""
    mask_char = dev.loaded.tokenizer.mask_char
    if mask_char is None:  # serves_scores: no scores model is bound then
        raise InvalidInputError(f"{dev.loaded.checkpoint}: its tokenizer has no mask character, so it scores "
                                "no variants")
    scorer = VariantScorer(dev.run_logits, alphabet=dev.loaded.alphabet, mask_char=mask_char,
                           limits=ScoringLimits(), chunk=ServingOptions().max_batch_size,
                           responder=Responder("scores"), default_method=dev.loaded.family.scoring_default,
                           structure_aware=getattr(dev.loaded.tokenizer, "structure_aware", False),
                           run_members=dev.run_members if dev.members else None, members=len(dev.members))
    answers = []
    for request in requests:
        # PyTriton's Request is no Mapping (no .get); an optional input left out is absent.
        inputs = {name: np.asarray(request[name]) for name in SCORES_INPUTS if name in request}
        scores, each = scorer.answer_inputs(inputs, with_members=bool(dev.members))
        answers.append({"scores": scores} if each is None else {"scores": scores, "member_scores": each})
    return answers


def _log_probs(models, batch: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """PyTorch's (log_probs [B, L, A], attention mask, residue mask) of `batch`: encoder, then head.
    `models`: one LoadedModel, or a checkpoint ensemble's members (a sequence of them, one
    tokenizer), whose log-probabilities are averaged as the ensemble's N_logits averages them."""
    import torch

    models = models if isinstance(models, list | tuple) else [models]
    encoded = models[0].tokenizer.encode(batch)
    each = []
    for loaded in models:
        with torch.no_grad():
            hiddens, _ = loaded.encoder(torch.from_numpy(encoded.input_ids),
                                        torch.from_numpy(encoded.attention_mask),
                                        torch.from_numpy(encoded.residue_mask))
            each.append(loaded.lm_head(hiddens).numpy().astype(np.float64))
    log_probs = np.mean(each, axis=0).astype(np.float32)
    return log_probs, encoded.attention_mask.astype(bool), encoded.residue_mask


def _reference_scores(models, wild_type: str, variants: list[str], method: str) -> np.ndarray:
    """ESM's formula, one (masked) copy at a time in PyTorch, written here apart from serving/scoring.py.
    `models`: as _log_probs takes them."""
    loaded = models[0] if isinstance(models, list | tuple) else models
    columns = {residue: column for column, residue in enumerate(loaded.alphabet)}
    mask_char = loaded.tokenizer.mask_char
    unmasked = _log_probs(models, [wild_type])[0][0, 1:]  # residue rows (after BOS)
    scores = []
    for variant in variants:
        total = 0.0
        for mutation in variant.split(":"):
            i = int(mutation[1:-1]) - 1
            if method == "wt-marginal":
                row = unmasked[i]
            else:
                copy = wild_type[:i] + mask_char + wild_type[i + 1:]
                row = _log_probs(models, [copy])[0][0, 1 + i]
            total += float(row[columns[mutation[-1]]] - row[columns[mutation[0]]])
        scores.append(total)
    return np.asarray(scores)


def verify_masked_lm(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float],
                     members: Sequence[LoadedModel] = ()) -> list[TaskCheck]:
    """logits: served log-probabilities against PyTorch's encoder + head on each batch; scores: one
    protein's single mutants (wt-marginal and masked-marginal) and two PLLs against PyTorch,
    masking one copy at a time. A checkpoint ensemble's (`members`, `loaded` the first): against
    the mean of the members' log-probabilities, and each member's `member_log_probs` against its
    own PyTorch model."""
    checks = []
    models = tuple(members) or loaded
    if "logits" in tasks:
        for batch in batches:
            served, mask = client.seqs_to_log_probs(batch)
            expected, attention, residues = _log_probs(models, batch)
            mask_exact = bool(mask.shape == residues.shape and np.array_equal(mask, residues))
            found = compare_outputs(served[attention], expected[attention]) if served.shape == expected.shape \
                else compare_outputs(served, expected)
            checks.append(task_check(client.model("logits"), batch, found, mask_exact, limits,
                                      f"the mean of {len(members)} members" if members else ""))
        if members:
            checks += _member_checks(client, members, batches[0], limits)
    if "scores" in tasks:
        proteins = [s for s in loaded.family.sample_sequences() if set(s) <= set(loaded.alphabet)]
        wild_type = min((s for s in proteins if len(s) >= 5), key=len)[:30]
        variants = [f"{wt}{i + 1}{next(a for a in loaded.alphabet if a != wt)}" for i, wt in enumerate(wild_type[:4])]
        variants.append(":".join(variants[:2]))
        for method in ("wt-marginal", "masked-marginal"):
            served = client.score_variants(wild_type, variants, method)
            found = compare_outputs(served[None, :], _reference_scores(models, wild_type, variants, method)[None, :])
            checks.append(TaskCheck(client.model("scores"), f"{len(variants)} variants of {len(wild_type)} residues",
                                    found.max_abs_error, None, None, found.max_abs_error <= limits[0] * 10,
                                    f"{method} against ESM's formula in PyTorch", found.problem))
        pair = sorted(proteins, key=len)[:2]
        served = client.pseudo_log_likelihood(pair)
        expected = []
        for sequence in pair:
            rows = [_log_probs(models, [sequence[:i] + loaded.tokenizer.mask_char + sequence[i + 1:]])[0][0, 1 + i]
                    for i in range(len(sequence))]
            expected.append(np.mean([row[loaded.alphabet.index(r)] for row, r in zip(rows, sequence)]))
        error = float(np.max(np.abs(served - np.asarray(expected))))
        checks.append(TaskCheck(client.model("scores"), describe_batch(pair), error, None, None,
                                error <= limits[0] * 10,
                                "pll: mean log-probability, each residue masked, against PyTorch"))
    return checks


def _member_checks(client, members: Sequence[LoadedModel], batch: list[str], limits: tuple[float, float]
                   ) -> list[TaskCheck]:
    """An ensemble's `member_log_probs`: each member's against its own PyTorch model."""
    column = np.array([[s.encode("utf-8")] for s in batch], dtype=np.object_)
    served = client.client.infer(client.model("logits"), {"sequences": column}, ["member_log_probs"])
    answers = served["member_log_probs"]
    checks = []
    for number, loaded in enumerate(members, 1):
        expected, attention, _ = _log_probs(loaded, batch)
        mine = answers[:, number - 1]
        found = compare_outputs(mine[attention], expected[attention]) if mine.shape == expected.shape \
            else compare_outputs(mine, expected)
        checks.append(task_check(client.model("logits"), batch, found, None, limits,
                                  f"member_log_probs of member {number} ({loaded.checkpoint.name})"))
    return checks
