"""What real `.nemo` files vary, each written from small random models by the documented layouts
(docs/reference/checkpoint-layouts.md; converters in tests/helpers/nemo_archives.py) and imported to
a model whose outputs equal the source's: MegaMolBART's three output heads, NeMo's GELU setting
precedence, TransformerEngine `_extra_state` entries, `megatron_legacy` QKV/KV, the
`megatron_amp_O2` `.module.` infix, and tensor- and pipeline-parallel archives merged on import."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

from bionemo_export.models import load_checkpoint
from bionemo_export.models.megamolbart import MegaMolBart, load_model
from bionemo_export.models.megatron import fused_bias_gelu
from bionemo_export.models.readers import CheckpointError, read_checkpoint
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.nemo_archives import (
    amp_o2_keys,
    esm2_to_megatron,
    esm2nv_config,
    legacy_qkv,
    megamolbart_config,
    megamolbart_to_nemo,
    pad_rows,
    pipeline_stages,
    tensor_parallel_shards,
    write_nemo,
    write_nemo_ranks,
)
from tests.unit.test_nemo_import import PROTEINS, hf_reference, run_encoder

HEADS = 4
LAYERS = 4
SMILES = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O", "Clc1ccc(Br)cc1I"]


# ------------------------------------------------------------------------------------ ESM-2nv
@pytest.fixture(scope="module")
def esm2_source(tmp_path_factory) -> Path:
    return save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2"), seed=7, hidden_size=64,
                                  num_layers=LAYERS, num_heads=HEADS, intermediate_size=96)


@pytest.fixture(scope="module")
def esm2_megatron(esm2_source) -> tuple[dict, dict]:
    """(single-rank ESM-2nv weights, model_config.yaml) of the source."""
    config = transformers.EsmConfig.from_pretrained(esm2_source)
    return esm2_to_megatron(load_file(esm2_source / "model.safetensors"), LAYERS, HEADS), esm2nv_config(config)


@pytest.fixture(scope="module")
def esm2_expected(esm2_source):
    return hf_reference(esm2_source, PROTEINS)


def assert_equals_source(archive: Path, expected) -> object:
    loaded = load_checkpoint(archive)
    hiddens, embeddings, encoded = run_encoder(loaded, PROTEINS)
    real = encoded.attention_mask.astype(bool)
    np.testing.assert_allclose(hiddens[real], expected[0][real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(embeddings, expected[1], atol=1e-5, rtol=0)
    return loaded


def lm_log_probs(loaded) -> torch.Tensor:
    encoded = loaded.tokenizer.encode(PROTEINS)
    with torch.no_grad():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in
                                      (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        return loaded.lm_head(hiddens)


def test_extra_state_entries_are_skipped_and_reported(esm2_megatron, esm2_expected, tmp_path):
    weights, config = esm2_megatron
    extra = {
        "model.language_model.encoder.layers.0.self_attention.core_attention._extra_state": io.BytesIO(b"fp8 meta"),
        "model.language_model.encoder.layers.1.mlp.dense_h_to_4h._extra_state": torch.tensor([1, 2], dtype=torch.uint8),
        "model.language_model.encoder.layers.1.self_attention.dense._extra_state": None,
    }
    archive = write_nemo(tmp_path / "extra.nemo", config, {**weights, **extra})
    assert set(read_checkpoint(archive).skipped) == set(extra)
    assert_equals_source(archive, esm2_expected)


def test_megatron_legacy_qkv_is_regrouped_per_head(esm2_megatron, esm2_expected, tmp_path):
    weights, config = esm2_megatron
    archive = write_nemo(tmp_path / "legacy.nemo", {**config, "megatron_legacy": True}, legacy_qkv(weights, HEADS))
    assert_equals_source(archive, esm2_expected)
    # the same weights read as per-head (no flag) compute something else: the layout matters
    wrong = load_checkpoint(write_nemo(tmp_path / "wrong.nemo", config, legacy_qkv(weights, HEADS)))
    assert np.abs(run_encoder(wrong, PROTEINS)[1] - esm2_expected[1]).max() > 1e-3


def test_megatron_amp_o2_module_infix_is_dropped(esm2_megatron, tmp_path):
    weights, config = esm2_megatron
    o2 = amp_o2_keys(weights)
    assert all(".module." in key for key in o2)
    loaded = load_checkpoint(write_nemo(tmp_path / "o2.nemo", {**config, "megatron_amp_O2": True}, o2))
    reference = load_checkpoint(write_nemo(tmp_path / "plain.nemo", config,
                                           {k: v if "inv_freq" in k else v.to(torch.bfloat16).float()
                                            for k, v in weights.items()}))
    np.testing.assert_array_equal(run_encoder(loaded, PROTEINS)[0], run_encoder(reference, PROTEINS)[0])


def padded(weights: dict, multiple: int) -> dict:
    """Vocabulary rows padded to `multiple` (128 x tensor-parallel size, as NeMo pads them)."""
    out = dict(weights)
    for key in ("model.language_model.embedding.word_embeddings.weight", "model.lm_head.bias"):
        out[key] = pad_rows(weights[key][:33], multiple)
    return out


@pytest.mark.parametrize("legacy", [False, True])
def test_tensor_parallel_esm2nv_is_merged(esm2_megatron, esm2_expected, tmp_path, legacy):
    weights, config = esm2_megatron
    shards = tensor_parallel_shards(padded(weights, 256), 2)
    if legacy:  # each rank stores its own heads the legacy way
        shards = [legacy_qkv(shard, HEADS // 2) for shard in shards]
    archive = write_nemo_ranks(tmp_path / "tp2.nemo", {**config, "tensor_model_parallel_size": 2,
                                                       "megatron_legacy": legacy},
                               {f"mp_rank_{rank:02d}": shard for rank, shard in enumerate(shards)})
    checkpoint = read_checkpoint(archive)
    assert checkpoint.parallel == {"tensor": 2, "pipeline": 1}
    assert checkpoint.weights["model.language_model.embedding.word_embeddings.weight"].shape[0] == 256
    loaded = assert_equals_source(archive, esm2_expected)
    single = load_checkpoint(write_nemo(tmp_path / "one.nemo", config, weights))
    torch.testing.assert_close(lm_log_probs(loaded), lm_log_probs(single), atol=0, rtol=0)


def test_tensor_and_pipeline_parallel_esm2nv_is_merged(esm2_megatron, esm2_expected, tmp_path):
    weights, config = esm2_megatron
    stages = pipeline_stages(padded(weights, 256), [1, 3])
    ranks = {f"tp_rank_{tp:02d}_pp_rank_{pp:03d}": shard
             for pp, stage in enumerate(stages) for tp, shard in enumerate(tensor_parallel_shards(stage, 2))}
    archive = write_nemo_ranks(tmp_path / "tp2pp2.nemo", {**config, "tensor_model_parallel_size": 2,
                                                          "pipeline_model_parallel_size": 2}, ranks)
    checkpoint = read_checkpoint(archive)
    assert checkpoint.parallel == {"tensor": 2, "pipeline": 2}
    assert "model.word_embeddings.weight" in checkpoint.skipped
    layers = {int(k.split("layers.")[1].split(".")[0]) for k in checkpoint.weights if "layers." in k}
    assert sorted(layers) == [0, 1, 2, 3]
    assert_equals_source(archive, esm2_expected)


def rank_archive(tmp_path: Path, config: dict, ranks: dict) -> Path:
    return write_nemo_ranks(tmp_path / "bad.nemo", config, ranks)


def test_model_parallel_errors_name_the_rank_folder_and_key(esm2_megatron, tmp_path):
    weights, config = esm2_megatron
    tp = {**config, "tensor_model_parallel_size": 2}
    shards = tensor_parallel_shards(padded(weights, 256), 2)
    with pytest.raises(CheckpointError, match=r"says tensor_model_parallel_size 2, but the archive has 1 tensor ranks"):
        read_checkpoint(rank_archive(tmp_path, tp, {"mp_rank_00": shards[0]}))
    grid = {"tp_rank_00_pp_rank_000": shards[0], "tp_rank_01_pp_rank_000": shards[1],
            "tp_rank_00_pp_rank_001": shards[0]}
    with pytest.raises(CheckpointError, match=r"has no tp_rank_01_pp_rank_001/ .*incomplete"):
        read_checkpoint(rank_archive(tmp_path, config, grid))
    key = "model.language_model.encoder.layers.0.input_layernorm.weight"
    differing = {**shards[1], key: shards[1][key] + 1}
    with pytest.raises(CheckpointError, match=rf"mp_rank_01/{key} differs from mp_rank_00/'s"):
        read_checkpoint(rank_archive(tmp_path, tp, {"mp_rank_00": shards[0], "mp_rank_01": differing}))
    lacking = {k: v for k, v in shards[1].items() if k != key}
    with pytest.raises(CheckpointError, match=rf"mp_rank_01/ lacks {key}, which mp_rank_00/ has"):
        read_checkpoint(rank_archive(tmp_path, tp, {"mp_rank_00": shards[0], "mp_rank_01": lacking}))
    qkv = "model.language_model.encoder.layers.0.self_attention.query_key_value.weight"
    narrow = {**shards[1], qkv: shards[1][qkv][:-1]}
    with pytest.raises(CheckpointError, match=rf"mp_rank_01/{qkv} is \(95, 64\), but mp_rank_00/'s is \(96, 64\)"):
        read_checkpoint(rank_archive(tmp_path, tp, {"mp_rank_00": shards[0], "mp_rank_01": narrow}))
    stages = pipeline_stages(weights, [2, 2])
    rotary = "model.language_model.rotary_pos_emb.inv_freq"
    stages[1][rotary] = stages[1][rotary] * 2
    ranks = {f"tp_rank_00_pp_rank_{p:03d}": s for p, s in enumerate(stages)}
    with pytest.raises(CheckpointError,
                       match=rf"{rotary} differs between tp_rank_00_pp_rank_000/ and tp_rank_00_pp_rank_001/"):
        read_checkpoint(rank_archive(tmp_path, config, ranks))
    with pytest.raises(CheckpointError, match=r"mixes mp_rank_XX and tp_rank_XX_pp_rank_XXX"):
        read_checkpoint(rank_archive(tmp_path, config, {"mp_rank_00": weights, "tp_rank_01_pp_rank_000": weights}))


# -------------------------------------------------------------------------------- MegaMolBART
@pytest.fixture(scope="module")
def megamolbart_source(tmp_path_factory) -> tuple[MegaMolBart, list[str]]:
    folder = save_random_checkpoint("megamolbart", tmp_path_factory.mktemp("mmb"), seed=3, hidden_size=32,
                                    num_layers=2, num_heads=HEADS)
    model, vocab, _ = load_model(folder)
    return model, vocab


def decoder_logits(model_or_loaded, vocab) -> torch.Tensor:
    """Teacher-forced decoder logits of SMILES for the loaded import or the source model."""
    from bionemo_export.serving.tokenizers.smiles import SmilesTokenizer

    encoded = SmilesTokenizer(vocab, max_length=64).encode(SMILES)
    ids, mask = torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask)
    tokens = torch.tensor([[2, 7, 8, 9]] * len(SMILES))
    with torch.no_grad():
        if isinstance(model_or_loaded, MegaMolBart):
            return model_or_loaded(ids, mask, tokens)
        model = model_or_loaded.seq2seq.decoder_full.model
        return model(ids, mask, tokens)


def head_variant(model: MegaMolBart, head: str) -> MegaMolBart:
    """The source model as NeMo computes it with that head: no bias = a zero bias; bias only =
    the weight tied to the token embeddings."""
    variant = MegaMolBart(model.config).eval()
    variant.load_state_dict(model.state_dict())
    with torch.no_grad():
        if head == "weight":
            variant.tokens_head.bias.zero_()
        if head == "bias":
            variant.tokens_head.weight.copy_(variant.embedding.word_embeddings.weight)
    return variant


@pytest.mark.parametrize(("head", "described"), [("weight and bias", "weight and bias"), ("weight", "weight, no bias"),
                                                 ("bias", "bias, weight tied to the token embeddings")])
def test_megamolbart_output_head_variants(megamolbart_source, tmp_path, head, described):
    model, vocab = megamolbart_source
    source = head_variant(model, head)
    weights = megamolbart_to_nemo(source.state_dict(), source.config, head=head)
    if head == "bias":  # the padded rows of a tied head are the (padded) embeddings' rows
        assert "enc_dec_model.tokens_head.weight" not in weights
    # MegaMolBART's own setting: share_decoder_tokens_head_embeddings false
    config, artifacts = megamolbart_config(source.config, vocab)
    loaded = load_checkpoint(write_nemo(tmp_path / "mmb.nemo", config, weights, artifacts))
    assert loaded.description["output_head"] == described
    logits = decoder_logits(loaded, vocab)
    assert logits.shape[-1] == len(vocab)  # the padded vocabulary cut, whichever tensors exist
    torch.testing.assert_close(logits, decoder_logits(source, vocab), atol=1e-5, rtol=0)


def test_megamolbart_without_an_output_head_is_refused(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    weights = megamolbart_to_nemo(model.state_dict(), model.config, head="neither")
    config, artifacts = megamolbart_config(model.config, vocab)
    with pytest.raises(CheckpointError, match=r"has no enc_dec_model\.tokens_head\.weight nor \.bias"):
        load_checkpoint(write_nemo(tmp_path / "headless.nemo", config, weights, artifacts))


def test_megamolbart_legacy_qkv_and_kv(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    weights = legacy_qkv(megamolbart_to_nemo(model.state_dict(), model.config), HEADS)
    config, artifacts = megamolbart_config(model.config, vocab, megatron_legacy=True)
    loaded = load_checkpoint(write_nemo(tmp_path / "legacy.nemo", config, weights, artifacts))
    torch.testing.assert_close(decoder_logits(loaded, vocab), decoder_logits(model, vocab), atol=1e-5, rtol=0)


def test_tensor_parallel_megamolbart_is_merged(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    weights = megamolbart_to_nemo(model.state_dict(), model.config)
    for key in ("enc_dec_model.encoder_embedding.word_embeddings.weight", "enc_dec_model.tokens_head.weight",
                "enc_dec_model.tokens_head.bias"):
        weights[key] = pad_rows(weights[key][: len(vocab)], 256)
    weights["enc_dec_model.decoder_embedding.word_embeddings.weight"] = \
        weights["enc_dec_model.encoder_embedding.word_embeddings.weight"]  # NeMo always saves the shared copy
    weights["enc_dec_model.decoder_embedding.position_embeddings.weight"] = \
        weights["enc_dec_model.encoder_embedding.position_embeddings.weight"]
    config, artifacts = megamolbart_config(model.config, vocab, tensor_model_parallel_size=2)
    shards = tensor_parallel_shards(weights, 2)
    loaded = load_checkpoint(write_nemo_ranks(tmp_path / "tp2.nemo", config,
                                              {f"mp_rank_{r:02d}": s for r, s in enumerate(shards)}, artifacts))
    torch.testing.assert_close(decoder_logits(loaded, vocab), decoder_logits(model, vocab), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------- GELU settings
@pytest.mark.parametrize(("config", "section", "encoder_decoder", "fused"), [
    ({}, None, False, True),                                                   # BERT default
    ({"bias_gelu_fusion": False}, None, False, False),
    ({"bias_activation_fusion": False}, None, False, True),                    # BERT reads only the alias
    ({}, "encoder", True, True),                                               # the oldest configs
    ({"bias": False}, "encoder", True, False),                                 # ... follow the bias
    ({"bias_activation_fusion": False}, "encoder", True, False),               # ProtT5nv / MegaMolBART flat
    ({"bias_gelu_fusion": False, "bias_activation_fusion": True}, "encoder", True, False),  # the alias wins
    ({"bias_gelu_fusion": True, "bias_activation_fusion": False}, "encoder", True, True),
    ({"encoder": {"bias_activation_fusion": False}}, "encoder", True, False),  # nested: the section's own
    ({"encoder": {"bias_gelu_fusion": False}}, "encoder", True, True),         # ... the alias not honoured
    ({"bias_activation_fusion": False, "encoder": {}}, "encoder", True, True),  # ... nor the flat value
])
def test_fused_bias_gelu_follows_nemo_precedence(config, section, encoder_decoder, fused):
    assert fused_bias_gelu(SimpleNamespace(config=config), section, encoder_decoder) is fused


def test_bias_activation_fusion_false_gives_exact_gelu(megamolbart_source, tmp_path):
    """A flat config with `bias_activation_fusion: false` (and no alias) computes exact GELU."""
    model, vocab = megamolbart_source
    config, artifacts = megamolbart_config(model.config, vocab)
    del config["bias_gelu_fusion"]
    weights = megamolbart_to_nemo(model.state_dict(), model.config)
    exact = load_checkpoint(write_nemo(tmp_path / "exact.nemo", {**config, "bias_activation_fusion": False},
                                       weights, artifacts))
    tanh = load_checkpoint(write_nemo(tmp_path / "tanh.nemo", {**config, "bias_activation_fusion": True},
                                      weights, artifacts))
    assert exact.description["activation"] == "gelu" and tanh.description["activation"] == "gelu_tanh"
    torch.testing.assert_close(decoder_logits(exact, vocab), decoder_logits(model, vocab), atol=1e-5, rtol=0)


def encoder_decoder_stages(weights: dict) -> list[dict]:
    """A Megatron encoder-decoder over two pipeline stages split at the decoder
    (pipeline_model_parallel_split_rank 1): the encoder with its embeddings, then the decoder with
    its own copy of the shared embeddings and the output head; each stack numbers its layers from 0."""
    encoder = {k: v for k, v in weights.items() if ".encoder." in k or "encoder_embedding" in k}
    decoder = {k: v for k, v in weights.items() if k not in encoder}
    for leaf in ("word_embeddings.weight", "position_embeddings.weight"):
        decoder[f"enc_dec_model.decoder_embedding.{leaf}"] = weights[f"enc_dec_model.encoder_embedding.{leaf}"]
    return [encoder, decoder]


def test_pipeline_and_tensor_parallel_megamolbart_is_merged(megamolbart_source, tmp_path):
    """NeMo requires the tied head with pipeline parallelism: bias only, weight = the embeddings."""
    model, vocab = megamolbart_source
    source = head_variant(model, "bias")
    weights = megamolbart_to_nemo(source.state_dict(), source.config, head="bias")
    for key in ("enc_dec_model.encoder_embedding.word_embeddings.weight", "enc_dec_model.tokens_head.bias"):
        weights[key] = pad_rows(weights[key][: len(vocab)], 256)
    config, artifacts = megamolbart_config(source.config, vocab, tensor_model_parallel_size=2,
                                           pipeline_model_parallel_size=2, pipeline_model_parallel_split_rank=1,
                                           share_decoder_tokens_head_embeddings=True)
    ranks = {f"tp_rank_{tp:02d}_pp_rank_{pp:03d}": shard for pp, stage in enumerate(encoder_decoder_stages(weights))
             for tp, shard in enumerate(tensor_parallel_shards(stage, 2))}
    archive = write_nemo_ranks(tmp_path / "tp2pp2.nemo", config, ranks, artifacts)
    assert read_checkpoint(archive).parallel == {"tensor": 2, "pipeline": 2}
    loaded = load_checkpoint(archive)
    torch.testing.assert_close(decoder_logits(loaded, vocab), decoder_logits(source, vocab), atol=1e-5, rtol=0)
