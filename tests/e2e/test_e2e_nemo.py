"""`.nemo` archives end to end: built with `bionemo-export build repo` (family inferred from the
archive; the ESM-2nv one tensor-parallel, merged on import), served by the real tritonserver,
compared with references independent of the import (transformers' EsmModel for ESM-2nv; the
source MegaMolBart for MegaMolBART, decodes included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import Seq2SeqClient
from bionemo_export.generation.reference import reference_decode
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.models import get_family, load_checkpoint
from bionemo_export.models.megamolbart import load_model
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.nemo_archives import (
    esm2_to_megatron,
    esm2nv_config,
    megamolbart_config,
    megamolbart_to_nemo,
    pad_rows,
    tensor_parallel_shards,
    write_nemo,
    write_nemo_ranks,
)

PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "MSLKRKNIALIPAAGIGVRFG", "AC", "LAGVSERTIDPKQNFYMHWCXBUZO"]
SMILES = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O", "CN1C=NC2=C1C(=O)N(C(=O)N2C)C", "Clc1ccc(Br)cc1I"]
MAX_DECODE = 24


@pytest.fixture(scope="module")
def esm2nv(tmp_path_factory, triton_install):
    """(HF source folder, server) for a repository built by the CLI from an ESM-2nv archive."""
    work = tmp_path_factory.mktemp("esm2nv")
    source = save_random_checkpoint("esm2", work / "hf", seed=0)
    config = transformers.EsmConfig.from_pretrained(source)
    weights = esm2_to_megatron(load_file(source / "model.safetensors"), config.num_hidden_layers,
                               config.num_attention_heads)
    # Tensor-parallel over 2 ranks, as NVIDIA trained ESM-2nv 3B: merged on import.
    for key in ("model.language_model.embedding.word_embeddings.weight", "model.lm_head.bias"):
        weights[key] = pad_rows(weights[key][:33], 256)
    shards = tensor_parallel_shards(weights, 2)
    archive = write_nemo_ranks(work / "esm2nv_tp2.nemo", {**esm2nv_config(config), "tensor_model_parallel_size": 2},
                               {f"mp_rank_{rank:02d}": shard for rank, shard in enumerate(shards)})
    # The tasks the test reads: the form's import is what is checked, not the other tasks' graphs.
    result = CliRunner().invoke(app, ["build", "repo", "--no-optimize", "--checkpoint", str(archive),
                                      "--name", "esm2nv", "--tasks", "embeddings,hiddens",
                                      "--out", str(work / "repo"), "--backend", "python", "--max-batch-size", "8"])
    assert result.exit_code == 0, result.output
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield source, server, work / "repo"


def test_esm2nv_archive_served_equals_transformers(esm2nv):
    source, server, repo = esm2nv
    manifest = Manifest.read(repo)
    assert manifest.family == "esm2"
    assert manifest.checkpoint["checkpoint_form"].endswith("merged from 2 tensor x 1 pipeline parallel ranks)")
    model = transformers.EsmModel.from_pretrained(source, add_pooling_layer=False).eval()
    batch = transformers.EsmTokenizer(vocab_file=str(source / "vocab.txt"))(PROTEINS, padding=True,
                                                                             return_tensors="pt")
    with torch.no_grad():
        reference = model(**batch).last_hidden_state.numpy()
    residues = batch["attention_mask"].numpy().astype(bool)
    residues[:, 0] = False
    residues[np.arange(len(PROTEINS)), [len(p) + 1 for p in PROTEINS]] = False  # <eos>
    pooled = (reference * residues[..., None]).sum(1) / residues.sum(1, keepdims=True)
    with Seq2SeqClient("esm2nv", f"grpc://{server.endpoints.grpc_url}") as client:
        hiddens, mask = client.seqs_to_hidden(PROTEINS)
        embeddings = client.seqs_to_embedding(PROTEINS)
    np.testing.assert_array_equal(mask, residues)
    real = batch["attention_mask"].numpy().astype(bool)
    assert np.abs(hiddens[real] - reference[real]).max() < 1e-4
    assert np.abs(embeddings - pooled).max() < 1e-4
    assert cosine_rows(embeddings, pooled).min() > 0.9999


@pytest.fixture(scope="module")
def megamolbart_nemo(tmp_path_factory, triton_install):
    """(source saved form, source MegaMolBart, imported model, server) for a repository built from a
    MegaMolBART archive."""
    work = tmp_path_factory.mktemp("megamolbart")
    folder = save_random_checkpoint("megamolbart", work / "source", seed=5)
    model, vocab, _ = load_model(folder)
    config, artifacts = megamolbart_config(model.config, vocab, nested=True)
    weights = megamolbart_to_nemo(model.state_dict(), model.config)
    # Padded vocabulary rows that would win every step if they were still there: the served
    # decodes equal the source's only because the import cut them.
    weights["enc_dec_model.tokens_head.bias"][len(vocab):] = 1e4
    archive = write_nemo(work / "megamolbart.nemo", config, weights, artifacts)
    build_repository(BuildRequest(family=None, checkpoint=archive, name="megamolbart", out=work / "repo",
                                  backend="python", max_decode_length=MAX_DECODE,
                                  serving=ServingOptions(max_batch_size=8, max_queue_delay_microseconds=0),
                                  optimize=False))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield folder, model, load_checkpoint(archive), server


def test_megamolbart_archive_served_hiddens_and_decodes(megamolbart_nemo):
    folder, source, imported, server = megamolbart_nemo
    encoded = imported.tokenizer.encode(SMILES)
    with torch.no_grad():
        reference = source.encode(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
    reference = reference.numpy()
    with Seq2SeqClient("megamolbart", f"grpc://{server.endpoints.grpc_url}") as client:
        hiddens, mask = client.seqs_to_hidden(SMILES)
        decoded = client.hidden_to_seqs(reference, encoded.residue_mask)
    np.testing.assert_array_equal(mask, encoded.residue_mask)
    assert np.abs(hiddens - reference)[mask].max() < 1e-4
    # The source model's own greedy decode (its saved form, not the import), string for string.
    source_loaded = get_family("megamolbart").load(folder)
    assert decoded == reference_decode(source_loaded, reference, encoded.residue_mask, MAX_DECODE)
