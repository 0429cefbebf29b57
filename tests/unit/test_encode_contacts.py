"""`client encode --include contacts` without a server (client/jobs.py, pooling.py, job_files.py,
batches.py): a bulk job asks a made-up repository's N_contacts beside its encoder (or alone), stores
each record's [L, L] map ragged in every output that holds them, keeps ids and maps together when
one model refuses a record or a sequence repeats, and refuses a repository without N_contacts
naming the model and the fix. (Against a real tritonserver: tests/e2e/test_e2e_contacts.py.)"""

from __future__ import annotations

import math
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bionemo_export.client.batches import RowResults, answered_together
from bionemo_export.client.job_files import h5py_module, output_chunks, read_part, write_hdf5, write_part
from bionemo_export.client.jobs import EncodeJob
from bionemo_export.client.pooling import Include, served_contacts_model
from bionemo_export.client.repository import contact_map
from bionemo_export.client.triton import InferenceError, ModelNotServedError
from bionemo_export.errors import InvalidInputError

HIDDENS = {"hiddens", "mask"}
MAX_RESIDUES = 12
"""The made-up N_contacts' limit (a real one's is its max_residues parameter)."""


def _map(sequence: str) -> np.ndarray:
    """The made-up contact map of `sequence`: [L, L], symmetric, different for every sequence."""
    codes = np.array([ord(c) for c in sequence], dtype=np.float32) / 100.0
    return np.outer(codes, codes) + np.arange(len(sequence), dtype=np.float32)[:, None] / 1000.0


def _embedding(sequence: str) -> np.ndarray:
    return np.array([len(sequence), sum(map(ord, sequence)), ord(sequence[0])], dtype=np.float32)


class FakeRepository:
    """`ex_embeddings`, `ex_layers` (its mean only) and (unless `contacts` is False) `ex_contacts` of
    made-up answers, as a TritonClient serves them: two rows a request, a contact map refused over
    MAX_RESIDUES, a bad character refused by every model, every request recorded as (model, sequences)."""

    def __init__(self, contacts: bool = True) -> None:
        self.models = {"ex_embeddings": ["embeddings"], "ex_layers": ["embeddings"],
                       **({"ex_contacts": ["contacts", "mask"]} if contacts else {})}
        self.asked: list[tuple[str, list[str]]] = []

    def submit(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> Future:
        sequences = [value.decode() for value in inputs["sequences"][:, 0]]
        self.asked.append((model, sequences))
        if model == "ex_layers":
            assert inputs["include"].tolist() == [[b"mean"]] * len(sequences), inputs
        future: Future = Future()
        try:
            future.set_result(self._answer(model, sequences))
        except InferenceError as err:
            future.set_exception(err)
        return future

    def _answer(self, model: str, sequences: list[str]) -> dict[str, np.ndarray]:
        for row, sequence in enumerate(sequences):
            if "!" in sequence:
                raise InferenceError(f"{model}: sequence {row}: invalid character '!'")
            if model == "ex_contacts" and len(sequence) > MAX_RESIDUES:
                raise InferenceError(f"{model}: sequence {row} has {len(sequence)} residues; contact maps are answered "
                                     f"for at most {MAX_RESIDUES}")
        if model == "ex_embeddings":
            return {"embeddings": np.stack([_embedding(s) for s in sequences])}
        if model == "ex_layers":  # [rows, layers, H]: the last layer's mean, as `--include mean` asks
            return {"embeddings": np.stack([_embedding(s) for s in sequences])[:, None]}
        longest = max(map(len, sequences))
        contacts = np.zeros((len(sequences), longest, longest), dtype=np.float32)
        mask = np.zeros((len(sequences), longest), dtype=bool)
        for row, sequence in enumerate(sequences):
            contacts[row, :len(sequence), :len(sequence)] = _map(sequence)
            mask[row, :len(sequence)] = True
        return {"contacts": contacts, "mask": mask}

    def max_batch_size(self, model: str) -> int:
        return 2

    def __enter__(self) -> FakeRepository:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def model_config(self, model: str) -> dict:
        if model not in self.models:
            raise ModelNotServedError(f"{model}: the server at grpc://x:8001 does not serve it now (Request for "
                                      f"unknown model: '{model}' is not found)")
        return {"name": model, "max_batch_size": 2, "output": [{"name": name} for name in self.models[model]],
                "parameters": {"num_layers": {"string_value": "1"}} if model == "ex_layers" else {}}


RECORDS = [("a", "MKTAYIAK"), ("b", "GVE"), ("long", "M" * (MAX_RESIDUES + 1)), ("a2", "MKTAYIAK"), ("bad", "MK!"),
           ("c", "MSLKRKNIA")]


def _fasta(path: Path) -> Path:
    path.write_text("".join(f">{i}\n{s}\n" for i, s in RECORDS))
    return path


def _stored(output: Path) -> tuple[list[str], list[np.ndarray], dict[str, np.ndarray]]:
    """(ids, contact maps, pooled rows) of a finished output, read back as `client merge` reads it."""
    ids, maps, pooled = [], [], {}
    for chunk in output_chunks(output, rows=2):
        ids += chunk.ids
        maps += chunk.contacts or []
        for key, rows in chunk.pooled.items():
            pooled[key] = np.concatenate([pooled[key], rows]) if key in pooled else rows
    return ids, maps, pooled


@pytest.mark.parametrize("output", ["out.h5", "out"])
def test_mean_and_contacts_are_stored_per_record_from_two_models(tmp_path, output):
    """--include mean,contacts: each sequence sent once to each model; a record either model refuses
    (over N_contacts' limit; a bad character) is listed and left out of both; a repeated sequence gets
    a copy of the first answer's map, also across parts (chunks of 2)."""
    server = FakeRepository()
    job = EncodeJob(model="ex_embeddings", input=_fasta(tmp_path / "in.fasta"), output=tmp_path / output,
                    include="mean,contacts", chunk_size=2)
    summary = job.run(server)
    good = [(i, s) for i, s in RECORDS if i not in ("long", "bad")]
    assert (summary.answered, summary.errors, summary.sent) == (4, 2, 5)  # a2 repeats a: not sent again
    ids, maps, pooled = _stored(tmp_path / output)
    assert ids == [i for i, _ in good]
    assert [m.shape for m in maps] == [(len(s), len(s)) for _, s in good]
    for (_, sequence), stored in zip(good, maps):
        np.testing.assert_array_equal(stored, _map(sequence))
    np.testing.assert_array_equal(pooled["mean"], np.stack([_embedding(s) for _, s in good]))
    errors = job.errors_path.read_text()
    assert "long\t" in errors and f"at most {MAX_RESIDUES}" in errors and "bad\t" in errors
    # a2 repeats a, from the part before: neither model asked again. Twice all the same: the first
    # record is also the probe the job's identity check asks each model at start (job_identity.py).
    for model in ("ex_embeddings", "ex_contacts"):
        assert [s for asked, sequences in server.asked if asked == model for s in sequences].count("MKTAYIAK") == 2


def test_an_n_layers_job_stores_the_maps_beside_the_layers_poolings(tmp_path):
    """--layers -1 --include mean,contacts (the CLI names the repository's N_layers as the job's model):
    the N_contacts beside it is asked for the maps."""
    job = EncodeJob(model="ex_layers", input=_fasta(tmp_path / "in.fasta"), output=tmp_path / "out.h5",
                    include="mean,contacts", layers="-1")
    server = FakeRepository()
    job.run(server)
    assert {model for model, _ in server.asked} == {"ex_layers", "ex_contacts"}
    ids, maps, pooled = _stored(tmp_path / "out.h5")
    good = [(i, s) for i, s in RECORDS if i not in ("long", "bad")]
    assert ids == [i for i, _ in good] and set(pooled) == {"mean"}
    np.testing.assert_array_equal(pooled["mean"], np.stack([_embedding(s) for _, s in good]))
    for (_, sequence), stored in zip(good, maps, strict=True):
        np.testing.assert_array_equal(stored, _map(sequence))


def test_contacts_alone_ask_no_encoder_and_the_fingerprint_names_them(tmp_path):
    server = FakeRepository()
    job = EncodeJob(model="ex_embeddings", input=_fasta(tmp_path / "in.fasta"), output=tmp_path / "maps.h5",
                    include="contacts", chunk_size=4)
    job.run(server)
    assert {model for model, _ in server.asked} == {"ex_contacts"}
    ids, maps, pooled = _stored(tmp_path / "maps.h5")
    assert ids == ["a", "b", "a2", "c"] and not pooled and len(maps) == 4
    with h5py_module().File(tmp_path / "maps.h5") as handle:
        assert set(handle) == {"ids", "index", "sequence_sha256", "contacts", "contacts_ptr"}
        assert handle["contacts_ptr"][()].tolist() == np.cumsum([64, 9, 64, 81]).tolist()
        fingerprint = handle.attrs["fingerprint"]
    assert '"include": "contacts"' in fingerprint and "contacts_model_config_sha256" in fingerprint
    # -m N_contacts itself: its maps are the default
    direct = EncodeJob(model="ex_contacts", input=tmp_path / "in.fasta", output=tmp_path / "direct.h5")
    direct.run(server)
    assert all(np.array_equal(x, y) for x, y in zip(_stored(tmp_path / "direct.h5")[1], maps, strict=True))


def test_a_repository_without_n_contacts_is_refused_before_anything_is_sent(tmp_path):
    server = FakeRepository(contacts=False)
    job = EncodeJob(model="ex_embeddings", input=_fasta(tmp_path / "in.fasta"), output=tmp_path / "out.h5",
                    include="mean,contacts")
    with pytest.raises(InvalidInputError, match=r"--include contacts asks ex_contacts, which the server does not "
                                                r"serve: build the repository with --tasks \.\.\.,contacts"):
        job.run(server)
    assert not server.asked and not (tmp_path / "out.h5").exists() and not job.work.exists()
    assert served_contacts_model(FakeRepository(), "ex_hiddens") == "ex_contacts"
    parquet = EncodeJob(model="ex_embeddings", input=tmp_path / "in.fasta", output=tmp_path / "out.parquet",
                        include="mean,contacts")
    with pytest.raises(InvalidInputError, match="Parquet holds pooled rows .* contact maps in an .h5 file"):
        parquet.run(FakeRepository())


def test_include_parses_contacts_beside_the_encoders_choices():
    both = Include.parse("contacts, mean", {"embeddings"}, "m_embeddings")
    assert both == Include(("mean",), False, "m_embeddings", contacts=True) and both.encodes
    assert both.text() == "mean,contacts"
    alone = Include.parse("contacts", {"log_probs", "mask"}, "m_logits")  # no encoder asked: any -m of the repository
    assert alone.contacts and not alone.encodes and alone.text() == "contacts"
    assert Include.parse(None, {"contacts", "mask"}, "m_contacts") == Include((), False, "m_contacts", contacts=True)
    assert Include.parse("max,per_tok,contacts", HIDDENS, "m_hiddens").text() == "max,per_tok,contacts"
    assert Include.parse("mean", {"embeddings"}, "m").text() == "mean"  # jobs without maps: fingerprints unchanged
    with pytest.raises(InvalidInputError, match=r"m_contacts answers contact maps only; name the repository's encoder "
                                                r"with -m \(e.g. m_embeddings or m_hiddens\) for mean"):
        Include.parse("mean,contacts", {"contacts", "mask"}, "m_contacts")
    with pytest.raises(InvalidInputError, match=r"m_embeddings answers mean-pooled embeddings only; ask its N_hiddens "
                                                r"sibling \(e.g. m_hiddens\) for bos$"):
        Include.parse("bos,contacts", {"embeddings"}, "m_embeddings")
    with pytest.raises(InvalidInputError, match="choose among mean, bos, max, per_tok, contacts"):
        Include.parse("contact", HIDDENS, "m_hiddens")
    layers = Include.for_layers("contacts,bos", "20,-1", 33, "m_layers")
    assert layers.poolings == ("bos",) and layers.contacts and layers.text() == "bos,contacts;layers=20,33"
    with pytest.raises(InvalidInputError, match="name a pooling of those layers .* beside contacts"):
        Include.for_layers("contacts", "20", 33, "m_layers")


def test_contact_maps_round_trip_ragged_through_parts_files_and_merges(tmp_path):
    from bionemo_export.client.job_files import Chunk, read_rows

    lengths = [3, 1, 5, 2]
    sequences = ["".join("ACDEFG"[i % 6] for i in range(n)) for n in lengths]
    maps = [_map(s) for s in sequences]
    chunk = Chunk(ids=list("wxyz"), index=[0, 1, 2, 3], digests=[f"{i:064x}" for i in range(4)],
                  pooled={"mean": np.ones((4, 2), np.float32)}, contacts=maps)
    write_part(tmp_path / "part.h5", chunk, np.dtype(np.float32))
    back = read_part(tmp_path / "part.h5")
    assert back.contacts is not None and back.residues is None
    for got, want in zip(back.contacts, maps, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(read_rows(tmp_path / "part.h5", [2])[2].contacts[0], maps[2])  # pyright: ignore[reportOptionalSubscript]
    assert [len(m) for m in Chunk.joined([chunk.rows([3]), chunk.rows([0, 1])]).contacts or []] == [2, 3, 1]
    # Two parts into one fp16 file: the pointers run on across parts; read back in blocks across them.
    write_hdf5([chunk.rows([0, 1]), chunk.rows([2, 3])], tmp_path / "all.h5", {}, np.dtype(np.float16))
    handle: Any
    with h5py_module().File(tmp_path / "all.h5") as handle:
        assert handle["contacts"].dtype == np.float16
        assert handle["contacts_ptr"][()].tolist() == np.cumsum([n * n for n in lengths]).tolist()
    blocks = list(output_chunks(tmp_path / "all.h5", rows=3))
    again = [m for block in blocks for m in block.contacts or []]
    for got, want in zip(again, maps, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-3)
    assert math.isqrt(again[2].size) == 5


def test_answers_of_two_models_are_kept_to_the_rows_both_answered():
    first = RowResults(np.array([0, 1, 3]), {"embeddings": np.array([[0.0], [1.0], [3.0]])}, [(2, "bad character")])
    second = RowResults(np.array([0, 2, 3]), {"contacts": np.arange(3 * 4).reshape(3, 2, 2)},
                        [(1, "too long"), (2, "not this one")])
    kept_first, kept_second = answered_together([first, second])
    assert kept_first.rows.tolist() == kept_second.rows.tolist() == [0, 3]
    assert kept_first.outputs["embeddings"].tolist() == [[0.0], [3.0]]
    np.testing.assert_array_equal(kept_second.outputs["contacts"], second.outputs["contacts"][[0, 2]])
    assert kept_first.failures == kept_second.failures == [(1, "too long"), (2, "bad character")]
    (alone,) = answered_together([first])
    assert alone.rows.tolist() == [0, 1, 3] and alone.failures == first.failures


def test_a_contact_map_is_its_rows_own_block_of_the_padded_answer():
    answer = FakeRepository()._answer("ex_contacts", ["MKT", "GVEAK"])
    np.testing.assert_array_equal(contact_map(answer, 0), _map("MKT"))
    assert contact_map(answer, 1).flags.c_contiguous and contact_map(answer, 1).shape == (5, 5)


def test_sequences_asked_at_once_get_the_layers_mean_and_the_maps_from_two_models(tmp_path, monkeypatch):
    """Outside a bulk job, --include mean,contacts asks N_layers for the mean and N_contacts for the
    maps, written as contacts / contacts_mask beside embeddings, rows lined up with the ids of the
    records both models answered; those either refuses are named and left out."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    server = FakeRepository()
    monkeypatch.setattr("bionemo_export.client.TritonClient", lambda url, **options: server)
    out = tmp_path / "out.npz"
    result = CliRunner().invoke(app, ["client", "encode", "-m", "ex_embeddings", "--include", "mean,contacts", "-i",
                                      str(_fasta(tmp_path / "in.fasta")), "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert "bad record long" in result.output and "bad record bad" in result.output
    assert {model for model, _ in server.asked} == {"ex_layers", "ex_contacts"}
    saved = np.load(out)
    good = [(i, s) for i, s in RECORDS if i not in ("long", "bad")]
    assert saved["ids"].tolist() == [i for i, _ in good]
    assert set(saved.files) == {"ids", "embeddings", "contacts", "contacts_mask"}
    np.testing.assert_array_equal(saved["embeddings"][:, 0], np.stack([_embedding(s) for _, s in good]))
    assert saved["contacts_mask"].sum(axis=1).tolist() == [len(s) for _, s in good]
    for row, (_, sequence) in enumerate(good):
        np.testing.assert_array_equal(contact_map({"contacts": saved["contacts"], "mask": saved["contacts_mask"]},
                                                  row), _map(sequence))
