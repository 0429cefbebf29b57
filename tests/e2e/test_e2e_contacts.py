"""The contact-map task (issue 29, item 3) served by a real tritonserver: N_contacts of a tiny random
ESM-2 with a contact head, built once with the Python backend (without graph optimization) and the
default tasks: every task the checkpoint serves, contacts, layers and attentions among them, their
graphs hosted by N_encoder over one weights.bin (issue 46, item 2).

The reference is transformers' own `EsmForMaskedLM.predict_contacts` (eager attention) on the same
files, each sequence alone. Bad requests sent together with good ones fail alone, with
INVALID_ARGUMENT naming the value; `verify` compares the served maps with PyTorch, and the dev
server's PyTorch answers are the served ones. `client encode --include contacts` (item 5) stores
each record's map in bulk jobs beside its embedding, and writes them for sequences asked at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import h5py
import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.client.job_files import output_chunks
from bionemo_export.dev_server import DevModels
from bionemo_export.models import load_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint, set_contact_head
from bionemo_export.verify import verify_repository

NAME = "ct"
ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO"]
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "GVE", "MSLKRKNIALIPAAGIGVRFGXBUZO", "M" * 60]


def reference_contacts(reference, sequence: str) -> np.ndarray:
    ids = torch.tensor([[0, *(ESM_VOCAB.index(c) for c in sequence), 2]])
    with torch.no_grad():
        return reference.predict_contacts(ids, torch.ones_like(ids))[0].numpy()


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("contacts")
    checkpoint = set_contact_head(save_random_checkpoint("esm2", work / "checkpoint", seed=41), seed=42)
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                           backend="python", optimize=False))
    reference = transformers.EsmForMaskedLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with RepositoryClient(NAME, url) as client:
            yield result, checkpoint, reference, client, server, url


def test_served_contacts_equal_transformers_predict_contacts(served):
    result, _, reference, client, _, _ = served
    assert {"contacts", "layers", "attentions"} <= set(result.manifest.tasks)  # by default
    assert f"{NAME}_contacts" in result.models and not [m for m in result.models if m.endswith("_graph")]
    maps = client.predict_contacts(SEQUENCES)
    assert [m.shape for m in maps] == [(len(s), len(s)) for s in SEQUENCES]
    errors = []
    for sequence, served_map in zip(SEQUENCES, maps):
        expected = reference_contacts(reference, sequence)
        assert served_map.dtype == np.float32 and expected.std() > 0.05
        errors.append(float(np.abs(served_map - expected).max()))
    assert max(errors) <= 1e-4, errors
    # One request of several sequences: padded to the longest with 0, and the mask.
    answer = client.ask("contacts", SEQUENCES[:2])
    assert answer["contacts"].shape == (2, 22, 22) and answer["mask"].sum(1).tolist() == [22, 3]
    assert not answer["contacts"][1, 3:].any()


def _infer(url: str, sequences: list[str]):
    """One plain gRPC request to N_contacts: its (contacts, None) or (None, the error)."""
    client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    try:
        tensor = grpcclient.InferInput("sequences", [len(sequences), 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[s.encode()] for s in sequences], dtype=np.object_))
        result = client.infer(f"{NAME}_contacts", [tensor])
        assert result is not None
        return result.as_numpy("contacts"), None
    except InferenceServerException as err:
        return None, err
    finally:
        client.close()


def test_bad_requests_fail_alone_with_invalid_argument_naming_the_value(served):
    _, _, reference, _, _, url = served
    good = [["MKTAYIAKQR"], ["GVE", "MSLKRK"]] * 4
    bad = {"over the limit": ["A" * 1023], "a bad character": ["MKZ!"], "empty": ["GVE", ""]}
    batch = [*good[:3], *bad.values(), *good[3:]]
    with ThreadPoolExecutor(len(batch)) as pool:  # together, so the batcher hands several over at once
        answers = list(pool.map(lambda sequences: _infer(url, sequences), batch))
    for sequences, (contacts, error) in zip(batch, answers):
        if sequences in good:
            assert error is None, error
            assert contacts is not None
            n = len(sequences[0])
            np.testing.assert_allclose(contacts[0, :n, :n], reference_contacts(reference, sequences[0]), atol=1e-4)
        else:
            assert contacts is None and error is not None and error.status() == "StatusCode.INVALID_ARGUMENT"
    errors = {what: answers[batch.index(sequences)][1] for what, sequences in bad.items()}
    messages = {what: error.message() for what, error in errors.items() if error is not None}
    assert "sequence 0 has 1023 residues; contact maps are answered for at most 1022 (config parameter " \
           "max_residues" in messages["over the limit"]
    assert "invalid character '!' at position 3" in messages["a bad character"]
    assert "sequence 1 is empty" in messages["empty"]
    for message in messages.values():
        assert "Traceback" not in message and ".py" not in message


def test_the_health_probe_answers(served):
    from bionemo_export.client.triton import TritonClient
    from bionemo_export.runtime.probes import probe_model, public_models

    url = served[5]
    with TritonClient(url) as client:
        assert f"{NAME}_contacts" in public_models(client)
        result = probe_model(client, f"{NAME}_contacts")
    assert result.ok, result.line()


def test_the_client_raises_the_servers_message(served):
    client = served[3]
    with pytest.raises(InferenceError, match="1023 residues; contact maps are answered for at most 1022"):
        client.predict_contacts(["MKT", "A" * 1023])


def test_verify_compares_the_served_maps_with_pytorch(served, tmp_path):
    _, checkpoint, _, _, server, url = served
    checks = verify_repository(server.model_repository, checkpoint, url=url)
    contacts = [check for check in checks if check.model == f"{NAME}_contacts"]
    assert contacts and all(check.passed for check in checks), checks
    assert max(check.max_abs_error or 0.0 for check in contacts) <= 1e-4
    # Another checkpoint's head: the same served maps fail.
    other = set_contact_head(save_random_checkpoint("esm2", tmp_path / "other", seed=43), seed=44)
    wrong = [check for check in verify_repository(server.model_repository, other, url=url)
             if check.model == f"{NAME}_contacts"]
    assert wrong and not any(check.passed for check in wrong)


def test_the_dev_server_answers_what_the_repository_serves(served):
    _, checkpoint, _, client, _, _ = served
    models = DevModels(load_checkpoint(checkpoint, "esm2"))
    assert "contacts" in models.tasks
    column = np.array([[s.encode()] for s in SEQUENCES[:2]], dtype=np.object_)
    answers = models.answer("contacts", [{"sequences": column}])
    served_answer = client.ask("contacts", SEQUENCES[:2])
    np.testing.assert_allclose(answers[0]["contacts"], served_answer["contacts"], atol=1e-4)
    assert answers[0]["mask"].tolist() == served_answer["mask"].tolist()


def test_client_encode_include_contacts_stores_each_records_map_beside_its_embedding(served, tmp_path):
    """A bulk job with --include mean,contacts asks ct_embeddings and ct_contacts for the same records:
    each stored map (ragged, `contacts` / `contacts_ptr`) is what predict_contacts answers for the
    sequence alone and what transformers computes, under the record's id, in input order; records the
    server refuses (over the limit, a bad character) are listed, and a repeated sequence gets its first
    answer (from an earlier part).
    --include contacts alone into a folder stores the same maps."""
    _, _, reference, client, _, url = served
    records = [(f"p{i}", s) for i, s in enumerate(SEQUENCES)] + [("again", SEQUENCES[0]), ("long", "A" * 1023),
                                                                 ("bad", "MKZ!"), ("last", "MKTAYIAKQR")]
    good = [(i, s) for i, s in records if i not in ("long", "bad")]
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">{i} some protein\n{s}\n" for i, s in records))
    command = ["client", "encode", "-m", f"{NAME}_embeddings", "-i", str(fasta), "--chunk-size", "3",
               "--triton-url", url]
    result = CliRunner().invoke(app, [*command, "--include", "mean,contacts", "--output", str(tmp_path / "out.h5")])
    assert result.exit_code == 3, result.output  # partial: two records refused
    assert f"{len(good)} of {len(records)} records answered" in result.output
    errors = (tmp_path / "out.h5.errors.tsv").read_text()
    assert "long\t" in errors and "1023 residues" in errors and "bad\t" in errors
    saved: Any  # h5py's items are typed as a union of groups, datasets and types
    with h5py.File(tmp_path / "out.h5") as saved:
        ids = [i.decode() for i in saved["ids"][()]]
        ends, values = saved["contacts_ptr"][()], saved["contacts"][()]
        embeddings = saved["embeddings"][()]
        assert "embedding" not in saved  # no per-residue states asked for
    assert ids == [i for i, _ in good]
    served_maps = client.predict_contacts([s for _, s in good])
    starts = [0, *ends[:-1]]
    to_served, to_transformers = [], []
    for row, (_, sequence) in enumerate(good):
        stored = values[starts[row]:ends[row]].reshape(len(sequence), len(sequence))
        alone = client.predict_contacts([sequence])[0]
        np.testing.assert_allclose(served_maps[row], alone, atol=1e-4)
        to_served.append(float(np.abs(stored - alone).max()))
        to_transformers.append(float(np.abs(stored - reference_contacts(reference, sequence)).max()))
    assert max(to_served) <= 1e-4 and max(to_transformers) <= 1e-4, (to_served, to_transformers)
    np.testing.assert_allclose(embeddings, client.seqs_to_embedding([s for _, s in good]), atol=1e-5)

    alone = CliRunner().invoke(app, [*command, "--include", "contacts", "--output", str(tmp_path / "maps")])
    assert alone.exit_code == 3, alone.output
    chunks = list(output_chunks(tmp_path / "maps"))
    assert [i for chunk in chunks for i in chunk.ids] == ids and not any(chunk.pooled for chunk in chunks)
    for got, want in zip([m for chunk in chunks for m in chunk.contacts or []], served_maps, strict=True):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_client_encode_include_contacts_of_sequences_asked_at_once(served, tmp_path):
    """Outside a bulk job, --include contacts asks N_contacts and writes contacts [batch, L, L] (0-padded)
    and contacts_mask [batch, L]; a repository without N_contacts: tests/e2e/test_encode_jobs.py."""
    _, _, reference, client, _, url = served
    out = tmp_path / "maps.npz"
    result = CliRunner().invoke(app, ["client", "encode", "-m", f"{NAME}_embeddings", "--include", "contacts", "-s",
                                      SEQUENCES[0], "-s", SEQUENCES[1], "--triton-url", url, "--output", str(out)])
    assert result.exit_code == 0, result.output
    saved = np.load(out)
    assert set(saved.files) == {"contacts", "contacts_mask"}
    assert saved["contacts"].shape == (2, 22, 22) and saved["contacts_mask"].sum(1).tolist() == [22, 3]
    for row, sequence in enumerate(SEQUENCES[:2]):
        n = len(sequence)
        np.testing.assert_allclose(saved["contacts"][row, :n, :n], reference_contacts(reference, sequence), atol=1e-4)
        np.testing.assert_allclose(saved["contacts"][row, :n, :n], client.predict_contacts([sequence])[0], atol=1e-4)
