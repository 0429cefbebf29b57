"""rxnfp's real pretrained reaction-SMILES BERT (from the rxnfp==0.1.0 wheel): a repository built
from it, served by the real tritonserver and compared with PyTorch (the model and its tokenizer
without a server: tests/unit/test_rxnfp_tokenizer.py).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import EncoderClient, InferenceError, TritonClient, strings_to_tensor
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.models.bert import rxnfp_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.serving.tokenizers.smiles import REACTION_SMILES_PATTERN
from bionemo_export.verify import verify_repository
from tests.unit.test_rxnfp_tokenizer import RXNFP_REGEX, run

MAX_BATCH = 16  # verify sends all 9 samples in one request
NAME = "rxnfp"


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install, rxnfp):
    work = tmp_path_factory.mktemp("rxnfp")
    result = build_repository(BuildRequest(
        family="bert", checkpoint=rxnfp_checkpoint(), name=NAME, out=work / "repo", backend="python",
        serving=ServingOptions(max_batch_size=MAX_BATCH, max_queue_delay_microseconds=0), optimize=False,
    ))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield server, result


def test_repository_records_the_smiles_tokenizer(served, rxnfp):
    server, result = served
    assert result.manifest.family == "bert" and result.manifest.verification["passed"]
    written = json.loads((server.model_repository / f"{NAME}_encoder" / "1" / "tokenizer.json").read_text())
    assert written == rxnfp.tokenizer.to_dict() and written["pattern"] == REACTION_SMILES_PATTERN


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_served_embeddings_and_hiddens_match_pytorch(served, rxnfp, protocol):
    server, _ = served
    url = f"{protocol}://" + (server.endpoints.http_url if protocol == "http" else server.endpoints.grpc_url)
    batch = ["CC(=O)O.OCC>>CC(=O)OCC", "CCO", "C[C@@H](N)C(=O)O.[Na+].[OH-]>>C[C@@H](N)C(=O)[O-].[Na+]"]
    ref_hiddens, ref_embeddings, encoded = run(rxnfp, batch)
    with EncoderClient(NAME, url) as client:
        embeddings = client.seqs_to_embedding(batch)
        hiddens, mask = client.seqs_to_hidden(batch)
    assert embeddings.shape == (3, 256) and hiddens.shape == ref_hiddens.shape
    assert np.abs(embeddings - ref_embeddings).max() < 1e-4
    assert cosine_rows(embeddings, ref_embeddings).min() > 0.9999
    real = encoded.attention_mask.astype(bool)
    assert np.abs(hiddens - ref_hiddens)[real].max() < 1e-4
    assert cosine_rows(hiddens[real], ref_hiddens[real]).min() > 0.9999
    np.testing.assert_array_equal(mask, encoded.residue_mask)
    assert mask.sum(1).tolist() == [len(RXNFP_REGEX.findall(s)) for s in batch]


def test_unknown_token_fails_only_its_own_request(served):
    server, _ = served
    with TritonClient(f"grpc://{server.endpoints.grpc_url}") as client:
        with pytest.raises(InferenceError, match=re.escape("sequence 1: token '[Xx]' at character 2")):
            client.infer(f"{NAME}_embeddings", {"sequences": strings_to_tensor(["CCO", "CC[Xx]O"])})
        ok = client.infer(f"{NAME}_hiddens", {"sequences": strings_to_tensor(["CC>>CO"])})
    assert ok["mask"].sum() == 5 and np.isfinite(ok["hiddens"]).all()


def test_verify_against_the_running_server_passes_with_smiles_samples(served):
    server, _ = served
    checks = verify_repository(server.model_repository, rxnfp_checkpoint(),
                               url=f"grpc://{server.endpoints.grpc_url}")
    assert checks and all(check.passed for check in checks), checks
    # bert_pretrained carries its masked-LM head, so N_logits is built and verified too (no N_scores:
    # its alphabet is SMILES tokens, not one character each); layers and attentions are default tasks
    assert {check.model for check in checks} == {f"{NAME}_{task}" for task in ("embeddings", "hiddens", "logits",
                                                                                "layers", "attentions")}
