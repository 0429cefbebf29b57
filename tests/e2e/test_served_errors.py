"""Served errors are the client's when the client made the mistake, and served work is bounded.

Two tiny random repositories (ESM-2 in the fused layout; MegaMolBART in the ensemble layout, so
that the tokenizer model, the token-input encoder and the decoder graphs are all Python models a
client can reach), each served by the real tritonserver. Every client mistake must come back as
gRPC INVALID_ARGUMENT / HTTP 400 with a message naming the input, the row and the problem, never
a traceback or a server path; through ensembles and BLS calls too. Then the limits on one
sampling request's work, cancellation by the client's deadline, and the stubs' memory after large
requests.
"""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype
from typer.testing import CliRunner

from bionemo_export import procfs
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import Seq2SeqClient, strings_to_tensor
from bionemo_export.model_repository.options import GenerationLimits, ServingOptions
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint

INVALID = {"grpc": "StatusCode.INVALID_ARGUMENT", "http": "400"}
INTERNAL = {"grpc": "StatusCode.INTERNAL", "http": "500"}
LIMITS = GenerationLimits(max_decode_tokens=400_000)  # room for the long requests of the cancellation test
LONG_SMILES = "C" * 510  # the tiny MegaMolBART's longest input: 512 positions


# ------------------------------------------------------------------------------------- servers
@pytest.fixture(scope="module")
def esm(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("esm-errors")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=work / "repo",
                                  backend="python", serving=ServingOptions(max_batch_size=8), optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield server


@pytest.fixture(scope="module")
def mmb(tmp_path_factory, triton_install):
    """MegaMolBART in the ensemble layout, plus three deliberately broken models beside the real
    ones: a cross_kv folder holding the decoder step's graph (an unexpected server-side failure),
    and copies of the decodes model that call it, or a decoder step allowing no cached position
    (a BLS callee that fails with INTERNAL, and one that refuses its input)."""
    work = tmp_path_factory.mktemp("mmb-errors")
    checkpoint = save_random_checkpoint("megamolbart", work / "checkpoint", seed=5)
    repo = work / "repo"
    result = CliRunner().invoke(app, [  # the command line's limit flags reach the configs
        "build", "repo", "--no-optimize", "--model", "megamolbart", "--checkpoint", str(checkpoint), "--name", "mmb",
        "--out", str(repo),
        "--backend", "python", "--layout", "ensemble", "--max-batch-size", "32",
        "--max-decode-tokens", str(LIMITS.max_decode_tokens), "--max-num-samples", str(LIMITS.max_num_samples)])
    assert result.exit_code == 0, result.output
    _copy_model(repo, "mmb_cross_kv", "mmb_broken_cross_kv")
    shutil.copy(repo / "mmb_decoder_step" / "1" / "model.onnx", repo / "mmb_broken_cross_kv" / "1" / "model.onnx")
    # Its golden answers would refuse the swapped graph at load (tests/e2e/test_golden.py); what this
    # model is for is a failure while serving, as a repository without golden answers would show.
    (repo / "mmb_broken_cross_kv" / "1" / "golden.npz").unlink()
    _copy_model(repo, "mmb_decoder_step", "mmb_short_step", {r'\"past_length\": 511': r'\"past_length\": 0'})
    _copy_model(repo, "mmb_decodes", "mmb_decodes_broken", {'"mmb_cross_kv"': '"mmb_broken_cross_kv"'})
    _copy_model(repo, "mmb_decodes", "mmb_decodes_short", {'"mmb_decoder_step"': '"mmb_short_step"'})
    with TritonServer(repo, install=triton_install, log_file=work / "server.log") as server:
        yield server


def _copy_model(repo: Path, source: str, name: str, replace: dict[str, str] | None = None) -> None:
    """A copy of model `source` named `name` (in its messages too), its config.pbtxt with `replace`
    applied (each must match: the served model.py reads its limits and callees from the config's
    parameters)."""
    shutil.copytree(repo / source, repo / name)
    config = repo / name / "config.pbtxt"
    text = config.read_text().replace(f'name: "{source}"', f'name: "{name}"', 1)
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    config.write_text(text)
    code = repo / name / "1" / "model.py"
    code.write_text(code.read_text().replace(f'"{source}', f'"{name}').replace(f"{source}:", f"{name}:"))


# ------------------------------------------------------------------------------------- helpers
def _client(server, protocol):
    if protocol == "grpc":
        return grpcclient, grpcclient.InferenceServerClient(server.endpoints.grpc_url)
    return httpclient, httpclient.InferenceServerClient(server.endpoints.http_url, network_timeout=300)


def infer(server, model: str, inputs: dict[str, np.ndarray], protocol: str = "grpc",
          **options) -> dict[str, np.ndarray]:
    """The outputs of a plain tritonclient request (raises InferenceServerException)."""
    module, client = _client(server, protocol)
    tensors = []
    for name, array in inputs.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    try:
        result = client.infer(model, tensors, **options)
        if isinstance(result, grpcclient.InferResult):
            response = result.get_response(as_json=True)
        else:
            assert isinstance(result, httpclient.InferResult), result
            response = result.get_response()
        outputs = {output["name"]: result.as_numpy(output["name"]) for output in response["outputs"]}
        arrays = {name: array for name, array in outputs.items() if array is not None}
        assert arrays.keys() == outputs.keys(), f"{model} sent no data for outputs {outputs.keys() - arrays.keys()}"
        return arrays
    finally:
        client.close()


def refused(server, model: str, inputs: dict[str, np.ndarray], protocol: str = "grpc",
            codes: dict[str, str] = INVALID) -> str:
    """The message of the error `model` answers `inputs` with, checked to carry the expected code
    and to be clean: no traceback, no server file path."""
    with pytest.raises(InferenceServerException) as caught:
        infer(server, model, inputs, protocol)
    error = caught.value
    assert error.status() == codes[protocol], (error.status(), error.message())
    message = error.message()
    assert_clean(message, server)
    return message


def assert_clean(message: str, server) -> None:
    assert "Traceback" not in message and ".py" not in message, message
    assert str(server.model_repository) not in message and not re.search(r"(^|[\s'\"(])/\w+/", message), message


def option(value, dtype, rows: int = 1) -> np.ndarray:
    return np.full((rows, 1), value, dtype=dtype)


def non_utf8(rows: int = 1) -> np.ndarray:
    return np.array([[b"CC\xff\xfe"]] * rows, dtype=np.object_)


# ------------------------------------------------------------------------ sequences (ensembles)
@pytest.mark.parametrize("protocol", ["grpc", "http"])
@pytest.mark.parametrize("model", ["esm_embeddings", "esm_hiddens", "esm_encoder"])
def test_bad_sequences_are_the_clients_error_through_ensembles(esm, protocol, model):
    message = refused(esm, model, {"sequences": strings_to_tensor(["MKTAYIAK", "MKTAYJAK"])}, protocol)
    assert "sequence 1 has an invalid character 'J' at position 5; allowed characters: " in message
    assert "empty" in refused(esm, model, {"sequences": strings_to_tensor(["MK", ""])}, protocol)
    assert "sequence 0 is not valid UTF-8" in refused(esm, model, {"sequences": non_utf8()}, protocol)
    assert "residues; the maximum is" in refused(esm, model, {"sequences": strings_to_tensor(["A" * 5000])},
                                                 protocol)
    assert np.isfinite(infer(esm, "esm_embeddings", {"sequences": strings_to_tensor(["MKT"])}, protocol)
                       ["embeddings"]).all()
    if model == "esm_encoder":  # a request naming no outputs: the encoder graph's (not the graphs it hosts)
        answered = infer(esm, model, {"sequences": strings_to_tensor(["MKT"])}, protocol)
        assert {"embeddings", "hiddens", "mask"} <= set(answered) and "contacts" not in answered, sorted(answered)


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_smiles_through_the_two_step_ensemble_and_samplings(mmb, protocol):
    for model in ("mmb_hiddens", "mmb_tokenizer", "mmb_samplings"):
        message = refused(mmb, model, {"sequences": strings_to_tensor(["CCO", "CCO\u00e9"])}, protocol)
        assert "sequence 1" in message and "not in the vocabulary" in message, message


# --------------------------------------------------------------------------- sampling options
@pytest.mark.parametrize(("name", "value", "dtype", "expected"), [
    ("top_p", np.nan, np.float32, "input 'top_p' row 0 must be finite, got nan"),
    ("temperature", np.nan, np.float32, "input 'temperature' row 0 must be finite, got nan"),
    ("scaled_radius", np.nan, np.float32, "input 'scaled_radius' row 0 must be finite, got nan"),
    ("scaled_radius", -1.0, np.float32, "input 'scaled_radius' row 0 must be >= 0.0, got -1.0"),
    ("top_p", 1.5, np.float32, "input 'top_p' row 0 must be <= 1.0, got 1.5"),
    ("top_k", -2, np.int32, "input 'top_k' row 0 must be >= 0, got -2"),
    ("seed", -1, np.int64, "input 'seed' row 0 must be between 0 and 9223372036854775807, got -1"),
    ("num_samples", 0, np.int32, "input 'num_samples' row 0 must be >= 1, got 0"),
    ("beam_size", 0, np.int32, "input 'beam_size' row 0 must be >= 1, got 0"),
])
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_bad_sampling_options_name_the_input_row_and_range(mmb, protocol, name, value, dtype, expected):
    inputs = {"sequences": strings_to_tensor(["CCO", "CCN"]), name: option(value, dtype, rows=2)}
    assert expected in refused(mmb, "mmb_samplings", inputs, protocol)


def test_sampling_method_must_be_known_utf8_and_one_per_request(mmb):
    sequences = strings_to_tensor(["CCO", "CCN"])
    message = refused(mmb, "mmb_samplings", {"sequences": sequences, "sampling_method": non_utf8(2)})
    assert "input 'sampling_method' row 0 is not valid UTF-8" in message
    message = refused(mmb, "mmb_samplings", {"sequences": sequences,
                                             "sampling_method": strings_to_tensor(["nucleus", "nucleus"])})
    assert "input 'sampling_method' row 0: unknown sampling method 'nucleus'; valid: greedy-perturbate" in message
    message = refused(mmb, "mmb_samplings", {"sequences": sequences,
                                             "top_k": np.array([[1], [2]], dtype=np.int32)})
    assert "input 'top_k' row 1 differs from row 0" in message
    message = refused(mmb, "mmb_samplings", {"sequences": sequences,
                                             "top_p": np.array([[0.5], [np.nan]], dtype=np.float32)})
    assert "input 'top_p' row 1 differs from row 0" in message


# ----------------------------------------------------------------------------------- limits
def test_limits_are_declared_in_the_configs(mmb):
    client = grpcclient.InferenceServerClient(mmb.endpoints.grpc_url)
    answers = [client.get_model_config(model, as_json=True) for model in ("mmb_samplings", "mmb_decodes")]
    client.close()
    assert all(isinstance(answer, dict) for answer in answers), answers  # as_json: parsed JSON, not a protobuf
    samplings, decodes = (answer["config"] for answer in answers if isinstance(answer, dict))
    parameters = {key: value["string_value"] for key, value in samplings["parameters"].items()}
    assert {key: parameters[key] for key in ("max_num_samples", "max_beam_size", "max_samples_x_beams")} == {
        "max_num_samples": str(LIMITS.max_num_samples), "max_beam_size": str(LIMITS.max_beam_size),
        "max_samples_x_beams": str(LIMITS.max_samples_x_beams)}
    for name, value in (("max_decode_length", "511"), ("max_hidden_magnitude", str(LIMITS.max_hidden_magnitude)),
                        ("max_decode_tokens", "400000")):
        assert parameters[name] == decodes["parameters"][name]["string_value"] == value
    assert samplings["instance_group"][0]["count"] == 2 and decodes["instance_group"][0]["count"] == 1


def test_default_limits():
    assert GenerationLimits() == GenerationLimits(max_num_samples=32, max_beam_size=16, max_samples_x_beams=64,
                                                  max_decode_tokens=32768, max_hidden_magnitude=1e4)
    assert ServingOptions().limits == GenerationLimits() and ServingOptions().role("samplings").instances == 2


@pytest.mark.parametrize(("options", "expected"), [
    (dict(num_samples=LIMITS.max_num_samples + 1),
     f"input 'num_samples' row 0 must be between 1 and {LIMITS.max_num_samples} (the server's max_num_samples)"),
    (dict(beam_size=LIMITS.max_beam_size + 1, sampling_method="beam-search-perturbate"),
     f"input 'beam_size' row 0 must be between 1 and {LIMITS.max_beam_size} (the server's max_beam_size)"),
    (dict(num_samples=64, beam_size=64, sampling_method="beam-search-perturbate-sample"), "max_num_samples"),
    (dict(num_samples=8, beam_size=16, sampling_method="beam-search-perturbate"),
     f"= 128 hypotheses per sequence with beam-search-perturbate; the server's max_samples_x_beams is "
     f"{LIMITS.max_samples_x_beams}"),
    (dict(num_samples=4, beam_size=16, sampling_method="beam-search-perturbate"),
     "32 sequence(s) x 64 hypotheses x 510 tokens = 1044480 tokens of hidden states to decode; the server's "
     "max_decode_tokens is 400000"),
])
def test_work_over_the_limits_is_refused_before_any_work(mmb, options, expected):
    inputs = {"sequences": strings_to_tensor([LONG_SMILES] * 32)}
    for name, value in options.items():
        inputs[name] = (strings_to_tensor([value] * 32) if isinstance(value, str)
                        else option(value, np.int32, rows=32))
    start = time.monotonic()
    assert expected in refused(mmb, "mmb_samplings", inputs)
    assert time.monotonic() - start < 5  # refused up front, not after decoding


def test_a_request_at_the_limits_is_served(mmb):
    with Seq2SeqClient("mmb", f"grpc://{mmb.endpoints.grpc_url}") as client:
        generated = client.sample_seqs(["CCO"], num_samples=LIMITS.max_samples_x_beams // 16, beam_size=16,
                                       sampling_method="beam-search-perturbate", seed=3)
    assert len(generated[0]) == LIMITS.max_samples_x_beams // 16


# -------------------------------------------------------------------------------- overflows
def test_huge_hiddens_and_radius_are_errors_not_empty_strings(mmb):
    encoded = infer(mmb, "mmb_hiddens", {"sequences": strings_to_tensor(["CCO", "c1ccccc1"])})
    hiddens, mask = encoded["hiddens"], encoded["mask"]
    huge = hiddens.copy()
    huge[1] = 1e38
    message = refused(mmb, "mmb_decodes", {"hiddens": huge, "mask": mask})
    assert ("hiddens in batch row(s) [1]: values up to 1e+38; the largest magnitude a decode accepts is 10000 "
            "(max_hidden_magnitude)") in message
    nan = hiddens.copy()
    nan[0, 1, 2] = np.nan
    assert "NaN or Inf values in batch row(s) [0]" in refused(mmb, "mmb_decodes", {"hiddens": nan, "mask": mask})
    message = refused(mmb, "mmb_samplings", {"sequences": strings_to_tensor(["CCO", "CCN"]),
                                             "scaled_radius": option(1e30, np.float32, rows=2)})
    assert ("input 'scaled_radius' row 0 = 1e+30 makes the perturbed hidden states of sequence(s) [0, 1] too large "
            "to decode: values up to ") in message
    long = np.zeros((1, 600, hiddens.shape[2]), dtype=np.float32)
    assert "hiddens have length 600; the maximum is 512" in refused(
        mmb, "mmb_decodes", {"hiddens": long, "mask": np.ones((1, 600), dtype=bool)})
    decoded = infer(mmb, "mmb_decodes", {"hiddens": hiddens, "mask": mask})["sequences"]
    assert decoded.shape == (2, 1)


def test_an_overflowing_request_fails_alone_in_a_batch(mmb):
    hiddens = infer(mmb, "mmb_hiddens", {"sequences": strings_to_tensor(["CCO"])})["hiddens"]
    mask = np.ones(hiddens.shape[:2], dtype=bool)
    expected = infer(mmb, "mmb_decodes", {"hiddens": hiddens, "mask": mask})["sequences"]
    barrier = threading.Barrier(8)
    results: list[dict[str, np.ndarray] | InferenceServerException | None] = [None] * 8

    def send(index):
        scale = 1e38 if index % 2 else 1.0
        barrier.wait()
        try:
            results[index] = infer(mmb, "mmb_decodes", {"hiddens": hiddens * np.float32(scale), "mask": mask})
        except InferenceServerException as err:
            results[index] = err

    threads = [threading.Thread(target=send, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, result in enumerate(results):
        if index % 2:
            assert isinstance(result, InferenceServerException) and "max_hidden_magnitude" in result.message()
        else:
            assert isinstance(result, dict), result
            np.testing.assert_array_equal(result["sequences"], expected)


# ------------------------------------------------------------------------ internal models
@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_internal_models_refuse_ids_outside_the_vocabulary(mmb, protocol):
    ids = np.array([[5, 6, 7, 1]], dtype=np.int64)
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids), "residue_mask": np.ones(ids.shape, bool)}
    for bad in (-3, 10**6):
        inputs["input_ids"] = np.array([[5, 6, bad, 1]], dtype=np.int64)
        message = refused(mmb, "mmb_encoder", inputs, protocol)
        assert f"input 'input_ids' row 0: token id {bad} at position 2 is outside the vocabulary [0, " in message
    inputs["input_ids"] = ids
    inputs["attention_mask"] = np.array([[1, 1, 2, 0]], dtype=np.int64)
    assert "input 'attention_mask' row 0: value 2 at position 2; allowed: 0 and 1" in refused(
        mmb, "mmb_encoder", inputs, protocol)
    long = np.ones((1, 600), dtype=np.int64)
    assert "600 tokens; the maximum is 512" in refused(
        mmb, "mmb_encoder", {"input_ids": long, "attention_mask": long, "residue_mask": long.astype(bool)}, protocol)

    step = _step_inputs(mmb)
    for bad in (-1, 10**6):
        step["tokens"] = np.array([[bad], [2]], dtype=np.int64)
        message = refused(mmb, "mmb_decoder_step", step, protocol)
        assert f"input 'tokens' row 0: token id {bad} is outside the vocabulary [0, " in message
    step["tokens"] = np.array([[2], [2], [2]], dtype=np.int64)
    assert "inputs 'tokens' and 'enc_mask' disagree on axis 'batch': 3 vs 2" in refused(
        mmb, "mmb_decoder_step", step, protocol)


def _step_inputs(server) -> dict[str, np.ndarray]:
    """Valid decoder-step inputs for a batch of 2 (the cross keys/values from mmb_cross_kv)."""
    hiddens = np.zeros((2, 3, 32), dtype=np.float32)
    cross = infer(server, "mmb_cross_kv", {"hiddens": hiddens})
    layers, _, heads, _, head_dim = cross["cross_k"].shape
    empty = np.zeros((layers, 2, heads, 0, head_dim), dtype=np.float32)
    return {"tokens": np.array([[2], [2]], dtype=np.int64), "enc_mask": np.ones((2, 3), dtype=bool),
            "cross_k": cross["cross_k"], "cross_v": cross["cross_v"], "past_k": empty, "past_v": empty}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_server_failures_are_internal_short_and_logged(mmb, protocol):
    """A model whose graph does not match its code (a broken deployment): INTERNAL, a short
    message, the traceback only in the server log; a BLS caller passes the callee's code and
    message on."""
    hiddens = np.zeros((1, 3, 32), dtype=np.float32)
    message = refused(mmb, "mmb_broken_cross_kv", {"hiddens": hiddens}, protocol, codes=INTERNAL)
    assert message.startswith("mmb_broken_cross_kv: internal error (") and "server log" in message
    assert "mmb_broken_cross_kv: Traceback" in mmb.log_file.read_text()
    forwarded = refused(mmb, "mmb_decodes_broken", {"hiddens": hiddens, "mask": np.ones((1, 3), bool)}, protocol,
                        codes=INTERNAL)
    assert forwarded == message


def test_a_bls_callee_refusing_its_input_is_the_clients_error(mmb):
    hiddens = infer(mmb, "mmb_hiddens", {"sequences": strings_to_tensor(["CCO"])})["hiddens"]
    message = refused(mmb, "mmb_decodes_short", {"hiddens": hiddens, "mask": np.ones(hiddens.shape[:2], bool)})
    assert message.startswith("mmb_short_step: input 'past_k': axis 'past_length' is 1; the maximum is 0"), message


# --------------------------------------------------------------------------- cancellation
def test_a_clients_deadline_ends_the_decode_and_frees_the_model(mmb):
    """Two long sampling requests (one per instance) whose client gives up after 1.5 s: the decode
    loops stop between steps, so a short request sent after them is answered at once instead of
    waiting for them (tens of seconds on this model)."""
    long = {"sequences": strings_to_tensor(["C" * 200] * 16), "num_samples": option(4, np.int32, 16),
            "beam_size": option(16, np.int32, 16),
            "sampling_method": strings_to_tensor(["beam-search-perturbate-sample"] * 16)}
    errors = []

    def give_up():
        try:
            infer(mmb, "mmb_samplings", long, client_timeout=1.5)
        except InferenceServerException as err:
            errors.append(err.status())

    threads = [threading.Thread(target=give_up) for _ in range(2)]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # the first is running on one instance before the second reaches the other
    for thread in threads:
        thread.join()
    assert errors == ["StatusCode.DEADLINE_EXCEEDED"] * 2
    start = time.monotonic()
    generated = infer(mmb, "mmb_samplings", {"sequences": strings_to_tensor(["CCO"]),
                                             "scaled_radius": option(0.0, np.float32)})["generated"]
    assert time.monotonic() - start < 5.0
    assert generated.shape == (1, 1)


# ---------------------------------------------------------------------------------- memory
def stub_memory_mb(server, model: str) -> dict[str, dict[str, float]]:
    """Per Python-backend stub process serving `model` (pid -> figures in MiB): VmRSS, and its
    heap part RssAnon (the Python backend's shared-memory pool is the rest)."""
    script = f"{server.model_repository}/{model}/1/model.py"
    stubs = {}
    for pid in procfs.pids():
        if script not in (procfs.command_line(pid) or []):
            continue
        figures = {key: procfs.status_value(pid, key) for key in ("VmRSS", "RssAnon")}
        if not any(figures.values()):
            continue  # gone meanwhile
        assert all(figures.values()), f"/proc/{pid}/status lacks VmRSS or RssAnon: {figures}"
        stubs[str(pid)] = {key: int(value.split()[0]) / 1024 for key, value in figures.items() if value}
    assert stubs, f"no stub process found for {model}"
    return stubs


def test_stub_memory_returns_after_large_requests(mmb):
    """32 sequences of 510 tokens sampled four times, then four times more: no stub keeps the peak
    of those requests on its heap (ONNX Runtime's arena kept for good, memory_arena "true", held
~170 MiB per encoder instance),
    and the second round adds nothing to the first."""
    models = ("mmb_samplings", "mmb_decoder_step", "mmb_cross_kv", "mmb_encoder")
    for _ in range(2):
        infer(mmb, "mmb_samplings", {"sequences": strings_to_tensor(["CCO", "CCN"])})
    request = {"sequences": strings_to_tensor([LONG_SMILES] * 32), "seed": option(1, np.int64, 32)}
    rounds = [{model: stub_memory_mb(mmb, model) for model in models}]
    for _ in range(2):
        for _ in range(4):
            assert infer(mmb, "mmb_samplings", request)["generated"].shape == (32, 1)
        rounds.append({model: stub_memory_mb(mmb, model) for model in models})
    before, first, second = rounds

    def growth(earlier, later, model: str, pid: str) -> tuple[float, float]:
        """(heap, total) MiB that stub `pid` gained between two readings."""
        was, now = earlier[model][pid], later[model][pid]
        return now["RssAnon"] - was["RssAnon"], now["VmRSS"] - was["VmRSS"]

    for model in models:
        for pid in second[model]:
            # The first large requests warm ONNX Runtime up once (some tens of MiB, up to ~41 on a
            # loaded host without an arena; the per-run arena (memory_arena "run") keeps ~20 MiB
            # more of its first large run: 22 against 5 MiB in process, tiny MegaMolBART encoder);
            # a kept peak is ten times that (751 MiB in process with memory_arena "true").
            heap, total = growth(before, first, model, pid)
            assert heap < 100 and total < 120, (model, rounds)
            heap, total = growth(first, second, model, pid)  # nothing more after the warm-up
            assert heap < 15 and total < 20, (model, rounds)
