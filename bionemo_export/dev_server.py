"""BioNeMo's way of serving, kept as a development mode and as the baseline every speed claim is
measured against: a PyTriton process whose inference callables run the PyTorch model in Python.

`bionemo-export dev-server --model FAMILY --checkpoint PATH --name N` binds the same public
models, with the same tensors, as a repository built from that checkpoint with `--name N`
(the task table, tasks.py): `N_embeddings` and `N_hiddens`; for encoder-decoder families
`N_decodes` and `N_samplings`; with a masked-LM head `N_logits` and `N_scores` (checked, planned
and scored by the repository's own serving/scores.py and scoring.py); with a fine-tuned head `N_predictions`
(labels named by serving/labels.py); with ESM's contact head `N_contacts` (serving/contacts.py's checks and
batching over the PyTorch head); `N_layers` (serving/layers.py's choices and pooling over the PyTorch
encoder's every layer); `N_attentions` for transformers encoders (serving/attentions.py's choices and
limit over the eager twin's probabilities). With `--checkpoint` once per member, a checkpoint ensemble
as `build repo` makes one (models/members.py checks the members alike): `N_logits` and `N_scores`
only, the mean of the members' log-probabilities (serving/member_mean.py's, as the repository's
N_member_mean) and the scores of that mean, with each member's as `member_log_probs` and
`member_scores`. Any client can be pointed at either and gets the same answers (the
encoder within the family's tolerance, decodes and seeded samples equal), because both use the
package's tokenizers and its one decoding and sampling implementation (generation/search.py with
SAMPLING_DEFAULTS and the repository's GenerationLimits); only the graph runner differs (PyTorch
here, ONNX Runtime in the repository).

As BioNeMo's servers: max_batch_size 10 (by default) with dynamic batching and no queue delay.
Unlike them: decodes and samplings are bound only for families that decode, every request's
hidden states are cropped to its own longest sequence, and sampling takes every option the
repository's N_samplings takes, parsed by the repository's own module (serving/request_options.py),
so a bad option gets the same message from both. Limits of the mode (PyTriton 0.7): an error comes back with a
traceback around its message, and fails every request the batcher handed over with it.

PyTriton 0.7 protects Triton's statistics endpoint with a token, which perf_analyzer over gRPC
cannot pass (docs/reference/platform.md): the endpoints are left unprotected, as tritonserver's own are.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bionemo_export.errors import InvalidInputError
from bionemo_export.generation.reference import TorchDecoder, encode_hiddens
from bionemo_export.generation.search import LIMITS, generate, greedy
from bionemo_export.model_repository.options import GenerationLimits, ServingOptions
from bionemo_export.models.base import LoadedModel, load_checkpoint
from bionemo_export.models.members import ENSEMBLE_TASKS, MemberFacts, check_members
from bionemo_export.serving.attentions import AttentionWeights
from bionemo_export.serving.batching import stack_padded
from bionemo_export.serving.contacts import ContactMaps
from bionemo_export.serving.labels import label_names
from bionemo_export.serving.layers import DEFAULT_TOKEN_BUDGET, LayerEmbeddings, has_bos_token
from bionemo_export.serving.member_mean import mean_log_probs
from bionemo_export.serving.request_options import OPTIONS, parse_options
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.row_calls import DEFAULT_PAIR_BUDGET, RowModel
from bionemo_export.serving.scores import INPUTS as SCORES_INPUTS
from bionemo_export.serving.scores import VariantScorer
from bionemo_export.serving.scoring import ScoringLimits
from bionemo_export.tasks import DEFAULT_MAX_ATTENTION_VALUES, TASKS
from bionemo_export.tensors import DType

MAX_BATCH_SIZE = 10
"""BioNeMo's servers' max_batch_size."""


Requests = Sequence[Mapping[str, np.ndarray]]
"""What PyTriton hands an inference callable: one mapping of input name -> array per request."""


@dataclass(frozen=True)
class Binding:
    """One Triton model of the dev server: its name, callable and tensors (PyTriton's terms)."""

    name: str
    infer: Callable[[Requests], list[dict[str, np.ndarray]]]
    inputs: list[tuple[str, Any, tuple[int, ...], bool]]
    """(name, dtype, shape without the batch axis, optional)."""
    outputs: list[tuple[str, Any, tuple[int, ...]]]


def _answer_rows(model: RowModel, requests: Requests) -> list[dict[str, np.ndarray]]:
    """A repository row model's (serving/row_calls.py) answers to a PyTriton batch: its inputs as
    the requests hold them (PyTriton's Request is no Mapping: an optional input left out is absent).
    PyTriton fails the whole batch with one error, so the first failure is raised."""
    answers, failures = model.answer([{name: np.asarray(request[name]) for name in model.inputs if name in request}
                                      for request in requests])
    if failures:
        raise next(iter(failures.values()))
    return [answers[i] for i in range(len(requests))]


@dataclass
class DevModels:
    """The inference callables of the public models over one loaded checkpoint (PyTorch, fp32).

    Each takes a list of requests (what PyTriton hands over together) and answers one dict per
    request. They are plain functions of numpy arrays, usable without a server."""

    loaded: LoadedModel
    max_decode_length: int | None = None
    """Most tokens per decode (default: the model's own limit), as a repository's --max-decode-length."""
    limits: GenerationLimits = field(default_factory=GenerationLimits)
    members: tuple[LoadedModel, ...] = ()
    """A checkpoint ensemble's members in the build's order, `loaded` the first (verify.py's
    convention): N_logits and N_scores answer their mean, and each member's on request, as a
    repository built with `checkpoint` once per member does. Empty: `loaded` alone."""

    def __post_init__(self) -> None:
        if self.members:
            if self.members[0] is not self.loaded:
                raise ValueError("`members` starts with `loaded`, the ensemble's first member")
            check_members([MemberFacts.of(member) for member in self.members])  # MemberMismatch naming one
        for model in self.members or (self.loaded,):
            model.encoder.eval()
        seq2seq = self.loaded.seq2seq
        if seq2seq is not None:
            limit = seq2seq.max_decode_length
            if self.max_decode_length is not None and not 1 <= self.max_decode_length <= limit:
                raise InvalidInputError(f"`max_decode_length` must be between 1 and the model's {limit}, "
                                        f"got {self.max_decode_length}")
            self.max_decode_length = self.max_decode_length or limit
            self._decoding_tokenizer = self.loaded.decoding()[1]
            self._decoder = TorchDecoder(seq2seq)
            self._ids = dict(begin_id=seq2seq.begin_id, end_id=seq2seq.end_id, max_length=self.max_decode_length)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The public models this checkpoint serves, as a repository built from it would: each task
        whose entry's requirements the checkpoint carries (tasks.py `Task.requires`); an ensemble's,
        those of them it serves (models/members.py `ENSEMBLE_TASKS`). Each is bound to the method
        named after it."""
        servable = self.loaded.servable()
        return tuple(task for task in servable if task in ENSEMBLE_TASKS) if self.members else servable

    # ---------------------------------------------------------------------------- encoder
    def embeddings(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        return [{"embeddings": embeddings} for _, embeddings, _ in self._encode(requests)]

    def hiddens(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        return [{"hiddens": hiddens, "mask": mask} for hiddens, _, mask in self._encode(requests)]

    def logits(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """The masked-LM head's log-probabilities over the alphabet, rows laid out like hiddens; an
        ensemble's: the mean of its members' (serving/member_mean.py, as N_member_mean computes it)
        and each member's as `member_log_probs` [K, length, A]."""
        answers = []
        for each, mask in self._log_probs(requests):
            if self.members:
                mean, stacked = mean_log_probs(each)
                answers.append({"log_probs": mean, "mask": mask, "member_log_probs": stacked})
            else:
                answers.append({"log_probs": each[0], "mask": mask})
        return answers

    def scores(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """Variant scores or PLLs by the repository's own N_scores (serving/scores.py's VariantScorer:
        the same checks, plans, messages and calls of a repository's max_batch_size copies), each
        call's log-probabilities from the PyTorch encoder and head; an ensemble's: the scores of
        the members' mean and each member's as `member_scores` [K, V]."""
        mask_char = self.loaded.tokenizer.mask_char
        if mask_char is None:  # serves_scores: no scores model is bound then
            raise InvalidInputError(f"{self.loaded.checkpoint}: its tokenizer has no mask character, so it scores "
                                    "no variants")
        scorer = VariantScorer(self._run_logits, alphabet=self.loaded.alphabet, mask_char=mask_char,
                               limits=ScoringLimits(), chunk=ServingOptions().max_batch_size,
                               responder=Responder("scores"), default_method=self.loaded.family.scoring_default,
                               structure_aware=getattr(self.loaded.tokenizer, "structure_aware", False),
                               run_members=self._run_members if self.members else None, members=len(self.members))
        answers = []
        for request in requests:
            # PyTriton's Request is no Mapping (no .get); an optional input left out is absent.
            inputs = {name: np.asarray(request[name]) for name in SCORES_INPUTS if name in request}
            scores, each = scorer.answer_inputs(inputs, with_members=bool(self.members))
            answers.append({"scores": scores} if each is None else {"scores": scores, "member_scores": each})
        return answers

    def _log_probs(self, requests: Requests) -> list[tuple[list[np.ndarray], np.ndarray]]:
        """Per request: the log-probabilities [rows, length, A] of each model (the checkpoint, or
        every member in order, all on the same tokens) and the mask."""
        models = self.members or (self.loaded,)
        encoded = [self._encode(requests, model) for model in models]
        return [([self._head(self._lm_head(model), answers[index][0]) for model, answers in zip(models, encoded)],
                 encoded[0][index][2]) for index in range(len(requests))]

    def _run_logits(self, sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """N_logits for the scorer: (log_probs, mask) of `sequences` (an ensemble's: the mean)."""
        each, mask = self._sequence_log_probs(sequences)
        return (mean_log_probs(each)[0] if self.members else each[0]), mask

    def _run_members(self, sequences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An ensemble's N_logits for the scorer: (the mean log_probs, mask, member_log_probs)."""
        each, mask = self._sequence_log_probs(sequences)
        mean, stacked = mean_log_probs(each)
        return mean, mask, stacked

    def _sequence_log_probs(self, sequences: list[str]) -> tuple[list[np.ndarray], np.ndarray]:
        """`_log_probs` of `sequences` as one request."""
        column = np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_)
        return self._log_probs([{"sequences": column}])[0]

    def predictions(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """The fine-tuned head's logits and labels (serving/labels.py names them, as N_labels does)."""
        head = self.loaded.classifier
        if head is None:  # no predictions model is bound then
            raise InvalidInputError(f"{self.loaded.checkpoint} has no fine-tuned head, so it serves no predictions")
        answers = []
        for hiddens, _, mask in self._encode(requests):
            logits = self._head(head, hiddens)
            answer = {"logits": logits, "label": label_names(logits, head.labels, head.problem_type)}
            if head.per_token:
                answer["mask"] = mask
            answers.append(answer)
        return answers

    def contacts(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """Contact maps from the PyTorch contact head, tokenized, checked and batched by the
        repository's own module (serving/contacts.py: the same limit and messages)."""
        head = self.loaded.contacts
        if head is None:  # no contacts model is bound then
            raise InvalidInputError(f"{self.loaded.checkpoint} has no contact head, so it serves no contacts")

        def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
            with torch.inference_mode():
                return head(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)).numpy()

        tokenizer = self.loaded.tokenizer
        limit = getattr(tokenizer, "max_residues", tokenizer.max_length - 2)
        return _answer_rows(ContactMaps(tokenizer, run, max_residues=limit, pair_budget=DEFAULT_PAIR_BUDGET,
                                        max_rows=MAX_BATCH_SIZE, responder=Responder("contacts")), requests)

    def layers(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """Any layers' states and poolings from the PyTorch encoder (every layer's states, as
        transformers' output_hidden_states), the choices checked, batched and pooled by the
        repository's own module (serving/layers.py: the same messages)."""
        states = self.loaded.layer_states

        def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers) -> list[np.ndarray]:
            with torch.inference_mode():
                every = states(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
            return [every[layer].numpy() for layer in layers]

        tokenizer = self.loaded.tokenizer
        has_bos = has_bos_token(tokenizer, self.loaded.family.sample_sequences()[0])
        return _answer_rows(LayerEmbeddings(tokenizer, run, num_layers=self.loaded.num_layers, has_bos=has_bos,
                                            token_budget=DEFAULT_TOKEN_BUDGET, max_rows=MAX_BATCH_SIZE,
                                            responder=Responder("layers")), requests)

    def attentions(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """Chosen blocks' and heads' attention probabilities from the PyTorch encoder's eager twin
        (transformers' output_attentions), the choices and the size limit checked, batched and
        assembled by the repository's own module (serving/attentions.py: the same messages)."""
        maps = self._attention_maps

        def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers) -> list[np.ndarray]:
            with torch.inference_mode():
                every = maps(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
            return [every[layer - 1].numpy() for layer in layers]

        return _answer_rows(AttentionWeights(self.loaded.tokenizer, run, num_layers=self.loaded.num_layers,
                                             num_heads=self.loaded.num_heads, max_values=DEFAULT_MAX_ATTENTION_VALUES,
                                             pair_budget=DEFAULT_PAIR_BUDGET, max_rows=MAX_BATCH_SIZE,
                                             responder=Responder("attentions")), requests)

    @functools.cached_property
    def _attention_maps(self) -> torch.nn.Module:
        """The encoder's eager twin answering every block's probabilities, made once (it rebinds
        every weight of the encoder into a second module tree)."""
        return self.loaded.attention_maps

    @staticmethod
    def _lm_head(loaded: LoadedModel) -> torch.nn.Module:
        """The masked-LM head (logits and scores are bound only where the checkpoint has one)."""
        if loaded.lm_head is None:
            raise InvalidInputError(f"{loaded.checkpoint} has no masked-LM head, so it serves no logits or scores")
        return loaded.lm_head

    @staticmethod
    def _head(head: torch.nn.Module, hiddens: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return head(torch.from_numpy(np.ascontiguousarray(hiddens))).numpy()

    def _encode(self, requests: Requests, loaded: LoadedModel | None = None
                ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(hiddens, embeddings, mask) per request from one call of `loaded`'s encoder (default:
        the checkpoint's; an ensemble's member's) over all their rows; each request's hiddens
        cropped to its own longest sequence, zero on padding."""
        loaded = loaded or self.loaded
        tokenizer = loaded.tokenizer
        # Tokenized per request, so that an error names the row of its own request.
        encoded = [tokenizer.encode(_column(request, "sequences")) for request in requests]
        arrays = [stack_padded([getattr(e, name) for e in encoded], pad)
                  for name, pad in (("input_ids", tokenizer.pad_id), ("attention_mask", 0), ("residue_mask", False))]
        with torch.inference_mode():
            hiddens, embeddings = loaded.encoder(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
        hiddens = (hiddens * torch.from_numpy(arrays[1])[..., None]).numpy()
        answers, start = [], 0
        for e in encoded:
            rows, length = e.input_ids.shape
            answers.append((hiddens[start:start + rows, :length], embeddings[start:start + rows].numpy(),
                            e.residue_mask))
            start += rows
        return answers

    # --------------------------------------------------------------------------- decoding
    def decodes(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """Greedy decoding of each request's hidden states (search.greedy over the PyTorch decoder)."""
        answers = []
        for request in requests:
            hiddens, mask = request["hiddens"], request["mask"]
            ids = greedy(self._decoder, np.asarray(hiddens, dtype=np.float32), np.asarray(mask), **self._ids)
            answers.append({"sequences": self._strings([[row] for row in ids])})
        return answers

    def samplings(self, requests: Requests) -> list[dict[str, np.ndarray]]:
        """search.generate for each request alone, with its own options (SAMPLING_DEFAULTS for
        those it leaves out) and its own seeded generator: a seeded request gets the same samples
        whatever it is batched with, as from a repository's N_samplings."""
        answers = []
        for request in requests:
            sequences = _column(request, "sequences")
            options = self._options(request, len(sequences))
            rng = np.random.default_rng(options.pop("seed"))
            method = options.pop("sampling_method")
            hiddens, mask = encode_hiddens(self.loaded, sequences)
            ids = generate(self._decoder, hiddens, mask, method=method, rng=rng, **self._ids, **options)
            answers.append({"generated": self._strings(ids)})
        return answers

    def _options(self, request: Mapping[str, np.ndarray], rows: int) -> dict[str, Any]:
        """The request's sampling options (one value per request), checked against their ranges
        and the limits before any work: by the repository's own parser (serving/request_options.py),
        so either server words a bad option the same way."""
        # PyTriton's Request is no Mapping (no .get); an optional input left out is absent.
        return parse_options({name: request[name] for name in OPTIONS if name in request}, rows,
                             {name: getattr(self.limits, name) for name in LIMITS})

    def _strings(self, ids: list[list[list[int]]]) -> np.ndarray:
        """Token ids [batch][outputs] -> BYTES [batch, outputs]."""
        decode = self._decoding_tokenizer.decode
        return np.array([[decode(sample).encode("utf-8") for sample in row] for row in ids], dtype=np.object_)

    # --------------------------------------------------------------------------- bindings
    def bindings(self, name: str) -> list[Binding]:
        """The public models of this checkpoint under the name prefix `name`, with the tensors the
        task table (tasks.py) declares: a repository's public models, one for one."""
        loaded = self.loaded
        sizes = {"H": loaded.hidden_size, "A": len(loaded.alphabet), "K": len(self.members)}
        classifier = getattr(loaded, "classifier", None)
        if classifier is not None:
            sizes["C"] = classifier.num_labels
        bindings = []
        for task in (TASKS[t] for t in self.tasks):
            outputs = [(t.name, _dtype(t.dtype), t.shape(sizes))
                       for t in (*task.outputs, *(task.member_tensors(sizes) if self.members else ()))]
            # A per-token head's rows are laid out like hiddens.
            if task.name == "predictions" and classifier is not None and classifier.per_token:
                outputs = [("logits", np.float32, (-1, sizes["C"])), ("mask", np.bool_, (-1,)),
                           ("label", bytes, (-1,))]
            bindings.append(Binding(task.model(name), getattr(self, task.name),
                                    [(t.name, _dtype(t.dtype), t.shape(sizes), t.optional) for t in task.inputs],
                                    outputs))
        return bindings


def load_models(checkpoints: Sequence[Path], family: str | None = None, *,
                progress: Callable[[str], None] = lambda message: None, **options: Any) -> DevModels:
    """DevModels over `checkpoints`: one checkpoint, or a checkpoint ensemble's members in the
    build's order (several, as `build repo` takes them), each loaded in turn and checked against
    those before it (models/members.py: a member that differs, or one given twice, is refused
    naming it before the next is loaded). `options`: DevModels' (max_decode_length, limits)."""
    if not checkpoints:
        raise InvalidInputError("give `checkpoint` once (or once per member of an ensemble)")
    loaded: list[LoadedModel] = []
    for number, path in enumerate(checkpoints, 1):
        member = f" (ensemble member {number} of {len(checkpoints)})" if len(checkpoints) > 1 else ""
        progress(f"loading {path}{member} ...")
        loaded.append(load_checkpoint(path, family))
        if len(loaded) > 1:
            check_members([MemberFacts.of(model) for model in loaded])
    return DevModels(loaded[0], members=tuple(loaded) if len(loaded) > 1 else (), **options)


def _dtype(dtype: DType) -> Any:
    """PyTriton's type for a task-table dtype (bytes for BYTES)."""
    return bytes if dtype is DType.BYTES else dtype.numpy


def _column(request: Mapping[str, np.ndarray], name: str) -> list[bytes]:
    """A BYTES input [batch, 1] as a list of bytes (the tokenizers decode UTF-8 and name bad rows)."""
    return [item if isinstance(item, bytes) else str(item).encode("utf-8") for item in
            np.asarray(request[name]).reshape(-1).tolist()]


# ------------------------------------------------------------------------------------ server
@dataclass(frozen=True)
class Ports:
    host: str = "127.0.0.1"
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def serve(models: DevModels, name: str, ports: Ports = Ports(), *, max_batch_size: int = MAX_BATCH_SIZE,
          on_ready: Callable[[list[str]], None] | None = None, stop: threading.Event | None = None) -> None:
    """Serve `models` under the prefix `name` with PyTriton until SIGINT/SIGTERM (or `stop` is
    set); `on_ready(model names)` is called once every model answers."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

    from bionemo_export.runtime.discovery import _python_stub_env

    if max_batch_size < 1:
        raise InvalidInputError(f"max_batch_size must be at least 1, got {max_batch_size}")
    # PyTriton starts its tritonserver from this process: give its Python stubs this interpreter's
    # environment and libpython (docs/reference/platform.md), as the project's own server runner does.
    for key, value in _python_stub_env().items():
        os.environ[key] = value + (os.pathsep + os.environ[key] if os.environ.get(key) else "")
    # pytriton's @kwonly_dataclass hides TritonConfig's dataclass fields from type checkers.
    config = TritonConfig(http_address=ports.host, http_port=ports.http,  # pyright: ignore[reportCallIssue]
                          grpc_address=ports.host, grpc_port=ports.grpc,  # pyright: ignore[reportCallIssue]
                          metrics_port=ports.metrics)  # pyright: ignore[reportCallIssue]
    stopping = stop or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():  # only the main thread may set handlers
        # Our own handlers whatever we inherited: a script's `dev-server &` starts us with SIGINT ignored.
        previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
            batching = ModelConfig(max_batch_size=max_batch_size, batcher=DynamicBatcher())
            bindings = models.bindings(name)
            for binding in bindings:
                triton.bind(model_name=binding.name, infer_func=binding.infer, config=batching,
                            inputs=[Tensor(name=n, dtype=d, shape=s, optional=o) for n, d, s, o in binding.inputs],
                            outputs=[Tensor(name=n, dtype=d, shape=s) for n, d, s in binding.outputs])
            triton.run()
            if on_ready is not None:
                on_ready([binding.name for binding in bindings])
            stopping.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

