"""The dev server's PyTorch side: one loaded checkpoint and the runs its tasks' answers share.

Each task's kit answers its dev-server model (`TaskKit.answer(dev, task, requests)`) from a
`DevAnswers`; dev_server.py binds those answers to PyTriton models. Every answer runs the
repository's own served modules (serving/: tokenizing, checks, batching, scoring, the messages)
over PyTorch instead of ONNX Runtime, so both servers answer and refuse alike.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bionemo_export.errors import InvalidInputError
from bionemo_export.generation.reference import TorchDecoder
from bionemo_export.model_repository.options import GenerationLimits
from bionemo_export.models import LoadedModel
from bionemo_export.models.members import MemberFacts, check_members
from bionemo_export.serving.batching import stack_padded
from bionemo_export.serving.member_mean import mean_log_probs
from bionemo_export.serving.request_options import OPTIONS, parse_options
from bionemo_export.serving.row_calls import RowModel
from bionemo_export.serving.search import LIMITS


def answer_rows(model: RowModel, requests: Requests) -> list[dict[str, np.ndarray]]:
    """A repository row model's (serving/row_calls.py) answers to a PyTriton batch: its inputs as
    the requests hold them (PyTriton's Request is no Mapping: an optional input left out is absent).
    PyTriton fails the whole batch with one error, so the first failure is raised."""
    answers, failures = model.answer([{name: np.asarray(request[name]) for name in model.inputs if name in request}
                                      for request in requests])
    if failures:
        raise next(iter(failures.values()))
    return [answers[i] for i in range(len(requests))]


def column(request: Mapping[str, np.ndarray], name: str) -> list[bytes]:
    """A BYTES input [batch, 1] as a list of bytes (the tokenizers decode UTF-8 and name bad rows)."""
    return [item if isinstance(item, bytes) else str(item).encode("utf-8") for item in
            np.asarray(request[name]).reshape(-1).tolist()]


MAX_BATCH_SIZE = 10
"""BioNeMo's servers' max_batch_size."""


Requests = Sequence[Mapping[str, np.ndarray]]
"""What PyTriton hands an inference callable: one mapping of input name -> array per request."""


@dataclass
class DevAnswers:
    """What the kits' dev-server answers share (`TaskKit.answer`): the loaded checkpoint (or a
    checkpoint ensemble's members), the decoding limits, and the PyTorch runs several tasks make
    (the encoder over a batch of requests, the masked-LM head, the decoder)."""

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
            self.decoding_tokenizer = self.loaded.decoding()[1]
            self.decoder = TorchDecoder(seq2seq)
            self.decode_ids = dict(begin_id=seq2seq.begin_id, end_id=seq2seq.end_id, max_length=self.max_decode_length)

    def log_probs(self, requests: Requests) -> list[tuple[list[np.ndarray], np.ndarray]]:
        """Per request: the log-probabilities [rows, length, A] of each model (the checkpoint, or
        every member in order, all on the same tokens) and the mask."""
        models = self.members or (self.loaded,)
        encoded = [self.encode(requests, model) for model in models]
        return [([self.run_head(self.lm_head(model), answers[index][0]) for model, answers in zip(models, encoded)],
                 encoded[0][index][2]) for index in range(len(requests))]

    def run_logits(self, sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """N_logits for the scorer: (log_probs, mask) of `sequences` (an ensemble's: the mean)."""
        each, mask = self.sequence_log_probs(sequences)
        return (mean_log_probs(each)[0] if self.members else each[0]), mask

    def run_members(self, sequences: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """An ensemble's N_logits for the scorer: (the mean log_probs, mask, member_log_probs)."""
        each, mask = self.sequence_log_probs(sequences)
        mean, stacked = mean_log_probs(each)
        return mean, mask, stacked

    def sequence_log_probs(self, sequences: list[str]) -> tuple[list[np.ndarray], np.ndarray]:
        """`_log_probs` of `sequences` as one request."""
        column = np.array([[s.encode("utf-8")] for s in sequences], dtype=np.object_)
        return self.log_probs([{"sequences": column}])[0]

    @functools.cached_property
    def attention_maps(self) -> torch.nn.Module:
        """The encoder's eager twin answering every block's probabilities, made once (it rebinds
        every weight of the encoder into a second module tree)."""
        return self.loaded.attention_maps

    @staticmethod
    def lm_head(loaded: LoadedModel) -> torch.nn.Module:
        """The masked-LM head (logits and scores are bound only where the checkpoint has one)."""
        if loaded.lm_head is None:
            raise InvalidInputError(f"{loaded.checkpoint} has no masked-LM head, so it serves no logits or scores")
        return loaded.lm_head

    @staticmethod
    def run_head(head: torch.nn.Module, hiddens: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return head(torch.from_numpy(np.ascontiguousarray(hiddens))).numpy()

    def encode(self, requests: Requests, loaded: LoadedModel | None = None
                ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(hiddens, embeddings, mask) per request from one call of `loaded`'s encoder (default:
        the checkpoint's; an ensemble's member's) over all their rows; each request's hiddens
        cropped to its own longest sequence, zero on padding."""
        loaded = loaded or self.loaded
        tokenizer = loaded.tokenizer
        # Tokenized per request, so that an error names the row of its own request.
        encoded = [tokenizer.encode(column(request, "sequences")) for request in requests]
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

    def sampling_options(self, request: Mapping[str, np.ndarray], rows: int) -> dict[str, Any]:
        """The request's sampling options (one value per request), checked against their ranges
        and the limits before any work: by the repository's own parser (serving/request_options.py),
        so either server words a bad option the same way."""
        # PyTriton's Request is no Mapping (no .get); an optional input left out is absent.
        return parse_options({name: request[name] for name in OPTIONS if name in request}, rows,
                             {name: getattr(self.limits, name) for name in LIMITS})

    def strings(self, ids: list[list[list[int]]]) -> np.ndarray:
        """Token ids [batch][outputs] -> BYTES [batch, outputs]."""
        decode = self.decoding_tokenizer.decode
        return np.array([[decode(sample).encode("utf-8") for sample in row] for row in ids], dtype=np.object_)
