"""N_encoder run by the Python backend: requests' token rows (or sequences, tokenized here in the
fused layout) -> hiddens and embeddings from the exported encoder graph.

The dynamic batcher hands over requests of any lengths together. Their rows are joined, sorted by
length, padded to a multiple of `length_bucket` tokens and split into sub-batches of at most
`token_budget` tokens (and `max_sub_batch` rows), each one graph call (batching.py). Every request
gets back its own rows at its own length: the attention mask covers the padding, so a row's
outputs do not depend on the rows it ran with. Only the outputs some request asked for are fetched.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules (the ONNX Runtime session is opened by
the model and handed in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import windows
from .batching import padding_counts, plan_sub_batches, stack_padded
from .parameters import flag_parameter, number_parameter
from .responses import RequestError, Responder, input_array, triton, wanted_outputs

GRAPH_INPUTS = ("input_ids", "attention_mask", "residue_mask")
GRAPH_OUTPUTS = ("hiddens", "embeddings")
TokenRows = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One request's (input_ids, attention_mask, residue_mask), each [rows, length]."""


def sequences_column(request: Any, error: type[Exception]) -> list[bytes]:
    """The request's `sequences` [batch, 1] as a list; a wrong shape raises `error` saying so."""
    items = input_array(request, "sequences")
    if items.ndim != 2 or items.shape[1] != 1:
        raise error(f"'sequences' must have shape [batch, 1], got {list(items.shape)}")
    return items[:, 0].tolist()


class SequenceInputs:
    """Token rows from a request's `sequences` (the fused layout: this model tokenizes);
    the tokenizer's errors name the sequence and the problem."""

    def __init__(self, tokenizer: Any, truncate: bool, error: type[Exception]) -> None:
        self.tokenizer, self.truncate, self.error = tokenizer, truncate, error

    def __call__(self, request: Any) -> TokenRows:
        encoded = self.tokenizer.encode(sequences_column(request, self.error), truncate=self.truncate)
        return encoded.input_ids, encoded.attention_mask, encoded.residue_mask


class WindowedRows(tuple):
    """A request's token rows (input_ids, attention_mask, residue_mask) when some of its sequences
    were split into windows: `layout` maps the rows back to the sequences (windows.py)."""

    layout: windows.WindowLayout


class WindowedSequenceInputs(SequenceInputs):
    """SequenceInputs for a model built with --max-residues: a sequence longer than the model's
    window (its max_length less BOS/EOS) becomes overlapping windows of it, each tokenized as the
    model expects (BOS + window + EOS); `merge` turns the rows' outputs back into one answer per
    sequence by windows.py's documented rule. Sequences within the window are one row, as without
    the option; over `max_residues` is the request's error."""

    def __init__(self, tokenizer: Any, truncate: bool, error: type[Exception], *, max_residues: int,
                 overlap: int) -> None:
        super().__init__(tokenizer, truncate, error)
        self.has_bos, self.has_eos = tokenizer.bos_token is not None, tokenizer.eos_token is not None
        self.window = tokenizer.max_length - self.has_bos - self.has_eos
        self.overlap = overlap or windows.default_overlap(self.window)
        self.max_residues = max_residues
        windows.check_settings(self.window, self.overlap, max_residues)

    def __call__(self, request: Any) -> TokenRows:
        raw = sequences_column(request, self.error)
        try:
            texts = [item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in raw]
        except UnicodeDecodeError:  # the tokenizer names the sequence and the problem
            return super().__call__(request)
        # A structure-aware tokenizer (SaProt's) spells a residue with two characters: windows count
        # residues, so its sequences are cut in their paired spelling, two characters a residue.
        paired = getattr(self.tokenizer, "paired", None)
        width = 1
        if paired is not None:
            try:
                texts, width = [paired(text) for text in texts], 2
            except ValueError:  # the tokenizer names the sequence and the problem
                return super().__call__(request)
        lengths = [len(text) // width for text in texts]
        if all(length <= self.window for length in lengths):
            return super().__call__(request)
        try:
            layout = windows.layout_windows(lengths, window=self.window, overlap=self.overlap,
                                            max_residues=self.max_residues,
                                            specials=int(self.has_bos) + int(self.has_eos))
        except windows.WindowError as err:
            raise RequestError(f"input 'sequences': {err}") from None
        encoded = self.tokenizer.encode(layout.texts(texts, width))
        rows = WindowedRows((encoded.input_ids, encoded.attention_mask, encoded.residue_mask))
        rows.layout = layout
        return rows

    def merge(self, rows: WindowedRows, outputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """(one sequence's outputs per row of the request: hiddens merged, embeddings their mean
        over the residues; the residue mask) from the windows' outputs (hiddens needed)."""
        layout, tokens = rows.layout, rows[1].sum(axis=1)
        per_row = [outputs["hiddens"][row, :tokens[row]] for row in range(len(tokens))]
        merged, masks = [], []
        for sequence, spans in enumerate(layout.spans):
            merged.append(windows.merge_rows(layout.outputs_of(sequence, per_row), spans, has_bos=self.has_bos,
                                             has_eos=self.has_eos))
            masks.append(windows.residue_mask(spans[-1][1], has_bos=self.has_bos, has_eos=self.has_eos))
        result = {"hiddens": stack_padded([m[None] for m in merged], 0.0),
                  "embeddings": np.stack([windows.mean_embedding(m, k) for m, k in zip(merged, masks)])}
        return result, stack_padded([k[None] for k in masks], False)


def sequence_inputs(args: Any, parameters: dict[str, str], folder: str) -> tuple[SequenceInputs, int, tuple]:
    """(the reader of `sequences`, the pad id, the tokenizer's error types) of a model that tokenizes,
    from its config parameters: the tokenizer (`tokenizer_class`, tokenizer.json in `folder`),
    `truncate`, and `max_residues` / `window_overlap` (built with --max-residues: longer sequences
    run as overlapping windows). The tokenizer modules are imported here: only a model that
    tokenizes has them beside it."""
    from .tokenizer_file import load_tokenizer
    from .tokenizers.character import TokenizationError
    tokenizer = load_tokenizer(folder, parameters)
    truncate = flag_parameter(parameters, "truncate")
    max_residues = number_parameter(args, parameters, "max_residues", "0")
    if max_residues:
        read: SequenceInputs = WindowedSequenceInputs(
            tokenizer, truncate, TokenizationError, max_residues=max_residues,
            overlap=number_parameter(args, parameters, "window_overlap", "0"))
    else:
        read = SequenceInputs(tokenizer, truncate, TokenizationError)
    return read, tokenizer.pad_id, (TokenizationError,)


class TokenInputs:
    """Token rows from a request's token tensors, checked: the graph would read out of range (or
    fail with ONNX Runtime's message) on ids outside the vocabulary or sequences over its length."""

    def __init__(self, vocab_size: int, max_length: int) -> None:
        self.vocab_size, self.max_length = vocab_size, max_length

    def __call__(self, request: Any) -> TokenRows:
        return self.check(tuple(input_array(request, name) for name in GRAPH_INPUTS))

    def check(self, arrays: TokenRows) -> TokenRows:
        """`arrays` if they are valid graph inputs, else a RequestError naming the problem."""
        if len({a.shape for a in arrays}) != 1 or arrays[0].ndim != 2:
            raise RequestError(f"inputs {', '.join(GRAPH_INPUTS)} must share one [batch, length] shape, got "
                               f"{', '.join(str(list(a.shape)) for a in arrays)}")
        input_ids, attention_mask, _ = arrays
        if input_ids.shape[1] > self.max_length:
            raise RequestError(f"input 'input_ids' has {input_ids.shape[1]} tokens; the maximum is {self.max_length}")
        bad = np.argwhere((input_ids < 0) | (input_ids >= self.vocab_size))
        if bad.size:
            row, position = bad[0]
            raise RequestError(f"input 'input_ids' row {row}: token id {input_ids[row, position]} at position "
                               f"{position} is outside the vocabulary [0, {self.vocab_size})")
        bad = np.argwhere((attention_mask != 0) & (attention_mask != 1))
        if bad.size:
            row, position = bad[0]
            raise RequestError(f"input 'attention_mask' row {row}: value {attention_mask[row, position]} at "
                               f"position {position}; allowed: 0 and 1")
        return arrays


class TokenCounters:
    """Prometheus counters of the real and padding tokens the graph computed (nothing on a Triton
    without Python-backend metrics). Padding fraction = padding / (real + padding)."""

    def __init__(self, model_name: str) -> None:
        pb_utils = triton()
        self.family = None
        if hasattr(pb_utils, "MetricFamily"):
            self.family = pb_utils.MetricFamily(
                name="bionemo_export_encoder_tokens_total",
                description="Tokens the encoder graph computed, by kind: real (attention mask 1) or padding",
                kind=pb_utils.MetricFamily.COUNTER)
            self.real, self.padding = (self.family.Metric(labels={"model": model_name, "kind": kind})
                                       for kind in ("real", "padding"))

    def add(self, real: int, padding: int) -> None:
        if self.family is not None:
            self.real.increment(real)
            self.padding.increment(padding)


class GraphEncoder:
    """The encoder model: `read(request)` -> its token rows (SequenceInputs or TokenInputs);
    `session` the encoder graph's ONNX Runtime session; `outputs` the model's outputs in
    declaration order ("mask", where declared, is the request's residue mask); errors of a
    request's inputs are answered with the message prefix `input_prefix`."""

    def __init__(self, session: Any, read: Callable[[Any], TokenRows], *, outputs: Sequence[str], pad_id: int,
                 length_bucket: int, token_budget: int, responder: Responder, input_prefix: str,
                 counters: TokenCounters | None = None, max_sub_batch: int = 0) -> None:
        self.session, self.read, self.outputs, self.pad_id = session, read, tuple(outputs), pad_id
        self.length_bucket, self.token_budget, self.max_sub_batch = length_bucket, token_budget, max_sub_batch
        self.responder, self.input_prefix, self.counters = responder, input_prefix, counters

    def warm_up(self) -> None:
        """One small all-zero batch through the graph, so the first request does not pay for it."""
        zeros = np.zeros((1, 16), dtype=np.int64)
        self.session.run(None, {"input_ids": zeros, "attention_mask": zeros + 1,
                                "residue_mask": np.ones((1, 16), dtype=bool)})

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        responses: list = [None] * len(requests)
        accepted = []  # (request index, outputs it wants, (input_ids, attention_mask, residue_mask))
        for index, request in enumerate(requests):
            try:
                accepted.append((index, wanted_outputs(request, self.outputs), self.read(request)))
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses[index] = self.responder.error_response(err, prefix=self.input_prefix)
        if not accepted:
            return responses, 0
        wanted_names = {name for _, wanted, _ in accepted for name in wanted}
        if any(isinstance(inputs, WindowedRows) for _, _, inputs in accepted):
            wanted_names.add("hiddens")  # windows are merged from their hiddens (embeddings too)
        try:
            results = self.run([inputs for _, _, inputs in accepted], wanted_names)
        except Exception as err:  # noqa: BLE001 - the graph failed: every request of this call says why
            for index, _, _ in accepted:
                responses[index] = self.responder.error_response(err)
            return responses, 0
        pb_utils = triton()
        for (index, wanted, inputs), outputs in zip(accepted, results):
            if isinstance(inputs, WindowedRows):
                merged, mask = self.read.merge(inputs, outputs)
                outputs = {**merged, "mask": mask}
            else:
                outputs["mask"] = inputs[2]
            responses[index] = pb_utils.InferenceResponse(
                [pb_utils.Tensor(name, outputs[name]) for name in wanted])
        # The graph's largest buffers are attention scores: rows x length^2 floats per head.
        return responses, sum(inputs[0].shape[0] * inputs[0].shape[1] ** 2 * 4 for _, _, inputs in accepted)

    def run(self, inputs: list[TokenRows], wanted: set[str]) -> list[dict[str, np.ndarray]]:
        """Run every row of every request in length-bucketed sub-batches; per request, a dict of
        its graph outputs (`wanted` ones) at its own batch size and length."""
        joined = [stack_padded([request[i] for request in inputs], pad)
                  for i, pad in enumerate((self.pad_id, 0, False))]
        lengths = joined[1].sum(axis=1)
        batches = plan_sub_batches(lengths, bucket=self.length_bucket, token_budget=self.token_budget,
                                   limit=joined[0].shape[1], max_rows=self.max_sub_batch)
        fetch = [name for name in GRAPH_OUTPUTS if name in wanted]
        if not fetch:
            return [{} for _ in inputs]
        sizes = [request[0].shape[0] for request in inputs]
        owner = np.repeat(np.arange(len(inputs)), sizes)
        local = np.arange(lengths.size) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        embeddings = None
        hiddens: list = [None] * len(inputs)
        for batch in batches:
            feed = {name: array[batch.rows, :batch.length] for name, array in zip(GRAPH_INPUTS, joined)}
            values = dict(zip(fetch, self.session.run(fetch, feed)))
            if "embeddings" in values:
                if embeddings is None:
                    embeddings = np.empty((lengths.size,) + values["embeddings"].shape[1:], dtype=np.float32)
                embeddings[batch.rows] = values["embeddings"]
            if "hiddens" in values:
                for k, row in enumerate(batch.rows.tolist()):
                    owned = owner[row]
                    if hiddens[owned] is None:
                        hiddens[owned] = np.zeros(inputs[owned][0].shape + values["hiddens"].shape[2:],
                                                  dtype=np.float32)
                    hiddens[owned][local[row], :lengths[row]] = values["hiddens"][k, :lengths[row]]
        if self.counters is not None:
            self.counters.add(*padding_counts(lengths, batches))
        results = []
        start = 0
        for owned, size in enumerate(sizes):
            outputs = {}
            if embeddings is not None:
                outputs["embeddings"] = embeddings[start:start + size]
            if hiddens[owned] is not None:
                outputs["hiddens"] = hiddens[owned]
            results.append(outputs)
            start += size
        return results


class Tokenizing:
    """N_tokenizer (the ensemble layout): each request's sequences -> the encoder graph's token
    tensors and mask, padded to a multiple of `length_bucket` tokens (at most the tokenizer's
    limit) when it is over 1, so that requests of close lengths have equal shapes and Triton's
    dynamic batcher joins them for the graph. Errors are answered with the message prefix
    `input_prefix` (the public models pass them on)."""

    def __init__(self, read: SequenceInputs, length_bucket: int, responder: Responder, input_prefix: str) -> None:
        self.read, self.length_bucket = read, length_bucket
        self.responder, self.input_prefix = responder, input_prefix

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        pb_utils = triton()
        responses = []
        for request in requests:
            try:
                input_ids, attention_mask, residue_mask = self.read(request)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses.append(self.responder.error_response(err, prefix=self.input_prefix))
                continue
            padding = self.bucket_padding(input_ids.shape[1])
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", np.pad(input_ids, padding, constant_values=self.read.tokenizer.pad_id)),
                pb_utils.Tensor("attention_mask", np.pad(attention_mask, padding)),
                pb_utils.Tensor("mask", np.pad(residue_mask, padding)),
            ]))
        return responses, 0

    def bucket_padding(self, length: int) -> tuple:
        """np.pad widths that take `length` tokens to the next multiple of the length bucket."""
        if self.length_bucket <= 1:
            return ((0, 0), (0, 0))
        padded = min(-(-length // self.length_bucket) * self.length_bucket, self.read.tokenizer.max_length)
        return ((0, 0), (0, max(padded - length, 0)))
