"""NVIDIA's two ESM-2 forms end to end: one random ESM-2 written as a BioNeMo 2 / NeMo 2 directory
and as an nv_esm directory (the documented layouts, tests/helpers), each built with `bionemo-export
build repo` (no --model: the checkpoint names its family), served by the real tritonserver, and
compared with transformers' EsmForMaskedLM computing NVIDIA's MLP GELU (the tanh approximation):
hiddens, embeddings and log-probabilities over the alphabet."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.client import Seq2SeqClient
from bionemo_export.client.repository import RepositoryClient
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.runtime import TritonServer
from tests.helpers.nemo2_checkpoints import write_esm2_nemo2
from tests.helpers.nv_esm_checkpoints import write_nv_esm
from tests.unit.test_nv_esm import te_gelu

PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "MSLKRKNIALIPAAGIGVRFG", "AC", "LAGVSERTIDPKQNFYMHWCXBUZO"]
WRITERS = {"nemo2": lambda model, path: write_esm2_nemo2(path, model),
           "nv_esm": lambda model, path: write_nv_esm(model, path)}


@pytest.fixture(scope="module")
def source() -> transformers.EsmForMaskedLM:
    # 1024 positions: what the NeMo 2 form records (its seq_length), so both forms read back the same
    # model and the second build takes the first's graph from the run's graph cache.
    config = transformers.EsmConfig(vocab_size=33, pad_token_id=1, mask_token_id=32, hidden_size=32,
                                    num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    position_embedding_type="rotary", max_position_embeddings=1024,
                                    token_dropout=True, emb_layer_norm_before=False, layer_norm_eps=1e-5,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.random.fork_rng():
        torch.manual_seed(8)
        model = transformers.EsmForMaskedLM(config).eval()
        with torch.no_grad():  # non-trivial layer norms and biases, so a mapping mistake shows
            for name, parameter in model.named_parameters():
                if "LayerNorm" in name or "layer_norm" in name or name.endswith("bias"):
                    parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def reference(model: transformers.EsmForMaskedLM) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(hiddens, residue mask, residue-mean embeddings, log-probs over the 33 tokens) from transformers
    with transformers' own tokenizer ids (the fixed ESM-2 alphabet)."""
    vocab = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
    length = max(map(len, PROTEINS)) + 2
    ids = np.full((len(PROTEINS), length), 1)
    for row, protein in enumerate(PROTEINS):
        ids[row, : len(protein) + 2] = [0, *(vocab.index(c) for c in protein), 2]
    attention = (ids != 1).astype(np.int64)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(attention),
                    output_hidden_states=True)
    hiddens = out.hidden_states[-1].numpy()
    residues = attention.astype(bool)
    residues[:, 0] = False
    residues[np.arange(len(PROTEINS)), [len(p) + 1 for p in PROTEINS]] = False
    embeddings = (hiddens * residues[..., None]).sum(1) / residues.sum(1, keepdims=True)
    return hiddens, residues, embeddings, torch.log_softmax(out.logits, -1).numpy()


@pytest.mark.parametrize("form", list(WRITERS))
def test_served_equals_transformers(source, tmp_path, triton_install, form):
    checkpoint = WRITERS[form](source, tmp_path / form)
    # The tasks the test reads (the layers and attentions graphs would cost ~7 s of exports).
    result = CliRunner().invoke(app, ["build", "repo", "--no-optimize", "--checkpoint", str(checkpoint),
                                      "--name", "esm2", "--tasks", "embeddings,hiddens,logits",
                                      "--out", str(tmp_path / "repo"), "--backend", "python",
                                      "--max-batch-size", "8"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.read(tmp_path / "repo")
    assert manifest.family == "esm2" and manifest.checkpoint["activation"] == "gelu_tanh"
    hiddens_ref, residues, embeddings_ref, log_probs_ref = reference(te_gelu(source))
    with TritonServer(tmp_path / "repo", install=triton_install, log_file=tmp_path / "server.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with Seq2SeqClient("esm2", url) as client:
            hiddens, mask = client.seqs_to_hidden(PROTEINS)
            embeddings = client.seqs_to_embedding(PROTEINS)
        with RepositoryClient("esm2", url) as client:
            log_probs, _ = client.seqs_to_log_probs(PROTEINS)
            alphabet = client.alphabet()
    np.testing.assert_array_equal(mask, residues)
    real = np.arange(hiddens_ref.shape[1]) < np.array([len(p) + 2 for p in PROTEINS])[:, None]  # not padding
    assert np.abs(hiddens[real] - hiddens_ref[real]).max() < 1e-4
    assert np.abs(embeddings - embeddings_ref).max() < 1e-4
    columns = [4 + "LAGVSERTIDPKQNFYMHWCXBUZO".index(c) for c in alphabet]
    expected = log_probs_ref[..., columns] - np.log(np.exp(log_probs_ref[..., columns]).sum(-1, keepdims=True))
    assert np.abs(log_probs[residues] - expected[residues]).max() < 1e-4
