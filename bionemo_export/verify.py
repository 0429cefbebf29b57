"""Check a served repository against the PyTorch reference of the same checkpoint.

Sample sequences of several lengths go through the public models (`N_embeddings`, `N_hiddens`) of
a running server, or of the embedded tritonserver started for the purpose; the answers are
compared with the checkpoint's PyTorch model: max abs error and minimum cosine per task, and for
`hiddens` the exact `mask`.

The tolerance follows manifest.json's `precision`: the family's (atol and cosine) for fp32; for an
int8 or fp16 encoder, the precision's minimum cosine per output (exporters/verification.py), the
figures then being the accuracy cost of that precision against PyTorch fp32 (each check's note
says so, with what the build measured).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bionemo_export.client import EncoderClient, Seq2SeqClient
from bionemo_export.errors import InvalidInputError, reason
from bionemo_export.model_repository.integrity import require_intact
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.numerics import cosine_rows, degenerate_rows
from bionemo_export.tasks import TASKS

if TYPE_CHECKING:  # torch is heavy; the checks load it when they run
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


def _describe(batch: list[str]) -> str:
    lengths = [len(s) for s in batch]
    if len(batch) == 1:
        return f"1 sequence, {lengths[0]} residues"
    return f"{len(batch)} sequences, {min(lengths)}-{max(lengths)} residues"


def _reference(loaded, batch: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    import torch

    encoded = loaded.tokenizer.encode(batch)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(
            torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
            torch.from_numpy(encoded.residue_mask))
    return hiddens.numpy(), embeddings.numpy(), encoded.attention_mask.astype(bool), encoded.residue_mask


def verify_served(client: EncoderClient, loaded, tasks: list[str], batches: list[list[str]],
                  atol: float, min_cosine: float, tolerances: dict | None = None,
                  notes: dict[str, str] | None = None) -> list[TaskCheck]:
    """Compare the served public models with PyTorch on each batch. `tolerances` (task ->
    exporters.Tolerance) overrides `atol`/`min_cosine` per task; `notes` (task -> text) is
    attached to that task's checks."""
    tolerances, notes = tolerances or {}, notes or {}
    limits = {task: (tolerances[task].atol, tolerances[task].min_cosine) if task in tolerances else (atol, min_cosine)
              for task in ("embeddings", "hiddens")}
    checks = []
    for batch in batches:
        ref_hiddens, ref_embeddings, attention, residues = _reference(loaded, batch)
        if "embeddings" in tasks:
            found = compare_outputs(client.seqs_to_embedding(batch), ref_embeddings)
            checks.append(_task_check(f"{client.name}_embeddings", batch, found, None, limits["embeddings"],
                                      notes.get("embeddings", "")))
        if "hiddens" in tasks:
            hiddens, mask = client.seqs_to_hidden(batch)
            mask_exact = bool(mask.shape == residues.shape and np.array_equal(mask, residues))
            if hiddens.shape == ref_hiddens.shape:
                # Padding positions are don't-care; every real token (BOS/EOS included) must match.
                found = compare_outputs(hiddens[attention], ref_hiddens[attention])
            else:
                found = compare_outputs(hiddens, ref_hiddens)
            if found.problem is None and not mask_exact:
                found = dataclasses.replace(found, problem="served mask differs from the reference's")
            checks.append(_task_check(f"{client.name}_hiddens", batch, found, mask_exact, limits["hiddens"],
                                      notes.get("hiddens", "")))
    return checks


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
            checks.append(_task_check(client.model("logits"), batch, found, mask_exact, limits,
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
        checks.append(TaskCheck(client.model("scores"), _describe(pair), error, None, None, error <= limits[0] * 10,
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
        checks.append(_task_check(client.model("logits"), batch, found, None, limits,
                                  f"member_log_probs of member {number} ({loaded.checkpoint.name})"))
    return checks


def verify_predictions(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                       ) -> list[TaskCheck]:
    """predictions: served logits against PyTorch's encoder + fine-tuned head on each batch (token
    heads on real tokens only), and the served labels equal to the argmax's names (single-label)."""
    import torch

    if "predictions" not in tasks or loaded.classifier is None:
        return []
    head, checks = loaded.classifier, []
    for batch in batches:
        served = client.predict(batch)
        encoded = loaded.tokenizer.encode(batch)
        with torch.no_grad():
            hiddens, _ = loaded.encoder(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
                                        torch.from_numpy(encoded.residue_mask))
            expected = head(hiddens).numpy()
        logits = served["logits"]
        mask_exact = None
        if head.per_token:
            attention = encoded.attention_mask.astype(bool)
            mask_exact = bool(served["mask"].shape == encoded.residue_mask.shape
                              and np.array_equal(served["mask"], encoded.residue_mask))
            found = compare_outputs(logits[attention], expected[attention]) if logits.shape == expected.shape \
                else compare_outputs(logits, expected)
        else:
            found = compare_outputs(logits, expected)
        if found.problem is None and head.problem_type == "single_label_classification":
            names = np.asarray(head.labels, dtype=object)[expected.argmax(-1)]
            if head.per_token:
                labels_equal = all(list(served["label"][r][:int(attention[r].sum())]) == list(names[r][attention[r]])
                                   for r in range(len(batch)))
            else:
                labels_equal = list(served["label"]) == list(names)
            if not labels_equal:
                found = dataclasses.replace(found, problem="served labels differ from the reference argmax's names")
        checks.append(_task_check(client.model("predictions"), batch, found, mask_exact, limits,
                                  f"{head.problem_type}, {len(head.labels)} labels"))
    return checks


def verify_contacts(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                    ) -> list[TaskCheck]:
    """contacts: each sequence's served [L, L] map against the PyTorch contact head on that
    sequence alone (its map does not depend on what it is batched with)."""
    import torch

    if "contacts" not in tasks or loaded.contacts is None:
        return []
    checks = []
    for batch in batches:
        served = client.predict_contacts(batch)
        expected = []
        for sequence in batch:
            encoded = loaded.tokenizer.encode([sequence])
            with torch.no_grad():
                expected.append(loaded.contacts(torch.from_numpy(encoded.input_ids),
                                                torch.from_numpy(encoded.attention_mask))[0].numpy())
        if [m.shape for m in served] != [m.shape for m in expected]:
            found = Comparison(float("inf"), float("-inf"), f"served maps of shapes {[m.shape for m in served]}, "
                               f"expected {[m.shape for m in expected]}")
        else:  # the rows of each map compared as vectors
            each = [compare_outputs(got, want) for got, want in zip(served, expected)]
            found = Comparison(max(c.max_abs_error for c in each), min(c.min_cosine for c in each),
                               next((c.problem for c in each if c.problem), None))
        checks.append(_task_check(client.model("contacts"), batch, found, None, limits,
                                  "each [L, L] map against PyTorch's contact head"))
    return checks


def reference_layer_states(loaded, input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
    """Every layer's states [layers + 1, B, T, H], computed apart from the layers graph's module: a
    transformers backbone's own `output_hidden_states=True`; the project's transformer (Megatron
    layouts, MegaMolBART), which has no such flag, through the package's layer states."""
    import torch

    backbone = getattr(loaded.encoder, "backbone", None)
    ids, mask = torch.from_numpy(np.asarray(input_ids)), torch.from_numpy(np.asarray(attention_mask))
    with torch.no_grad():
        if backbone is not None and hasattr(backbone, "config") and hasattr(backbone, "get_input_embeddings"):
            states = backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        else:
            states = loaded.layer_states(ids, mask)
    return torch.stack([state.float() for state in states]).numpy()


def verify_layers(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                  ) -> list[TaskCheck]:
    """layers: the first, a middle and the last layer of each batch, every pooling the model
    answers, against transformers' `output_hidden_states` pooled here by numpy over the residues."""
    from bionemo_export.serving.layers import has_bos_token

    if "layers" not in tasks:
        return []
    count = loaded.num_layers
    layers = [0, count // 2, -1]
    checks = []
    for batch in batches:
        encoded = loaded.tokenizer.encode(batch)
        states = reference_layer_states(loaded, encoded.input_ids, encoded.attention_mask)[[0, count // 2, count]]
        residues = encoded.residue_mask.astype(bool)
        has_bos = has_bos_token(loaded.tokenizer, batch[0])
        include = ["mean", "max", *(["bos"] if has_bos else []), "per_tok"]
        served = client.layer_embeddings(batch, layers, include)
        weights = residues[None, :, :, None]
        expected = {"embeddings": (states * weights).sum(2) / np.maximum(weights.sum(2), 1),
                    "embeddings_max": np.where(weights, states, -np.inf).max(2),
                    "embeddings_bos": states[:, :, 0]}
        comparisons = []
        for name, want in expected.items():
            if name in served:
                comparisons.append(compare_outputs(served[name], want.transpose(1, 0, 2)))
        hiddens, mask = served.get("hiddens"), served.get("mask")
        mask_exact = bool(mask is not None and mask.shape == residues.shape and np.array_equal(mask, residues))
        want = states.transpose(1, 0, 2, 3)
        if hiddens is None or hiddens.shape != want.shape:
            comparisons.append(Comparison(float("inf"), float("-inf"), f"served hiddens of shape "
                               f"{None if hiddens is None else list(hiddens.shape)}, expected {list(want.shape)}"))
        else:
            attention = encoded.attention_mask.astype(bool)
            comparisons.append(compare_outputs(hiddens.transpose(0, 2, 1, 3)[attention],
                                               want.transpose(0, 2, 1, 3)[attention]))
        found = Comparison(max(c.max_abs_error for c in comparisons), min(c.min_cosine for c in comparisons),
                           next((c.problem for c in comparisons if c.problem), None))
        checks.append(_task_check(client.model("layers"), batch, found, mask_exact, limits,
                                  f"layers {layers}, {', '.join(include)} against output_hidden_states"))
    return checks


def verify_attentions(client, loaded, tasks: list[str], batches: list[list[str]], limits: tuple[float, float]
                      ) -> list[TaskCheck]:
    """attentions: the first, a middle and the last block, every head, of each batch against the
    PyTorch encoder's eager attention (output_attentions), each sequence's own [T, T] block of
    every head compared as rows (its padding answers 0 when served)."""
    import torch

    if "attentions" not in tasks or not loaded.returns_attentions:
        return []
    count = loaded.num_layers
    layers = list(dict.fromkeys([1, max(count // 2, 1), count]))
    maps = loaded.attention_maps
    checks = []
    for batch in batches:
        encoded = loaded.tokenizer.encode(batch)
        with torch.no_grad():
            every = maps(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
        want = np.stack([every[layer - 1].numpy() for layer in layers], axis=1)  # [B, K, heads, T, T]
        served = client.attention_maps(batch, layers)
        got, mask = served["attentions"], served["mask"]
        residues = encoded.residue_mask.astype(bool)
        mask_exact = bool(mask.shape == residues.shape and np.array_equal(mask, residues))
        if got.shape != want.shape:
            found = Comparison(float("inf"), float("-inf"), f"served attentions of shape {list(got.shape)}, "
                               f"expected {list(want.shape)}")
        else:
            each = []
            for row, tokens in enumerate(encoded.attention_mask.sum(axis=1)):
                n = int(tokens)
                each.append(compare_outputs(got[row, :, :, :n, :n].reshape(-1, n),
                                            want[row, :, :, :n, :n].reshape(-1, n)))
                if np.any(got[row, :, :, n:]) or np.any(got[row, :, :, :, n:]):
                    each.append(Comparison(float("inf"), float("-inf"), f"row {row}: nonzero past its {n} tokens"))
            found = Comparison(max(c.max_abs_error for c in each), min(c.min_cosine for c in each),
                               next((c.problem for c in each if c.problem), None))
        checks.append(_task_check(client.model("attentions"), batch, found, mask_exact, limits,
                                  f"blocks {layers}, every head, against output_attentions"))
    return checks


def _task_check(model: str, batch: list[str], found: Comparison, mask_exact: bool | None,
                limits: tuple[float, float], note: str) -> TaskCheck:
    return TaskCheck(model, _describe(batch), found.max_abs_error, found.min_cosine, mask_exact,
                     found.within(*limits), note, found.problem)


SAMPLING_CHECKS = (
    ("greedy-perturbate", {"num_samples": 2}),
    ("topkp-perturbate", {"num_samples": 2, "top_k": 4, "top_p": 0.9}),
    ("beam-search-perturbate", {"num_samples": 1, "beam_size": 2}),
    ("beam-search-single-sample", {"num_samples": 2}),
    ("beam-search-perturbate-sample", {"num_samples": 2, "beam_size": 2}),
)


def _expected_outputs(method: str, parameters: dict) -> int:
    """Outputs per sequence: num_samples, times beam_size for beam-search-perturbate-sample."""
    sampling = TASKS["samplings"]
    samples = parameters.get("num_samples", sampling.input("num_samples").default)
    beams = parameters.get("beam_size", sampling.input("beam_size").default)
    return samples * beams if method == "beam-search-perturbate-sample" else samples


def verify_decoding(client, loaded, tasks: list[str], batch: list[str], seed: int = 1234,
                    max_decode_length: int | None = None, precision: str = "fp32") -> list[TaskCheck]:
    """decodes: served strings equal the reference greedy decode (no cache, PyTorch) exactly.
    samplings: every method answers with the right shape, and a seeded request equals the
    reference sampling with the same seed (fp32 encoders only: samplings start from the served
    encoder's hiddens, which an int8/fp16 encoder changes, so only the shape is checked then)."""
    from bionemo_export.generation.reference import encode_hiddens, reference_decode, reference_sample

    checks = []
    described = _describe(batch)
    if "decodes" in tasks:
        hiddens, mask = encode_hiddens(loaded, batch)
        served = client.hidden_to_seqs(hiddens, mask)
        expected = reference_decode(loaded, hiddens, mask, max_decode_length)
        same = sum(a == b for a, b in zip(served, expected))
        checks.append(TaskCheck(f"{client.name}_decodes", described, None, None, None,
                                same == len(batch) and len(served) == len(batch),
                                f"{same}/{len(batch)} strings equal the reference greedy decode"))
    if "samplings" in tasks:
        for method, parameters in SAMPLING_CHECKS:
            served = client.sample_seqs(batch, sampling_method=method, seed=seed, **parameters)
            expected = reference_sample(loaded, batch, seed=seed, method=method, max_length=max_decode_length,
                                        **parameters)
            shape_ok = [len(row) for row in served] == [_expected_outputs(method, parameters)] * len(batch)
            exact = precision == "fp32"
            note = (f"{method}: {'same as' if served == expected else 'DIFFERS from'} the seeded reference"
                    f"{'' if exact else f' (not required: {precision} encoder)'}; "
                    f"shape {'ok' if shape_ok else 'WRONG'}")
            checks.append(TaskCheck(f"{client.name}_samplings", described, None, None, None,
                                    shape_ok and (served == expected or not exact), note))
    return checks


def verify_repository(repository: Path, checkpoint: Path | Sequence[Path], url: str | None = None,
                      tritonserver: str | None = None, check_files: bool = True) -> list[TaskCheck]:
    """Serve `repository` (unless `url` names a running server) and check it against `checkpoint`
    (a checkpoint ensemble's: every member, in the build's order, each loaded as its family).

    First (unless not `check_files`: the caller checked them) its files are compared with the
    digests manifest.json records: integrity.IntegrityError naming any that changed."""
    from bionemo_export.models import get_family
    from bionemo_export.runtime import TritonServer, find_tritonserver

    if check_files:
        require_intact(repository)
    manifest = Manifest.read(repository)
    family = get_family(manifest.family)
    checkpoints = [Path(checkpoint)] if isinstance(checkpoint, str | Path) else [Path(p) for p in checkpoint]
    built_from = len(manifest.members or ()) or 1
    if len(checkpoints) != built_from:
        listed = ", ".join(str(m.get("path")) for m in manifest.members or ())
        raise InvalidInputError(
            f"{repository} was built from {built_from} checkpoint{'s' if built_from > 1 else ''}"
            f"{f' (an ensemble: {listed})' if listed else ''}; got {len(checkpoints)}: give `checkpoint` once per "
            "member, in the build's order")
    loaded_members = []
    for path in checkpoints:
        try:
            loaded_members.append(family.load(path, max_length=manifest.max_length))
        except Exception as err:  # a malformed checkpoint breaks readers and families in many ways: name it
            raise InvalidInputError(f"cannot load {path} as {family.name}: {reason(err)}") from err
    loaded = loaded_members[0]
    samples = loaded.family.sample_sequences()  # fits the checkpoint (bert: protein or SMILES)
    batches = [samples] + [[s] for s in sorted(samples, key=len)[:: max(1, len(samples) // 3)]]
    with ExitStack() as stack:
        if url is None:
            server = stack.enter_context(TritonServer(repository, install=find_tritonserver(tritonserver)))
            url = f"grpc://{server.endpoints.grpc_url}"
        client = stack.enter_context(Seq2SeqClient(manifest.name, url))
        tolerances, notes = precision_checks(manifest, family)
        served = VerifyContext(client, loaded, manifest, batches, samples, tolerances, notes,
                               tuple(loaded_members) if manifest.members else ())
        carried = loaded.servable(manifest.tasks)
        unchecked = {TASKS[t].check for t in carried} - set(CHECKS)
        if unchecked:
            raise InvalidInputError(f"{repository}: verify has no check {', '.join(sorted(unchecked))} (a task entry's "
                                    f"`check`); verify.CHECKS has {', '.join(CHECKS)}: add its function there")
        checks: list[TaskCheck] = []
        for name, check in CHECKS.items():  # in a fixed order: the report lists them so
            tasks = [t for t in carried if TASKS[t].check == name]
            if tasks:
                checks += check(served, tasks)
        return checks


@dataclass(frozen=True)
class VerifyContext:
    """What each of `CHECKS` compares: the served repository's client, the checkpoint it was built
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


Check = Callable[[VerifyContext, list[str]], list[TaskCheck]]
CHECKS: dict[str, Check] = {
    "encoder": lambda served, tasks: verify_served(
        served.client, served.loaded, tasks, served.batches, served.loaded.family.atol,
        served.loaded.family.min_cosine, tolerances=served.tolerances, notes=served.notes),
    "masked_lm": lambda served, tasks: verify_masked_lm(served.client, served.loaded, tasks, served.batches,
                                                        served.head_limits(), members=served.members),
    "predictions": lambda served, tasks: verify_predictions(served.client, served.loaded, tasks, served.batches,
                                                            served.head_limits()),
    "contacts": lambda served, tasks: verify_contacts(served.client, served.loaded, tasks, served.batches,
                                                      (served.loaded.family.atol, served.loaded.family.min_cosine)),
    "layers": lambda served, tasks: verify_layers(served.client, served.loaded, tasks, served.batches,
                                                  (served.loaded.family.atol, served.loaded.family.min_cosine)),
    "attentions": lambda served, tasks: verify_attentions(served.client, served.loaded, tasks, served.batches,
                                                          (served.loaded.family.atol, served.loaded.family.min_cosine)),
    "decoding": lambda served, tasks: verify_decoding(
        served.client, served.loaded, tasks, served.samples, max_decode_length=served.manifest.max_decode_length,
        precision=served.manifest.precision),
}
"""Each task entry's `check` by name: the function that compares the served tasks that name it
(those the checkpoint carries) with PyTorch; run in this order."""


def precision_checks(manifest: Manifest, family) -> tuple[dict, dict[str, str]]:
    """(task -> Tolerance, task -> note) for the repository's precision: the family's tolerance for
    fp32; for the reduced precisions the minimum cosine the build held the graph to (manifest.json's
    `accuracy`: the precision's, or the build's `min-cosine`), and a note with the accuracy cost
    the build measured."""
    from bionemo_export.exporters.verification import Tolerance, precision_tolerances

    precision = manifest.precision
    tolerances = precision_tolerances(precision, ["embeddings", "hiddens"], family.atol, family.min_cosine)
    if precision == "fp32":
        return tolerances, {}
    measured = manifest.accuracy.get("outputs", {})
    for task in tolerances:
        held = measured.get(task, {}).get("tolerance", {}).get("min_cosine")
        if isinstance(held, float):
            tolerances[task] = Tolerance(tolerances[task].atol, held)
    notes = {}
    for task, tolerance in tolerances.items():
        built = measured.get(task)
        at_build = (f"; build: min cosine {built['min_cosine']:.6f}, max abs error {built['max_abs_error']:.2e}"
                    if built and isinstance(built.get("min_cosine"), float) else "")
        notes[task] = f"{precision} vs fp32 PyTorch: min cosine >= {tolerance.min_cosine:g} required{at_build}"
    return tolerances, notes


def verify_golden(repository: Path, check_files: bool = True) -> list[TaskCheck]:
    """Without the checkpoint: every stored graph's golden answers (the build's verified inputs and
    PyTorch outputs, serving/golden.py) run on this host with ONNX Runtime, through the graph a
    served model would open here (an int8 repository's VNNI or no-VNNI graph), against the tolerance
    the build held it to: what each served model checks when it loads. InvalidInputError when the
    repository has no golden answers (built before they were stored)."""
    import onnxruntime as ort

    from bionemo_export.exporters.runtime_session import session_options
    from bionemo_export.serving.golden import GOLDEN_FILE, read_golden
    from bionemo_export.serving.host import cpu_description
    from bionemo_export.serving.onnx_session import graph_for_this_host

    if check_files:
        require_intact(repository)
    found = sorted(repository.glob(f"*/*/{GOLDEN_FILE}")) + sorted(repository.glob(f"*/*/*/{GOLDEN_FILE}"))
    # The graphs N_encoder hosts beside its own (layers, contacts, attentions: one weights file)
    # keep theirs as <stem>.golden.npz (serving/golden.golden_path).
    hosted = sorted(repository.glob(f"*/*/*.{GOLDEN_FILE}"))
    if not found + hosted:
        raise InvalidInputError(f"{repository} has no golden answers ({GOLDEN_FILE} beside its graphs): it was "
                                "built before they were stored; pass --checkpoint to verify it against PyTorch, "
                                "or rebuild it")
    vnni = "VNNI" if cpu_description()["vnni"] else "no VNNI"
    checks = []
    graphs = [(path, graph_for_this_host(str(path.parent), ["CPUExecutionProvider"])) for path in found]
    graphs += [(path, str(path.parent / f"{path.name.removesuffix('.' + GOLDEN_FILE)}.onnx")) for path in hosted]
    for path, graph in graphs:
        session = ort.InferenceSession(graph, session_options(), providers=["CPUExecutionProvider"])
        golden = read_golden(str(path))
        shape = next(iter(golden.inputs.values())).shape
        model = path.relative_to(repository).parts[0] + ("" if path in found else f" ({Path(graph).stem})")
        for check in golden.run(session):
            checks.append(TaskCheck(
                model=f"{model}:{check.name}", batch=f"golden inputs {list(shape)}",
                max_abs_error=check.figures.max_abs_error, min_cosine=check.figures.min_cosine, mask_exact=None,
                passed=check.passed, problem=check.figures.problem,
                note=f"{Path(graph).relative_to(path.parent)} on this host ({vnni}); cosine >= {check.min_cosine:g}"
                     + (f", max abs <= {check.atol:g}" if np.isfinite(check.atol) else "")))
    return checks
