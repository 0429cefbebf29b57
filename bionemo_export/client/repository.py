"""One Python client for a repository's public models, with the names BioNeMo's notebooks use.

    from bionemo_export.client import RepositoryClient
    with RepositoryClient("megamolbart", "grpc://localhost:8001") as client:
        embeddings = client.seqs_to_embedding(["CCO", "c1ccccc1"])      # [2, H]
        hiddens, mask = client.seqs_to_hidden(["CCO", "c1ccccc1"])     # [2, L, H], [2, L]
        smiles = client.hidden_to_seqs(hiddens, mask)                   # ["CCO", "c1ccccc1"]
        samples = client.sample_seqs(["CCO"], num_samples=3, seed=1)    # [["...", "...", "..."]]

Any number of inputs: they go in requests of the model's max_batch_size (read from the server),
several in flight, and come back in order as one batch, as one request would have answered
(hidden states padded to the longest sequence). numpy in and out; torch tensors are accepted.
Works against a generated repository and against `bionemo-export dev-server` alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import LAYER_INCLUDE, LAYER_OUTPUTS, TASKS, get_task
from bionemo_export.tensors import DType

from .batches import DEFAULT_IN_FLIGHT, infer_rows
from .triton import DEFAULT_URL, TritonClient

SAMPLING_INPUTS = {t.name: t.dtype.numpy for t in TASKS["samplings"].optional_inputs if t.dtype is not DType.BYTES}
"""The optional numeric inputs of N_samplings and their dtypes (sampling_method is a string)."""


def to_numpy(value: Any, dtype: Any = None) -> np.ndarray:
    """`value` (numpy, torch tensor on any device, nested lists) as a numpy array."""
    if hasattr(value, "detach"):  # torch, without importing it
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=dtype)


Sequences = Sequence[str] | np.ndarray
"""Sequences as a client takes them: a list of strings or a NumPy array of them."""


def strings_column(sequences: Sequences) -> np.ndarray:
    """Sequences as a BYTES tensor [N, 1] (UTF-8): from a list of str or bytes, or an array of them."""
    if isinstance(sequences, (str, bytes)):
        raise TypeError("give a list of sequences, not one string")
    items = np.asarray(sequences, dtype=np.object_).reshape(-1)
    return np.array([[item if isinstance(item, bytes) else str(item).encode("utf-8")] for item in items],
                    dtype=np.object_).reshape(len(items), 1)


class RepositoryClient:
    """The public models `N_embeddings`, `N_hiddens`, `N_decodes`, `N_samplings` of a repository
    built with `--name N` (or of a dev server started with `--name N`), over HTTP or gRPC.

    `in_flight`: requests awaiting an answer at once; `batch_size`: rows per request (default:
    each model's max_batch_size). A refused request raises InferenceError with the server's
    message; an unreachable server raises ServerUnreachableError naming the URL."""

    def __init__(self, name: str, url: str = DEFAULT_URL, *, in_flight: int = DEFAULT_IN_FLIGHT,
                 batch_size: int | None = None, timeout_s: float = 300.0) -> None:
        self.name = name
        self.in_flight = in_flight
        self.batch_size = batch_size
        self.client = TritonClient(url, timeout_s=timeout_s, concurrency=in_flight)

    # ------------------------------------------------------------------------ BioNeMo's names
    def seqs_to_embedding(self, sequences: Sequences) -> np.ndarray:
        """FP32 [batch, hidden]: mean of the hidden states over each sequence's residues/tokens."""
        return self._strings_in("embeddings", sequences, ["embeddings"])["embeddings"]

    def seqs_to_hidden(self, sequences: Sequences) -> tuple[np.ndarray, np.ndarray]:
        """(hiddens FP32 [batch, length, hidden], mask BOOL [batch, length]); mask is True on
        residues/tokens, length the longest sequence's."""
        out = self._strings_in("hiddens", sequences, ["hiddens", "mask"])
        return out["hiddens"], out["mask"]

    def hidden_to_seqs(self, hiddens: Any, mask: Any = None) -> list[str]:
        """Greedy-decode hidden states [batch, length, hidden] into strings; `mask` [batch, length]
        is True on real tokens (all True when omitted)."""
        hiddens = to_numpy(hiddens, np.float32)
        if hiddens.ndim != 3:
            raise InvalidInputError(f"hiddens must be [batch, length, hidden], got shape {list(hiddens.shape)}")
        mask = np.ones(hiddens.shape[:2], dtype=bool) if mask is None else to_numpy(mask).astype(bool)
        if mask.shape != hiddens.shape[:2]:
            raise InvalidInputError(f"mask shape {list(mask.shape)} does not match hiddens [batch, length] "
                                    f"{list(hiddens.shape[:2])}")
        if not len(hiddens):
            return []
        out = self._run("decodes", len(hiddens), lambda rows, _: {"hiddens": hiddens[rows], "mask": mask[rows]},
                        ["sequences"])
        return [row[0].decode("utf-8") for row in out["sequences"]]

    def sample_seqs(self, sequences: Sequences, *, num_samples: int | None = None,
                    scaled_radius: float | None = None, sampling_method: str | None = None,
                    seed: int | None = None, top_k: int | None = None, top_p: float | None = None,
                    temperature: float | None = None, beam_size: int | None = None) -> list[list[str]]:
        """New sequences sampled around each input: [batch][outputs]. Options left out take the
        server's defaults (greedy-perturbate, 1 sample, scaled_radius 1.0). With a seed, request i
        of a split batch uses seed + i: the result is reproducible, and a batch that fits in one
        request gets exactly what one request with `seed` gets."""
        options = {"num_samples": num_samples, "scaled_radius": scaled_radius, "seed": seed, "top_k": top_k,
                   "top_p": top_p, "temperature": temperature, "beam_size": beam_size}
        out = self._strings_in("samplings", sequences, ["generated"],
                               sampling_inputs(sampling_method=sampling_method, **options))
        return [[item.decode("utf-8") for item in row] for row in out["generated"]]

    # ------------------------------------------------------------------ masked-LM head (N_logits, N_scores)
    def seqs_to_log_probs(self, sequences: Sequences) -> tuple[np.ndarray, np.ndarray]:
        """(log_probs FP32 [batch, length, A], mask BOOL [batch, length]): log-probabilities over the
        residue alphabet (`alphabet()`) at every token position, rows laid out like `seqs_to_hidden`'s.
        A sequence may carry the model's mask character (`_`) at any position."""
        out = self._strings_in("logits", sequences, ["log_probs", "mask"])
        return out["log_probs"], out["mask"]

    def member_log_probs(self, sequences: Sequences) -> tuple[np.ndarray, np.ndarray]:
        """A checkpoint ensemble's (`build repo` with several `--checkpoint`): (each member's
        log_probs FP32 [batch, K, length, A], mask BOOL [batch, length]); `seqs_to_log_probs`
        answers their mean. A repository of one checkpoint has no such output (InferenceError)."""
        out = self._strings_in("logits", sequences, ["member_log_probs", "mask"])
        return out["member_log_probs"], out["mask"]

    def alphabet(self) -> tuple[str, ...]:
        """The residues (tokens) of log_probs' last axis, in order (the N_logits config's `alphabet`
        parameter, a JSON list)."""
        return tuple(json.loads(self._parameter("logits", "alphabet")))

    def default_scoring_method(self) -> str:
        """The method N_scores uses for variants when a request names none (its `default_method`
        parameter: variant-masked for SaProt; wt-marginal for repositories built before it existed)."""
        try:
            return self._parameter("scores", "default_method")
        except KeyError:
            return "wt-marginal"

    def score_variants(self, wild_type: str, variants: Sequences, method: str | None = None,
                       progress: Callable[[int], None] | None = None) -> np.ndarray:
        """FP32 [len(variants)]: each variant's score against `wild_type` (ESM's convention: the sum
        over its mutations of log p(mutant) - log p(wild type) at the position). `variants` are
        written `A42G` or `A42G:L43P`, 1-based residue positions (SaProt: `wild_type` structure-aware,
        `MdEvVp`, or plain residues); `method` is wt-marginal, masked-marginal or variant-masked (None:
        the server's default_method). They go in requests of at most the server's `max_variants` (its config
        parameter; all in one where it states none), several in flight; a bad variant raises
        InferenceError naming it."""
        return self._scores(wild_type, variants, method, progress, ["scores"])["scores"]

    def member_scores(self, wild_type: str, variants: Sequences, method: str | None = None,
                      progress: Callable[[int], None] | None = None) -> np.ndarray:
        """A checkpoint ensemble's: FP32 [K, len(variants)], each member's scores of the variants
        (`score_variants` answers their mean), sent as `score_variants` sends them. A repository of
        one checkpoint has no such output (InferenceError)."""
        return self._scores(wild_type, variants, method, progress, ["member_scores"])["member_scores"]

    def scores_with_members(self, wild_type: str, variants: Sequences, method: str | None = None,
                            progress: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A checkpoint ensemble's (scores FP32 [len(variants)], member_scores FP32 [K, len(variants)])
        from the same requests: what `score_variants` and `member_scores` answer, for the cost of one."""
        out = self._scores(wild_type, variants, method, progress, ["scores", "member_scores"])
        return out["scores"], out["member_scores"]

    def members(self, task: str = "scores") -> int:
        """How many checkpoints the repository serves as one through N_<task> (logits or scores): K
        for a checkpoint ensemble, read from the model's member output ([K, ...]: the task table's
        `member_outputs`); 1 for a repository of one checkpoint, whose model has none."""
        names = {t.name for t in get_task(task).member_outputs}
        for tensor in self.client.model_config(self.model(task)).get("output", []):
            if tensor.get("name") in names:
                return int(tensor["dims"][0])
        return 1

    def _scores(self, wild_type: str, variants: Sequences, method: str | None,
                progress: Callable[[int], None] | None, outputs: list[str]) -> dict[str, np.ndarray]:
        """`outputs` (scores [V], member_scores [K, V]) of the variants, in requests of at most
        the server's max_variants, joined along the variants."""
        items = np.array([str(v).encode("utf-8") for v in variants], dtype=np.object_)
        if not len(items):
            return {name: np.zeros(0 if name == "scores" else (self.members(), 0), dtype=np.float32)
                    for name in outputs}
        try:
            per_request = int(self._parameter("scores", "max_variants"))
        except KeyError:  # a server that states no limit (the dev server): one request
            per_request = len(items)
        chunks = [items[i:i + per_request] for i in range(0, len(items), per_request)]
        sequence = strings_column([wild_type])

        def make_inputs(rows: np.ndarray, index: int) -> dict[str, np.ndarray]:
            inputs = {"sequences": sequence, "variants": chunks[int(rows[0])][None, :]}
            if method is not None:
                inputs["method"] = strings_column([method])
            return inputs

        left = [len(items)]

        def advance(requests: int) -> None:  # requests answered -> variants scored (the last may be short)
            for _ in range(requests):
                step = min(per_request, left[0])
                left[0] -= step
                if progress is not None:
                    progress(step)

        out = infer_rows(self.client, self.model("scores"), len(chunks), make_inputs, outputs=outputs,
                         batch_size=1, in_flight=self.in_flight, progress=advance).outputs
        return {name: np.concatenate([row[..., :len(chunk)] for row, chunk in zip(out[name], chunks)],
                                     axis=-1).astype(np.float32) for name in outputs}

    def pseudo_log_likelihood(self, sequences: Sequences) -> np.ndarray:
        """FP32 [batch]: each sequence's pseudo-log-likelihood, the MEAN over its residues of log p(the
        residue) with that residue masked (AntiBERTy's pseudo_log_likelihood)."""
        method = lambda rows, _: {"method": np.full((len(rows), 1), b"pll", dtype=np.object_)}  # noqa: E731
        return self._strings_in("scores", sequences, ["scores"], method)["scores"].reshape(-1).astype(np.float32)

    # ------------------------------------------------------------------ fine-tuned head (N_predictions)
    def predict(self, sequences: Sequences) -> dict[str, Any]:
        """The fine-tuned head's answers: {"logits": FP32 [batch, C] (token heads [batch, length, C]),
        "label": the predicted label names, one str per sequence (token heads: a list per sequence,
        one per token row), and for token heads "mask": BOOL [batch, length]}."""
        per_token = self._parameter("predictions", "per_token") == "true"
        outputs = ["logits", "label"] + (["mask"] if per_token else [])
        out = self._strings_in("predictions", sequences, outputs)
        labels = [[item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in row]
                  for row in out["label"]]
        result = {"logits": out["logits"], "label": labels if per_token else [row[0] for row in labels]}
        if per_token:
            result["mask"] = out["mask"]
        return result

    def labels(self) -> tuple[str, ...]:
        """The fine-tuned head's label names, in logits' order (N_predictions' `labels` parameter)."""
        return tuple(json.loads(self._parameter("predictions", "labels")))

    def predict_contacts(self, sequences: Sequences) -> list[np.ndarray]:
        """One FP32 [L_i, L_i] array per sequence: the probability that residues i and j are in
        contact (ESM's contact head, transformers' `predict_contacts`), symmetric. A sequence
        over the server's limit (N_contacts' `max_residues` parameter) raises InferenceError
        naming its length and the limit."""
        out = self._strings_in("contacts", sequences, ["contacts", "mask"])
        return [contact_map(out, row) for row in range(len(out["mask"]))]

    # ------------------------------------------------------------------------------ layers (N_layers)
    def layer_embeddings(self, sequences: Sequences, layers: Sequence[int] = (-1,),
                         include: Sequence[str] = ("mean",)) -> dict[str, np.ndarray]:
        """States of any layers (ESM's numbering: 0 the embedding layer's output, 1..N the blocks, -1
        the last), pooled as `include` asks (mean, bos, max; per_tok: every token's state): {"embeddings"
        (mean), "embeddings_bos", "embeddings_max": FP32 [batch, len(layers), H]; per_tok: "hiddens"
        FP32 [batch, len(layers), length, H] and "mask" BOOL [batch, length]}, the included ones only.
        A layer out of range, an unknown choice or bos of a model without a BOS token raises
        InferenceError naming the value and what is allowed."""
        layer_values = np.array([int(layer) for layer in layers], dtype=np.int32)
        choices = [str(choice) for choice in include]
        unknown = [c for c in choices if c not in LAYER_INCLUDE]
        if unknown or not choices or not len(layer_values):
            raise InvalidInputError(f"include {', '.join(choices) or '(none)'} with layers "
                                    f"{layer_values.tolist()}: name at least one layer, and include among "
                                    f"{', '.join(LAYER_INCLUDE)}")
        outputs = [name for choice, name in LAYER_OUTPUTS.items() if choice in choices]
        outputs += ["hiddens", "mask"] if "per_tok" in choices else []
        encoded = np.array([c.encode("utf-8") for c in choices], dtype=np.object_)

        def extra(rows: np.ndarray, _: int) -> dict[str, np.ndarray]:
            return {"layers": np.tile(layer_values, (len(rows), 1)), "include": np.tile(encoded, (len(rows), 1))}

        return self._strings_in("layers", sequences, outputs, extra)

    # ------------------------------------------------------------------------------ attentions (N_attentions)
    def attention_maps(self, sequences: Sequences, layers: Sequence[int] = (-1,),
                       heads: Sequence[int] | None = None) -> dict[str, np.ndarray]:
        """Attention probabilities of the blocks `layers` (1..N, -1 the last; transformers'
        `output_attentions`, block i's at index i-1) and `heads` (0..heads-1; None: every head):
        {"attentions": FP32 [batch, len(layers), heads, T, T], query rows and key columns laid out as
        the tokens of seqs_to_hidden (BOS and EOS included, 0 past each sequence's own tokens),
        "mask": BOOL [batch, T] True on the residues}. A block or head out of range, or an answer
        over the server's `max_attention_values` parameter, raises InferenceError naming the value
        and the limit."""
        layer_values = np.array([int(layer) for layer in layers], dtype=np.int32)
        head_values = None if heads is None else np.array([int(head) for head in heads], dtype=np.int32)
        if not len(layer_values) or (head_values is not None and not len(head_values)):
            raise InvalidInputError(f"layers {layer_values.tolist()}, heads "
                                    f"{None if head_values is None else head_values.tolist()}: name at least one "
                                    "block, and at least one head (or heads=None for every head)")

        def extra(rows: np.ndarray, _: int) -> dict[str, np.ndarray]:
            options = {"layers": np.tile(layer_values, (len(rows), 1))}
            if head_values is not None:
                options["heads"] = np.tile(head_values, (len(rows), 1))
            return options

        return self._strings_in("attentions", sequences, ["attentions", "mask"], extra)

    # ------------------------------------------------------------------------------ any task
    def ask(self, task: str, sequences: Sequences) -> dict[str, np.ndarray]:
        """Any task whose one required input is `sequences` (its optional inputs left out): every
        output its entry declares (tasks.py), by name, rows in the order of `sequences`. The methods
        above, which a task entry's `client_method` names, shape the answers further."""
        entry = get_task(task)
        if [t.name for t in entry.required_inputs] != ["sequences"]:
            raise InvalidInputError(f"task {task!r} takes {', '.join(t.name for t in entry.required_inputs)}, not "
                                    f"sequences alone: call RepositoryClient.{entry.client_method or 'ask'}")
        return self._strings_in(task, sequences, [t.name for t in entry.outputs])

    # MegaMolBART's older gRPC wrapper called them this.
    smis_to_embedding = seqs_to_embedding
    smis_to_hidden = seqs_to_hidden
    hidden_to_smis = hidden_to_seqs

    # ---------------------------------------------------------------------------- plumbing
    def model(self, task: str) -> str:
        """The served name of a task's public model."""
        return f"{self.name}_{task}"

    def _parameter(self, task: str, key: str) -> str:
        """A `parameters` value of the task's public model's config; KeyError naming it when absent."""
        config = self.client.model_config(self.model(task))
        value = (config.get("parameters") or {}).get(key, {}).get("string_value")
        if value is None:
            raise KeyError(f"{self.model(task)}'s config has no {key!r} parameter: rebuild the repository with "
                           "this version of bionemo-export")
        return value

    def _strings_in(self, task: str, sequences: Sequences, outputs: list[str],
                    extra=None) -> dict[str, np.ndarray]:
        items = strings_column(sequences)
        if not len(items):
            return self._empty(task, outputs)
        # Sent shortest first, so that a request's rows share the server's length buckets; but a
        # seeded sampling's answer depends on which rows share a request, and in what order.
        order = None if task == "samplings" else np.argsort([len(item) for item in items[:, 0]], kind="stable")
        return self._run(task, len(items), lambda rows, index: {"sequences": items[rows],
                                                                **(extra(rows, index) if extra else {})}, outputs,
                         order=order)

    def _run(self, task: str, count: int, make_inputs, outputs: list[str],
             order: np.ndarray | None = None) -> dict[str, np.ndarray]:
        return infer_rows(self.client, self.model(task), count, make_inputs, outputs=outputs,
                          batch_size=self.batch_size, in_flight=self.in_flight, order=order).outputs

    def _empty(self, task: str, outputs: list[str]) -> dict[str, np.ndarray]:
        """Answers for zero inputs, shaped from the model's configuration (no request sent)."""
        declared = {tensor["name"]: tensor for tensor in self.client.model_config(self.model(task)).get("output", [])}
        empty = {}
        for name in outputs:
            dims = [max(int(d), 0) for d in declared[name].get("dims", [])]
            empty[name] = np.zeros((0, *dims), dtype=DType.of(declared[name].get("data_type", "FP32")).numpy)
        return empty

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> RepositoryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sampling_inputs(*, sampling_method: str | None = None, **options: Any):
    """The optional N_samplings inputs for the options that are set, as a `make_inputs` extra:
    (rows, request index) -> {name: [rows, 1] array}. A seed becomes seed + request index."""
    unknown = set(options) - set(SAMPLING_INPUTS)
    if unknown:
        raise TypeError(f"unknown sampling options {sorted(unknown)}; valid: {', '.join(SAMPLING_INPUTS)}")
    chosen = {name: value for name, value in options.items() if value is not None}

    def extra(rows: np.ndarray, index: int) -> dict[str, np.ndarray]:
        inputs = {name: np.full((len(rows), 1), value + index if name == "seed" else value,
                                dtype=SAMPLING_INPUTS[name]) for name, value in chosen.items()}
        if sampling_method is not None:
            inputs["sampling_method"] = np.full((len(rows), 1), sampling_method.encode("utf-8"), dtype=np.object_)
        return inputs

    return extra


def contact_map(answer: Mapping[str, np.ndarray], row: int) -> np.ndarray:
    """Row `row`'s own FP32 [L, L] map of an N_contacts answer (`contacts` [rows, L_max, L_max]
    padded with 0, `mask` [rows, L_max] True on its L residues)."""
    residues = int(np.asarray(answer["mask"][row]).sum())
    return np.ascontiguousarray(answer["contacts"][row, :residues, :residues], dtype=np.float32)


def masked_mean(hiddens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Client-side pooling, as BioNeMo's notebooks do it: mean over the positions where mask is True."""
    weights = mask.astype(hiddens.dtype)[..., None]
    return (hiddens * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1.0)


EncoderClient = RepositoryClient
"""The earlier name for the encoder models' client: the same class."""
Seq2SeqClient = RepositoryClient
"""The earlier name for the encoder-decoder models' client: the same class."""
