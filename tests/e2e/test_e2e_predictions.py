"""The fine-tuned head served by a real tritonserver (issue 17, part 4): N_predictions of tiny random
BertForSequenceClassification and EsmForTokenClassification checkpoints, built with the Python
backend; logits against transformers' own classes on the same files, labels against their argmax."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.models import get_family
from bionemo_export.models.bert import ANTIBERTY_VOCAB
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.unit.test_classifier_head_pytorch import make

LABELS = {0: "binder", 1: "non-binder", 2: "weak"}
PROTEINS = ["MKTAYIAKQR", "EVQLVESGGGLVQPGGSLRLSCAAS", "GVSE"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("predictions")
    seq_model, seq_dir = make("bert-sequence", work / "seq", seed=7, num_labels=3, id2label=LABELS,
                              label2id={v: k for k, v in LABELS.items()})
    tok_model, tok_dir = make("esm-token", work / "tok", seed=8, num_labels=4)
    results: dict[str, Any] = {  # the two build results, and (below) the checkpoint folders
        "seq": build_repository(BuildRequest(family="bert", checkpoint=seq_dir, name="seq", out=work / "repo",
                                             backend="python", optimize=False)),
        # The default tasks of a fine-tuned checkpoint are checked on "seq"; "tok" serves what its tests read
        # (its contacts, layers and attentions graphs would cost ~9 s of exports).
        "tok": build_repository(BuildRequest(family="esm2", checkpoint=tok_dir, name="tok", out=work / "repo2",
                                             tasks=("embeddings", "predictions"), backend="python", optimize=False)),
    }
    # one server, both repositories' models
    for model in (work / "repo2").iterdir():
        if model.is_dir():
            model.rename(work / "repo" / model.name)
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with RepositoryClient("seq", url) as seq, RepositoryClient("tok", url) as tok:
            results["dirs"] = {"seq": seq_dir, "tok": tok_dir}
            yield results, {"seq": (seq_model, seq), "tok": (tok_model, tok)}


def reference(model, client_tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([client_tokens]), attention_mask=torch.ones(1, len(client_tokens),
                                                                                        dtype=torch.long)).logits[0]


def test_a_fine_tuned_checkpoint_builds_the_predictions_models(served):
    results, _ = served
    assert {"seq_classifier", "seq_labels", "seq_predictions"} <= set(results["seq"].models)
    assert results["seq"].manifest.tasks == ["embeddings", "hiddens", "predictions", "layers", "attentions"]
    assert "tok_predictions" in results["tok"].manifest.public_models


def test_served_sequence_logits_and_labels_equal_transformers(served):
    _, clients = served
    model, client = clients["seq"]
    assert client.labels() == ("binder", "non-binder", "weak")
    out = client.predict(PROTEINS)
    assert out["logits"].dtype == np.float32 and out["logits"].shape == (3, 3)
    vocab = ANTIBERTY_VOCAB
    for row, protein in enumerate(PROTEINS):
        ids = [vocab.index("[CLS]"), *(vocab.index(c) for c in protein), vocab.index("[SEP]")]
        expected = reference(model, ids).numpy()
        np.testing.assert_allclose(out["logits"][row], expected, atol=1e-4)
        assert out["label"][row] == LABELS[int(np.argmax(expected))]


def test_served_token_logits_mask_and_labels_equal_transformers(served):
    _, clients = served
    model, client = clients["tok"]
    from bionemo_export.models.esm2 import ALPHABET

    assert client.labels() == tuple(f"LABEL_{i}" for i in range(4))
    out = client.predict(PROTEINS)
    length = max(map(len, PROTEINS)) + 2
    assert out["logits"].shape == (3, length, 4) and out["mask"].shape == (3, length)
    for row, protein in enumerate(PROTEINS):
        ids = [0, *(ALPHABET.index(c) for c in protein), 2]
        expected = reference(model, ids).numpy()
        np.testing.assert_allclose(out["logits"][row, :len(ids)], expected, atol=1e-4)
        assert out["mask"][row].tolist() == [False] + [True] * len(protein) + [False] * (length - len(protein) - 1)
        assert out["label"][row][:len(ids)] == [f"LABEL_{i}" for i in np.argmax(expected, axis=-1)]


def test_a_bad_sequence_is_invalid_argument_and_the_server_carries_on(served):
    _, clients = served
    _, client = clients["seq"]
    with pytest.raises(InferenceError, match="INVALID_ARGUMENT|invalid|not"):
        client.predict(["MK1TAY"])
    assert client.predict(["MKTAY"])["logits"].shape == (1, 3)


def test_asking_for_predictions_without_a_fine_tuned_head_names_the_checkpoint(tmp_path):
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint")
    with pytest.raises(BuildError, match=f"{checkpoint} has no fine-tuned head"):
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="x", out=tmp_path / "repo",
                                      backend="python", tasks=("predictions",), optimize=False))


@pytest.mark.parametrize("which, family", [("seq", "bert"), ("tok", "esm2")])
def test_verify_checks_served_logits_and_labels_against_pytorch(served, which, family):
    from bionemo_export.kits.predictions import verify_predictions

    results, clients = served
    loaded = get_family(family).load(results["dirs"][which])
    samples = loaded.family.sample_sequences()
    checks = verify_predictions(clients[which][1], loaded, ["predictions"], [samples, samples[:1]], (1e-4, 0.9999))
    assert len(checks) == 2 and all(check.passed for check in checks), checks


@pytest.mark.slow
def test_rxnfps_real_fine_tuned_classifier_served_equals_transformers(tmp_path, triton_install):
    """rxnfp's bert_ft_10k_25s (50 reaction classes, 2 named in its config) built and served: logits
    equal transformers' BertForSequenceClassification on the same files, token ids written out from
    the package's SMILES tokenizer (checked against rxnfp's regex in test_rxnfp), and labels are the
    argmax's names (LABEL_i for the unnamed)."""
    from bionemo_export.models.bert import rxnfp_checkpoint

    checkpoint = rxnfp_checkpoint("bert_ft_10k_25s")
    build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="rx", out=tmp_path / "repo",
                                  backend="python", tasks=("predictions",), optimize=False))
    reactions = ["CC(=O)O.OCC>>CC(=O)OCC", "c1ccccc1Br.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1"]
    encoded = get_family("bert").load(checkpoint).tokenizer.encode(reactions)
    reference = transformers.BertForSequenceClassification.from_pretrained(checkpoint).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(encoded.input_ids),
                             attention_mask=torch.from_numpy(encoded.attention_mask)).logits.numpy()
    with TritonServer(tmp_path / "repo", install=triton_install, log_file=tmp_path / "server.log") as server:
        with RepositoryClient("rx", f"grpc://{server.endpoints.grpc_url}") as client:
            answer = client.predict(reactions)
            labels = client.labels()
    assert len(labels) == 50
    np.testing.assert_allclose(answer["logits"], expected, atol=1e-4)
    assert answer["label"] == [labels[i] for i in expected.argmax(axis=1)]
