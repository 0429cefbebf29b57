"""N_samplings: sequences -> new sequences sampled around them (tokenize, encode through BLS,
perturb the hidden states, decode, detokenize), the requests the dynamic batcher hands over
encoded in one call and, where their method and beam settings agree, decoded as one batch.

Each request becomes a `Job` (its options parsed by request_options.py, its own seeded
generator). Jobs are grouped by `Job.decode_key` and split within max_decode_tokens
(`plan_decodes`); a group's noise is drawn per job exactly as search.generate draws it, then all
its perturbed rows decode together (greedy and beam-search decoding treat rows independently).
topkp-perturbate draws random numbers while decoding, so such a job decodes alone. A job whose
rows overflow fails alone; the others of its group decode again without it.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library, numpy and its sibling modules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from .decoding import CancellableDecoder, pad_and_join, token_ids
from .request_options import OPTIONS, parse_options
from .responses import RequestError, Responder, call_model, cancelled, input_array, triton
from .search import (
    LIMITS,
    GenerationError,
    TooLargeError,
    beam_search,
    check_decode_tokens,
    generate,
    greedy,
    hypotheses_per_sequence,
    perturb,
    split_by_tokens,
    validate_hiddens,
)

BatchKey = tuple[Literal["greedy", "beam"], int, int]
"""Jobs with equal keys decode as one batch: (greedy or beam, beams, hypotheses kept per beam search)."""
DecodeKey = BatchKey | tuple[Literal["alone"], int]
"""A decode's key: its jobs' BatchKey, or ("alone", request index) for a job that decodes alone."""


class Job:
    """One request: its sequences, tokens, sampling options, random generator, and what it became."""

    def __init__(self, request: Any, items: np.ndarray, encoded: Any, options: dict[str, Any]) -> None:
        self.request, self.items, self.encoded = request, items, encoded
        options = dict(options)
        self.rng = np.random.default_rng(options.pop("seed"))
        self.method = options.pop("sampling_method")
        self.parameters = options
        self.hiddens: np.ndarray | None = None
        self.perturbed: np.ndarray | None = None  # [copies * rows, S, H], sample-major (search.generate's layout)

    @property
    def rows(self) -> int:
        return len(self.items)

    @property
    def copies(self) -> int:
        """Perturbed copies of each row (search.generate's sample-major layout)."""
        return 1 if self.method == "beam-search-single-sample" else self.parameters["num_samples"]

    @property
    def decode_size(self) -> tuple[int, int]:
        """(rows, tokens each) this job adds to a decode: every hypothesis of every sequence."""
        hypotheses = hypotheses_per_sequence(self.method, self.parameters["num_samples"], self.parameters["beam_size"])
        return self.rows * hypotheses, self.encoded.residue_mask.shape[1]

    def decode_key(self) -> BatchKey | None:
        """Jobs with equal keys decode as one batch: (greedy or beam, beams, hypotheses kept per
        beam search); None: this job decodes alone."""
        if self.method == "topkp-perturbate":
            return None
        if self.method == "greedy-perturbate":
            return ("greedy", 1, 1)
        beams = self.parameters["num_samples" if self.method == "beam-search-single-sample" else "beam_size"]
        return ("beam", beams, 1 if self.method == "beam-search-perturbate" else beams)

    def too_large(self, entries: Sequence[int], reason: str) -> RequestError:
        """The error for this job's decode batch entries `entries` (sample-major) that were too large."""
        rows = sorted({entry % self.rows for entry in entries})
        return RequestError(f"input 'scaled_radius' row 0 = {self.parameters['scaled_radius']:g} makes the "
                            f"perturbed hidden states of sequence(s) {rows} too large to decode: {reason}")


def _ready(array: np.ndarray | None) -> np.ndarray:
    """A Job's hiddens or perturbed copies: Samplings._encode sets the hiddens of every job, and
    _generate_together the perturbed copies of every job it decodes, before either is read."""
    assert array is not None, "a job's hidden states were read before they were set"
    return array


def plan_decodes(jobs: Mapping[int, Job], max_decode_tokens: int) -> list[tuple[DecodeKey, list[int]]]:
    """The decodes that serve `jobs` (request index -> Job): (key, request indices) each, jobs of
    one Job.decode_key together (("alone", index) for a job that decodes alone) and within
    `max_decode_tokens` (the key/value caches' size)."""
    groups: dict[DecodeKey, list[int]] = {}
    for index, job in jobs.items():
        groups.setdefault(job.decode_key() or ("alone", index), []).append(index)
    return [(key, [indices[i] for i in part]) for key, indices in groups.items()
            for part in split_by_tokens([jobs[i].decode_size for i in indices], max_decode_tokens)]


class Samplings:
    """N_samplings over a tokenizer, a decoder and the encoder model reached through BLS
    (`encoder_model`; `encoder_tokenizes`: it takes the sequences, else the tokens)."""

    def __init__(self, tokenizer: Any, decoder: CancellableDecoder, settings: Mapping[str, Any],
                 responder: Responder, *, encoder_model: str, encoder_tokenizes: bool) -> None:
        self.tokenizer, self.decoder, self.responder = tokenizer, decoder, responder
        self.encoder_model, self.encoder_tokenizes = encoder_model, encoder_tokenizes
        self.limits = {name: settings[name] for name in LIMITS}
        self.max_magnitude = settings["max_hidden_magnitude"]
        self.ids = token_ids(settings)

    def execute(self, requests: Sequence[Any]) -> tuple[list, int]:
        """(one response per request, bytes of work) for Responder.answer_all."""
        error = self.responder.error_response
        responses: list = [None] * len(requests)
        jobs = {}  # request index -> Job
        for index, request in enumerate(requests):
            if request.is_cancelled():
                responses[index] = error(cancelled())
                continue
            try:
                jobs[index] = self.job(request)
            except Exception as err:  # noqa: BLE001 - this request fails alone
                responses[index] = error(err)
        try:
            self._encode(list(jobs.values()))
        except Exception as err:  # noqa: BLE001 - the encoder call failed for all of them
            return [response or error(err) for response in responses], 0
        pb_utils = triton()
        for index, result in self._sample(jobs):
            if isinstance(result, Exception):
                responses[index] = error(result)
            else:
                responses[index] = pb_utils.InferenceResponse([pb_utils.Tensor("generated", result)])
        self.decoder.requests = []
        # The decode cache holds a few times the perturbed hidden states.
        return responses, 4 * sum(job.hiddens.nbytes * job.copies for job in jobs.values() if job.hiddens is not None)

    def job(self, request: Any) -> Job:
        """The request's Job: options parsed, sequences tokenized, its decode within max_decode_tokens."""
        items = input_array(request, "sequences")
        options = parse_options({name: input_array(request, name) for name in OPTIONS}, len(items),
                                self.limits)
        encoded = self.tokenizer.encode(items[:, 0].tolist())
        job = Job(request, items, encoded, options)
        rows, length = job.decode_size
        check_decode_tokens(rows, length, self.limits["max_decode_tokens"],
                            f"{job.rows} sequence(s) x {rows // job.rows} hypotheses x {length} tokens")
        return job

    def _encode(self, jobs: list[Job]) -> None:
        """Every job's hidden states from one encoder call, each cropped to its own length."""
        if not jobs:
            return
        if self.encoder_tokenizes:
            inputs = {"sequences": np.concatenate([job.items for job in jobs])}
        else:
            encoded = self.tokenizer.encode([s for job in jobs for s in job.items[:, 0].tolist()])
            inputs = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
                      "residue_mask": encoded.residue_mask}
        hiddens, = call_model(self.encoder_model, inputs, ["hiddens"])
        start = 0
        for job in jobs:
            job.hiddens = hiddens[start:start + job.rows, :job.encoded.residue_mask.shape[1]]
            start += job.rows

    def _sample(self, jobs: Mapping[int, Job]):
        """(request index, the generated array or the error) for every job, decode by decode."""
        for key, indices in plan_decodes(jobs, self.limits["max_decode_tokens"]):
            group = {index: jobs[index] for index in indices}
            self.decoder.requests = [job.request for job in group.values()]
            try:
                if key[0] == "alone":
                    results = {indices[0]: self._generate_alone(group[indices[0]])}
                else:
                    results = self._generate_together(group, *key)
            except Exception as err:  # noqa: BLE001 - the group's decode failed: each of its requests says why
                results = {index: err for index in indices}
            for index in indices:
                result = results[index]
                yield index, result if isinstance(result, Exception) else self._strings(result)

    def _generate_alone(self, job: Job):
        try:
            return generate(self.decoder, _ready(job.hiddens), job.encoded.residue_mask, method=job.method, rng=job.rng,
                            max_magnitude=self.max_magnitude, **self.ids, **job.parameters)
        except TooLargeError as err:
            return job.too_large(err.rows, err.reason)

    def _generate_together(self, group: dict[int, Job], kind: str, beams: int, kept: int) -> dict:
        """search.generate for several jobs in one decode: per job its own noise (same draws as
        generate), then every perturbed row of every job decoded as one batch. A job whose rows
        overflow fails alone: the others decode again without it (their noise already drawn)."""
        results: dict = {}
        for index, job in group.items():
            try:
                validate_hiddens(_ready(job.hiddens), job.encoded.residue_mask)
                job.perturbed = perturb(np.tile(_ready(job.hiddens), (job.copies, 1, 1)),
                                        np.tile(job.encoded.residue_mask, (job.copies, 1)), job.rng,
                                        job.parameters["scaled_radius"], self.max_magnitude)
            except TooLargeError as err:
                results[index] = job.too_large(err.rows, err.reason)
            except GenerationError as err:
                results[index] = err
        pending = [index for index in group if index not in results]
        while pending:
            self.decoder.requests = [group[index].request for index in pending]
            try:
                outputs = self._decode([group[index] for index in pending], kind, beams, kept)
            except TooLargeError as err:
                starts = np.cumsum([0] + [_ready(group[index].perturbed).shape[0] for index in pending])
                failed = []
                for index, start, end in zip(pending, starts[:-1], starts[1:]):
                    entries = [row - start for row in err.rows if start <= row < end]
                    if entries:
                        results[index] = group[index].too_large(entries, err.reason)
                        failed.append(index)
                pending = [index for index in pending if index not in failed]
                continue
            results.update(zip(pending, outputs))
            break
        return results

    def _decode(self, group: list[Job], kind: str, beams: int, kept: int) -> list:
        """Decode every perturbed row of the jobs in `group` as one batch; per job, per row its outputs."""
        hiddens = pad_and_join([_ready(job.perturbed) for job in group])
        mask = pad_and_join([np.tile(job.encoded.residue_mask, (job.copies, 1)) for job in group])
        if kind == "greedy":
            outputs = [[sequence] for sequence in greedy(self.decoder, hiddens, mask, **self.ids)]
        else:
            outputs = [[sequence for sequence, _ in hypotheses[:kept]]
                       for hypotheses in beam_search(self.decoder, hiddens, mask, beam_size=beams, **self.ids)]
        results, start = [], 0
        for job in group:  # sample s of row b is entry s * rows + b of the job's block
            block = outputs[start:start + job.copies * job.rows]
            start += job.copies * job.rows
            results.append([[sequence for copy in range(job.copies) for sequence in block[copy * job.rows + row]]
                            for row in range(job.rows)])
        return results

    def _strings(self, ids: list) -> np.ndarray:
        return np.array([[self.tokenizer.decode(sample).encode("utf-8") for sample in row] for row in ids],
                        dtype=np.object_)
