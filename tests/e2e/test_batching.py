"""Batching across lengths: served repositories that join requests of different lengths (encoder,
both layouts) and samplings requests (MegaMolBART) without changing any request's answer (the
sub-batch planner itself: tests/unit/test_sub_batches.py)."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from bionemo_export.bench.run import read_statistics
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import EncoderClient, InferenceError, Seq2SeqClient, TritonClient, strings_to_tensor
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint

AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"


# --------------------------------------------------------------------------- served encoder
def _sequences(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(AMINO_ACIDS), size=int(n))) for n in rng.integers(3, 150, size=count)]


def _requests() -> list[list[str]]:
    """Requests of one to three sequences of very different lengths."""
    sequences = _sequences(40)
    requests, start = [], 0
    for size in [1, 2, 3] * 8:
        requests.append(sequences[start:start + size])
        start = (start + size) % 35
    return requests


def _stats(url: str, model: str) -> tuple[int, int]:
    """(inferences, executions) of `model` so far, as `bench` reads Triton's statistics, once they
    hold still for half a second: Triton counts a request after its response has gone out, so a read
    right after the last response can miss it (a CI run read 94 inferences of 96)."""
    with TritonClient(f"grpc://{url}") as client:
        last, deadline = None, time.monotonic() + 10
        while True:
            counters = read_statistics(client)[model]
            now = (counters["inferences"], counters["executions"])
            if now == last or time.monotonic() > deadline:
                return now
            last = now
            time.sleep(0.5)


def _token_counts(server, model: str) -> dict[str, float]:
    text = urllib.request.urlopen(server.endpoints.metrics_url, timeout=10).read().decode()
    counts = {}
    for match in re.finditer(r'^bionemo_export_encoder_tokens_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match["labels"]))
        if labels["model"] == model:
            counts[labels["kind"]] = float(match["value"])
    return counts


@pytest.fixture(scope="module", params=["fused", "ensemble"])
def encoder_server(request, tmp_path_factory, triton_install):
    """A tiny random ESM-2 served with a queue delay long enough that concurrent requests batch."""
    work = tmp_path_factory.mktemp(f"batching-{request.param}")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    build_repository(BuildRequest(
        family="esm2", checkpoint=checkpoint, name="tiny", out=work / "repo", backend="python",
        serving=ServingOptions(max_batch_size=16, max_queue_delay_microseconds=50_000, layout=request.param,
                               length_bucket=16, token_budget=512), optimize=False,
    ))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield server


def test_concurrent_requests_of_different_lengths_batch_and_match_single_requests(encoder_server):
    server = encoder_server
    url = f"grpc://{server.endpoints.grpc_url}"
    requests = _requests()
    with EncoderClient("tiny", url) as client:
        alone = [(client.seqs_to_embedding(r), *client.seqs_to_hidden(r)) for r in requests]
    before = _stats(server.endpoints.grpc_url, "tiny_encoder")
    tokens_before = _token_counts(server, "tiny_encoder")
    barrier = threading.Barrier(len(requests))

    def concurrently(sequences):
        with EncoderClient("tiny", url) as client:
            barrier.wait()
            return client.seqs_to_embedding(sequences), *client.seqs_to_hidden(sequences)

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(concurrently, requests))
    inferences, executions = (b - a for a, b in zip(before, _stats(server.endpoints.grpc_url, "tiny_encoder")))
    assert inferences == 2 * sum(len(r) for r in requests)
    assert inferences / executions > 1.5  # the dynamic batcher joined requests of different lengths

    for sequences, (embeddings, hiddens, mask), (ref_embeddings, ref_hiddens, ref_mask) in zip(
            requests, together, alone):
        np.testing.assert_allclose(embeddings, ref_embeddings, atol=1e-5)
        assert hiddens.shape == ref_hiddens.shape and hiddens.shape[1] == max(map(len, sequences)) + 2
        np.testing.assert_array_equal(mask, ref_mask)
        np.testing.assert_allclose(hiddens, ref_hiddens, atol=1e-5)
        for row, sequence in enumerate(sequences):  # hiddens cover BOS + residues + EOS, 0 on padding
            assert not hiddens[row, len(sequence) + 2:].any()

    # The padding the graph computed is counted: every real token exactly, padding within buckets.
    tokens = {kind: value - tokens_before.get(kind, 0) for kind, value in _token_counts(server, "tiny_encoder").items()}
    assert tokens["real"] == 2 * sum(len(s) + 2 for r in requests for s in r)
    assert 0 < tokens["padding"] / (tokens["real"] + tokens["padding"]) < 0.3


def test_a_bad_sequence_fails_alone_inside_a_batch(encoder_server):
    url = encoder_server.endpoints.grpc_url
    barrier = threading.Barrier(6)

    def send(sequences):
        with TritonClient(f"grpc://{url}") as client:
            barrier.wait()
            try:
                return client.infer("tiny_embeddings", {"sequences": strings_to_tensor(sequences)})["embeddings"]
            except InferenceError as err:
                return err

    batches = [["MKTAYIAK"], ["MKTAYJAK"], ["MSLKRKNIALIPAAGIGVRFG"], [""], ["MK", "MKT"], ["A" * 120]]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(send, batches))
    assert "invalid character 'J' at position 5" in str(results[1]) and "empty" in str(results[3])
    for index in (0, 2, 4, 5):
        embeddings = results[index]
        assert isinstance(embeddings, np.ndarray) and np.isfinite(embeddings).all(), embeddings


# --------------------------------------------------------------------------- served samplings
@pytest.fixture(scope="module")
def samplings_server(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("batching-samplings")
    family = get_family("megamolbart")
    checkpoint = save_random_checkpoint(family.name, work / "checkpoint", seed=5)
    build_repository(BuildRequest(
        family="megamolbart", checkpoint=checkpoint, name="mmb", out=work / "repo", backend="python",
        tasks=("hiddens", "samplings"), max_decode_length=12,
        serving=ServingOptions(max_batch_size=16, max_queue_delay_microseconds=100_000), optimize=False,
    ))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield server, family.sample_sequences()


def test_samplings_batched_across_requests_keep_each_seeded_result(samplings_server):
    server, smiles = samplings_server
    url = f"grpc://{server.endpoints.grpc_url}"
    # Triton's dynamic batcher joins requests that send the same inputs: every request names all of
    # these (each with its own values).
    settings = [
        ("greedy-perturbate", 1, 5), ("greedy-perturbate", 3, 5), ("beam-search-perturbate", 1, 2),
        ("beam-search-perturbate-sample", 2, 2), ("topkp-perturbate", 1, 5), ("greedy-perturbate", 2, 5),
        ("beam-search-perturbate", 2, 2), ("beam-search-single-sample", 2, 5),
    ]
    requests: list[tuple[list[str], dict[str, Any]]] = [
        (smiles[i % 5:i % 5 + 1 + i % 3], dict(seed=i, sampling_method=method, num_samples=samples, beam_size=beams,
                                               top_k=3, scaled_radius=0.5 + i / 10))
        for i, (method, samples, beams) in enumerate(settings)]
    with Seq2SeqClient("mmb", url) as client:
        alone = [client.sample_seqs(sequences, **parameters) for sequences, parameters in requests]
    before = _stats(server.endpoints.grpc_url, "mmb_samplings")
    barrier = threading.Barrier(len(requests))

    def concurrently(request):
        sequences, parameters = request
        with Seq2SeqClient("mmb", url) as client:
            barrier.wait()
            return client.sample_seqs(sequences, **parameters)

    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(concurrently, requests))
    inferences, executions = (b - a for a, b in zip(before, _stats(server.endpoints.grpc_url, "mmb_samplings")))
    assert together == alone
    assert inferences > executions  # requests were handed over (and sampled) together
