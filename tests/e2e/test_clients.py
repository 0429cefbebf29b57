"""Clients against a generated repository served by the real tritonserver (tiny random ESM-2).

BioNeMo users' ways in, unchanged: PyTriton's `ModelClient(url, "N_embeddings").infer_batch(...)`
over HTTP and gRPC, a raw KServe-v2 JSON request with urllib only; and this project's clients:
the Python client (batching by the server's max_batch_size, order, errors, big gRPC messages)
and `client encode --input` on a 1,000-record FASTA with bad records in it.
"""

from __future__ import annotations

import gzip
import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from typer.testing import CliRunner

from bionemo_export.bench.run import read_statistics
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import (
    EncoderClient,
    InferenceError,
    RepositoryClient,
    ServerUnreachableError,
    TritonClient,
    infer_rows,
)
from bionemo_export.client.batches import row_ranges
from bionemo_export.client.files import read_hiddens, write_outputs
from bionemo_export.client.records import read_records
from bionemo_export.client.repository import sampling_inputs
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.runtime import TritonServer
from bionemo_export.runtime.server import free_ports
from bionemo_export.testing.checkpoints import save_random_checkpoint

NAME = "tiny"
MAX_BATCH = 32
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
runner = CliRunner()
WIDE = {"COLUMNS": "1000"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("clients")
    # hidden 64: 32 sequences of 600 residues answer 4.9 MB of hidden states, over gRPC's 4 MiB default.
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=2, hidden_size=64)
    # The two models BioNeMo's clients call: the other tasks' graphs would cost ~12 s of exports here.
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                  tasks=("embeddings", "hiddens"), backend="python",
                                  serving=ServingOptions(max_batch_size=MAX_BATCH), optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as running:
        yield running


def _urls(server) -> dict[str, str]:
    return {"http": f"http://{server.endpoints.http_url}", "grpc": f"grpc://{server.endpoints.grpc_url}"}


def _sequences(count: int, seed: int = 0, low: int = 5, high: int = 40) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(AMINO_ACIDS), size=int(n))) for n in rng.integers(low, high, size=count)]


def _one_by_one(server, sequences: list[str]) -> np.ndarray:
    """Embeddings from one single-sequence request each: the order-independent reference."""
    with TritonClient(_urls(server)["grpc"]) as client:
        return np.concatenate([client.infer(f"{NAME}_embeddings", {"sequences": np.array([[s.encode()]], object)},
                                            ["embeddings"])["embeddings"] for s in sequences])


# ------------------------------------------------------------------------- BioNeMo's clients
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_pytriton_model_client_infer_batch(server, protocol):
    """BioNeMo's client_encode: PyTriton's ModelClient with the strings as np.char.encode makes them."""
    from pytriton.client import ModelClient

    sequences = _sequences(5, seed=1)
    batch = np.char.encode(np.array([[s] for s in sequences]), "utf-8")  # dtype S, as BioNeMo's client sends
    url = _urls(server)[protocol]
    with ModelClient(url, f"{NAME}_embeddings", init_timeout_s=60) as client:
        embeddings = client.infer_batch(sequences=batch)["embeddings"]
    with ModelClient(url, f"{NAME}_hiddens", init_timeout_s=60) as client:
        hiddens = client.infer_batch(sequences=batch)
    with RepositoryClient(NAME, url) as ours:
        np.testing.assert_allclose(embeddings, ours.seqs_to_embedding(sequences), atol=1e-5)
        ref_hiddens, ref_mask = ours.seqs_to_hidden(sequences)
    np.testing.assert_array_equal(hiddens["mask"], ref_mask)
    np.testing.assert_allclose(hiddens["hiddens"], ref_hiddens, atol=1e-5)
    np.testing.assert_allclose(embeddings, _one_by_one(server, sequences), atol=1e-5)


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_raw_kserve_v2_json_request_with_bytes_data(server):
    """What curl sends: the KServe v2 JSON protocol, strings as BYTES data, no client library."""
    sequences = _sequences(3, seed=2)
    url = f"http://{server.endpoints.http_url}/v2/models/{NAME}_embeddings/infer"
    status, answer = _post(url, {"inputs": [{"name": "sequences", "shape": [3, 1], "datatype": "BYTES",
                                             "data": sequences}],
                                 "outputs": [{"name": "embeddings"}]})
    assert status == 200, answer
    (output,) = answer["outputs"]
    assert output["name"] == "embeddings" and output["datatype"] == "FP32" and output["shape"] == [3, 64]
    np.testing.assert_allclose(np.array(output["data"], np.float32).reshape(3, 64),
                               _one_by_one(server, sequences), atol=1e-5)

    status, answer = _post(url, {"inputs": [{"name": "sequences", "shape": [1, 1], "datatype": "BYTES",
                                             "data": ["MKTJAK"]}]})
    assert status == 400 and "invalid character 'J'" in answer["error"], answer


# ---------------------------------------------------------------------- the Python client
def _stats(server, model: str, settled_at: int | None = None) -> int:
    """The requests `model` has answered so far, as `bench` reads Triton's statistics. Triton
    counts a request once its response is sent, so a count read the moment the client has its
    answer can lag (CI, 3 workers: 3 of 4): with `settled_at`, it is read again for up to 5 s
    until it reaches that number (and a count past it still shows)."""
    deadline = time.monotonic() + 5
    with TritonClient(f"grpc://{server.endpoints.grpc_url}") as client:
        while True:
            count = read_statistics(client)[model]["requests"]
            if settled_at is None or count >= settled_at or time.monotonic() > deadline:
                return count
            time.sleep(0.05)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_python_client_splits_by_the_servers_max_batch_size_and_keeps_order(server, protocol):
    sequences = _sequences(75, seed=3, high=90)
    before = _stats(server, f"{NAME}_hiddens")
    with EncoderClient(NAME, _urls(server)[protocol], in_flight=3) as client:  # the earlier name still works
        assert client.client.max_batch_size(f"{NAME}_hiddens") == MAX_BATCH
        hiddens, mask = client.seqs_to_hidden(sequences)
        embeddings = client.seqs_to_embedding(sequences)
        first_hiddens, first_mask = client.seqs_to_hidden(sequences[:MAX_BATCH])
    assert _stats(server, f"{NAME}_hiddens", settled_at=before + 4) - before == 4  # 3 requests of 32 + 1 of 32
    longest = max(map(len, sequences)) + 2
    assert hiddens.shape == (75, longest, 64) and mask.shape == (75, longest)
    np.testing.assert_array_equal(mask.sum(axis=1), [len(s) for s in sequences])
    # Joined requests read as one request: each row's length, zero beyond it.
    for row, sequence in enumerate(sequences):
        assert not hiddens[row, len(sequence) + 2:].any() and not mask[row, len(sequence) + 2:].any()
    width = first_hiddens.shape[1]
    np.testing.assert_allclose(hiddens[:MAX_BATCH, :width], first_hiddens, atol=1e-5)
    np.testing.assert_array_equal(mask[:MAX_BATCH, :width], first_mask)
    np.testing.assert_allclose(embeddings, _one_by_one(server, sequences), atol=1e-5)


def test_python_client_errors_carry_the_servers_message(server):
    sequences = _sequences(70, seed=4)
    sequences[40] = "MKTAYJAK"
    with RepositoryClient(NAME, _urls(server)["grpc"]) as client:
        with pytest.raises(InferenceError) as refused:
            client.seqs_to_embedding(sequences)
        # Sent shortest first: the 8-residue row 40 goes with the 31 other shortest rows.
        shortest = sorted(range(70), key=lambda row: len(sequences[row]))[:32]
        assert 40 in shortest
        assert "invalid character 'J'" in str(refused.value)
        assert f"rows {row_ranges(np.array(shortest))} of 70, sent as one request" in str(refused.value)
        with pytest.raises(InferenceError, match="invalid character 'J'"):
            client.seqs_to_embedding(["MKTAYJAK"])
        with pytest.raises(TypeError, match="list of sequences"):
            client.seqs_to_embedding("MKTAYIAK")
        assert client.seqs_to_embedding([]).shape == (0, 64)
        hiddens, mask = client.seqs_to_hidden([])
        assert hiddens.shape == (0, 0, 64) and mask.shape == (0, 0)
    with RepositoryClient("nosuchmodel", _urls(server)["http"]) as client:
        with pytest.raises(InferenceError, match="nosuchmodel_embeddings"):
            client.seqs_to_embedding(["MKT"])
    for scheme in ("http", "grpc"):
        url = f"{scheme}://127.0.0.1:{free_ports(1)[0]}"
        with RepositoryClient(NAME, url) as client, pytest.raises(ServerUnreachableError, match=url):
            client.seqs_to_embedding(["MKT"])


def test_grpc_answers_over_four_mib(server):
    """Hidden states of 32 long sequences (4.9 MB in one response) over gRPC: gRPC's default
    receive limit is 4 MiB; the client raises it."""
    sequences = _sequences(MAX_BATCH, seed=5, low=600, high=601)
    with RepositoryClient(NAME, _urls(server)["grpc"]) as client:
        hiddens, mask = client.seqs_to_hidden(sequences)
    assert hiddens.nbytes > 4 * 2**20 and hiddens.shape == (MAX_BATCH, 602, 64) and mask.sum() == 600 * MAX_BATCH


def test_infer_rows_isolates_refused_rows(server):
    sequences = _sequences(40, seed=6)
    bad = {3: "MKJ", 17: "", 35: "MK1"}
    for row, sequence in bad.items():
        sequences[row] = sequence
    column = np.array([[s.encode()] for s in sequences], dtype=object)
    with TritonClient(_urls(server)["grpc"], concurrency=4) as client:
        done = []
        results = infer_rows(client, f"{NAME}_embeddings", len(sequences), lambda rows, _: {"sequences": column[rows]},
                             batch_size=8, isolate=True, progress=done.append)
        stopped = infer_rows(client, f"{NAME}_embeddings", len(sequences),
                             lambda rows, _: {"sequences": column[rows]}, batch_size=8, isolate=True,
                             stop_on_failure=True)
    assert sum(done) == 40
    assert [row for row, _ in results.failures] == [3, 17, 35]
    assert "invalid character 'J'" in results.failures[0][1] and "empty" in results.failures[1][1]
    good = [row for row in range(40) if row not in bad]
    assert results.rows.tolist() == good
    np.testing.assert_allclose(results.outputs["embeddings"], _one_by_one(server, [sequences[r] for r in good]),
                               atol=1e-5)
    assert stopped.rows.tolist() == [0, 1, 2] and [row for row, _ in stopped.failures] == [3]


# ------------------------------------------------------------------------------ client CLI
def _fasta(path, records: list[tuple[str, str]]) -> None:
    lines = []
    for record_id, sequence in records:
        lines.append(f">{record_id} some description")
        lines += [sequence[i:i + 60] for i in range(0, len(sequence), 60)]
    path.write_text("\n".join(lines) + "\n")


def test_encode_a_fasta_of_1000_records_in_one_command(server, tmp_path):
    sequences = _sequences(1000, seed=7, low=3, high=80)
    records = [(f"prot{i:04d}", s) for i, s in enumerate(sequences)]
    records[10] = ("bad_char", "MKTJAK")
    records[500] = ("empty_record", "")
    records[998] = ("bad_digit", "MK7")
    _fasta(tmp_path / "proteins.fasta", records)
    out = tmp_path / "embeddings.npz"
    result = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "--input",
                                 str(tmp_path / "proteins.fasta"), "--output", str(out), "--triton-url",
                                 _urls(server)["grpc"], "--in-flight", "4"], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "997 of 1000 records answered; 3 bad records left out" in result.output
    assert "1000/1000" in result.output  # the progress bar, finished
    lines = {record_id: line for record_id, line in zip(
        [r.id for r in read_records(tmp_path / "proteins.fasta")],
        [r.line for r in read_records(tmp_path / "proteins.fasta")])}
    assert f"bad record bad_char (line {lines['bad_char']}): " in result.output
    assert "invalid character 'J'" in result.output
    assert f"bad record empty_record (line {lines['empty_record']}): no sequence" in result.output
    assert "bad record bad_digit" in result.output
    good = [(i, s) for i, s in records if s and i.startswith("prot")]
    with np.load(out, allow_pickle=False) as saved:
        assert saved["ids"].tolist() == [i for i, _ in good]
        embeddings = saved["embeddings"]
    assert embeddings.shape == (997, 64)
    spot = [0, 1, 9, 10, 499, 500, 700, 996]  # a sample, checked against one request per sequence
    np.testing.assert_allclose(embeddings[spot], _one_by_one(server, [good[i][1] for i in spot]), atol=1e-5)
    with RepositoryClient(NAME, _urls(server)["grpc"]) as client:
        np.testing.assert_allclose(embeddings, client.seqs_to_embedding([s for _, s in good]), atol=1e-5)

    # The same file gzipped, in three shards (a job array): together, every answer once, as one run gave
    compressed = tmp_path / "proteins.fasta.gz"
    compressed.write_bytes(gzip.compress((tmp_path / "proteins.fasta").read_bytes()))
    shards = {}
    for index in range(3):
        part = tmp_path / f"part{index}.npz"
        sharded = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "--input", str(compressed),
                                      "--shard", f"{index}/3", "--output", str(part), "--triton-url",
                                      _urls(server)["grpc"]], env=WIDE)
        assert sharded.exit_code == 0, sharded.output
        with np.load(part, allow_pickle=False) as saved:
            shards.update(zip(saved["ids"].tolist(), saved["embeddings"]))
    assert sorted(shards) == sorted(i for i, _ in good)
    np.testing.assert_allclose(np.stack([shards[i] for i, _ in good]), embeddings, atol=1e-5)
    bad_shard = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "--input", str(compressed),
                                    "--shard", "3/3"], env=WIDE)
    assert bad_shard.exit_code == 1 and "shard 3/3: give I/N with 0 <= I < N" in bad_shard.output

    stop = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "--input",
                               str(tmp_path / "proteins.fasta"), "--output", str(tmp_path / "stopped.npz"),
                               "--triton-url", _urls(server)["http"], "--stop-on-error"], env=WIDE)
    assert stop.exit_code == 1 and "bad record bad_char" in stop.output and "bad_digit" not in stop.output
    assert not (tmp_path / "stopped.npz").exists()


def test_encode_writes_bionemos_json_shape(server, tmp_path):
    sequences = _sequences(3, seed=8)
    out = tmp_path / "hiddens.json"
    arguments = ["client", "encode", "--model", f"{NAME}_hiddens", "--triton-url", _urls(server)["http"],
                 "--output", str(out)]
    for sequence in sequences:
        arguments += ["-s", sequence]
    result = runner.invoke(app, arguments, env=WIDE)
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert sorted(document) == ["hiddens", "mask"]  # BioNeMo's shape: {output name: nested lists}
    hiddens, mask, ids = read_hiddens(out)
    with RepositoryClient(NAME, _urls(server)["grpc"]) as client:
        ref_hiddens, ref_mask = client.seqs_to_hidden(sequences)
    np.testing.assert_array_equal(hiddens, ref_hiddens)  # JSON keeps float32 exactly
    assert mask is not None  # client encode writes the mask
    np.testing.assert_array_equal(mask, ref_mask)
    assert ids is None

    smiles_style = tmp_path / "one_per_line.txt"
    smiles_style.write_text(f"# proteins\n{sequences[0]} first\n\n{sequences[1]}\n")
    result = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "--triton-url",
                                 _urls(server)["grpc"], "--input", str(smiles_style), "--output",
                                 str(tmp_path / "e.json")], env=WIDE)
    assert result.exit_code == 0, result.output
    document = json.loads((tmp_path / "e.json").read_text())
    assert document["ids"] == ["first", "line4"] and np.array(document["embeddings"]).shape == (2, 64)

    both = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "-s", "MKT", "--input",
                               str(smiles_style)], env=WIDE)
    assert both.exit_code == 2 and "one of them" in both.output
    over = runner.invoke(app, ["client", "encode", "--model", f"{NAME}_embeddings", "-s", "MKT", "--batch-size",
                               "64", "--triton-url", _urls(server)["grpc"]], env=WIDE)
    assert over.exit_code == 1 and f"over {NAME}_embeddings's max_batch_size 32" in over.output


# ------------------------------------------------------------------ files (no server needed)
def test_hiddens_files_are_checked_and_npz_needs_no_pickle(tmp_path):
    hiddens = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    mask = np.array([[True, True, False], [True, True, True]])
    write_outputs(tmp_path / "h.json", {"hiddens": hiddens, "mask": mask})
    got, got_mask, ids = read_hiddens(tmp_path / "h.json")
    np.testing.assert_array_equal(got, hiddens)
    assert got_mask is not None
    np.testing.assert_array_equal(got_mask, mask)
    assert ids is None
    write_outputs(tmp_path / "h.npz", {"hiddens": hiddens, "strings": np.array([[b"a"], [b"\xc3\xa9"]], object)},
                  ids=["x", "y"])
    with np.load(tmp_path / "h.npz", allow_pickle=False) as saved:
        assert saved["strings"].tolist() == [["a"], ["\u00e9"]] and saved["ids"].tolist() == ["x", "y"]
    got, got_mask, ids = read_hiddens(tmp_path / "h.npz")
    assert got_mask is None and ids == ["x", "y"]
    (tmp_path / "other.json").write_text(json.dumps({"embeddings": [[1.0]]}))
    with pytest.raises(ValueError, match="has no 'hiddens' .*`in_name`"):
        read_hiddens(tmp_path / "other.json")
    (tmp_path / "ragged.json").write_text(json.dumps({"hiddens": [[[1.0]], [[1.0], [2.0]]]}))
    with pytest.raises(ValueError, match="not a rectangular array"):
        read_hiddens(tmp_path / "ragged.json")
    (tmp_path / "mismatch.json").write_text(json.dumps({"hiddens": hiddens.tolist(), "mask": [[True]]}))
    with pytest.raises(ValueError, match="'mask' shape \\[1, 1\\] does not match"):
        read_hiddens(tmp_path / "mismatch.json")


def test_sampling_inputs_give_request_i_seed_plus_i():
    extra = sampling_inputs(sampling_method="topkp-perturbate", seed=10, top_k=3, top_p=None)
    first, third = extra(np.arange(2), 0), extra(np.arange(1), 2)
    assert sorted(first) == ["sampling_method", "seed", "top_k"]
    assert first["seed"].tolist() == [[10], [10]] and third["seed"].tolist() == [[12]]
    assert first["seed"].dtype == np.int64 and first["top_k"].dtype == np.int32
    assert first["sampling_method"].tolist() == [[b"topkp-perturbate"]] * 2
    with pytest.raises(TypeError, match="unknown sampling options"):
        sampling_inputs(beams=2)
