"""NVIDIA's TransformerEngine ESM-2 (`nv_esm`, bionemo-recipes) read as the esm2 family: the
reader, the layout (both key prefixes, the three QKV layouts, padded vocabularies), outputs equal
to transformers' EsmModel / EsmForMaskedLM with the same weights, and one error per bad input.

The reference model computes what NVIDIA's model does: TransformerEngine's "gelu" in the encoder's
MLP is the tanh approximation (models/transformer_engine_esm.py), so the reference EsmModel gets
its intermediate activation swapped for the tanh one; the masked-LM head's GELU is exact in both."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bionemo_export.models import get_family, load_checkpoint
from bionemo_export.models.readers import READERS, CheckpointError, CheckpointPath, read_checkpoint
from tests.helpers.nv_esm_checkpoints import ESM_VOCAB, edit_config, write_nv_esm
from tests.helpers.random_models import perturb, tiny_esm_config

SEQUENCES = ["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "LAGVSERTIDPKQNFYMHWCXBUZO", "MK_AYIAK__RQISFVKSHFSRQ"]
"""Varied lengths (a padded batch); `_` is a masked residue (token dropout scales the others)."""
TOLERANCE = 1e-5


class TanhGeluIntermediate(torch.nn.Module):
    """EsmIntermediate with TransformerEngine's GELU (the tanh approximation)."""

    def __init__(self, dense: torch.nn.Linear) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.dense(hidden_states), approximate="tanh")


def te_gelu(model: transformers.EsmForMaskedLM) -> transformers.EsmForMaskedLM:
    """A copy of `model` computing what NVIDIA's TransformerEngine model computes."""
    model = copy.deepcopy(model)
    for layer in model.esm.encoder.layer:
        dense = layer.get_submodule("intermediate.dense")
        assert isinstance(dense, torch.nn.Linear)
        layer.intermediate = TanhGeluIntermediate(dense)
    return model.eval()


@pytest.fixture(scope="module")
def esm() -> transformers.EsmForMaskedLM:
    """A random ESM-2 masked LM with the released models' settings (token dropout, eps 1e-5)."""
    torch.manual_seed(0)
    model = transformers.EsmForMaskedLM(tiny_esm_config(token_dropout=True, layer_norm_eps=1e-5,
                                                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return perturb(model, seed=3)


@pytest.fixture(scope="module")
def exported(esm, tmp_path_factory):
    """nv_esm directories of `esm`: today's exports (`model.`) and 2025's (`esm.`, inv_freq, _extra_state)."""
    root = tmp_path_factory.mktemp("nv_esm")
    return {prefix: write_nv_esm(esm, root / prefix.strip(".") / "dir", prefix=prefix) for prefix in ("model.", "esm.")}


def outputs(loaded, sequences=SEQUENCES):
    """(encoded batch, hiddens, embeddings, log_probs) of the loaded model."""
    encoded = loaded.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in
                                               (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        log_probs = loaded.lm_head(hiddens) if loaded.lm_head is not None else None
    return encoded, hiddens, embeddings, log_probs


def reference(model, encoded):
    """transformers' hiddens [B, L, H] and logits [B, L, 33] for the same batch."""
    with torch.no_grad():
        result = model(input_ids=torch.from_numpy(encoded.input_ids),
                       attention_mask=torch.from_numpy(encoded.attention_mask), output_hidden_states=True)
    return result.hidden_states[-1], result.logits


def max_error(a: torch.Tensor, b: torch.Tensor, mask) -> float:
    """Largest absolute difference over the real tokens (padding positions are not outputs)."""
    keep = torch.from_numpy(mask).bool()
    return float((a - b).abs()[keep].max())


def test_the_reader_recognizes_nv_esm_and_the_huggingface_reader_does_not(exported):
    assert "nv_esm" in READERS
    for prefix, directory in exported.items():
        checkpoint = read_checkpoint(directory)
        assert (checkpoint.form, checkpoint.model_class, checkpoint.weights_name) == ("nv_esm", "nv_esm",
                                                                                      "model.safetensors")
        assert not READERS["huggingface"].recognizes(CheckpointPath(directory))
        assert {"tokenizer.json", "vocab.txt"} <= set(checkpoint.files) and "esm_nv.py" not in checkpoint.files
        assert bool(checkpoint.skipped) == (prefix == "esm.")  # 2025 exports: _extra_state skipped, recorded
        assert all(key.endswith("._extra_state") for key in checkpoint.skipped)


@pytest.mark.parametrize("prefix", ["model.", "esm."])
def test_outputs_equal_transformers(esm, exported, prefix):
    """Hiddens, embeddings and the head's log-probabilities equal transformers' with the same
    weights (esm_nv.py, which raises when imported, is never run)."""
    loaded = load_checkpoint(exported[prefix], "esm2")
    encoded, hiddens, embeddings, log_probs = outputs(loaded)
    expected, logits = reference(te_gelu(esm), encoded)
    mask = encoded.attention_mask
    assert max_error(hiddens, expected, mask) < TOLERANCE
    weights = torch.from_numpy(encoded.residue_mask).float().unsqueeze(-1)
    torch.testing.assert_close(embeddings, (expected * weights).sum(1) / weights.sum(1), rtol=0, atol=TOLERANCE)
    alphabet_ids = [ESM_VOCAB.index(token) for token in loaded.alphabet]
    assert len(alphabet_ids) == 25 and log_probs is not None
    assert max_error(log_probs, torch.log_softmax(logits[..., alphabet_ids], dim=-1), mask) < TOLERANCE
    assert loaded.description["checkpoint_form"] == ("NVIDIA TransformerEngine ESM-2 directory "
                                                     "(nv_esm, model.safetensors)")
    assert loaded.description["key_prefix"] == prefix and loaded.description["padded_vocab_size"] == 64
    assert loaded.description["activation"] == "gelu_tanh"


def test_the_encoder_computes_transformer_engines_tanh_gelu(esm, exported):
    """What NVIDIA's model computes, not transformers' exact GELU: the two differ measurably."""
    loaded = load_checkpoint(exported["model."], "esm2")
    encoded, hiddens, _, _ = outputs(loaded)
    exact, _ = reference(esm, encoded)
    assert max_error(hiddens, exact, encoded.attention_mask) > 10 * TOLERANCE


@pytest.mark.parametrize("layout", ["concatenated", "separate"])
def test_other_qkv_layouts(esm, tmp_path, layout):
    """qkv_weight_interleaved false ([all q; all k; all v]) and fuse_qkv_params false (separate)."""
    loaded = load_checkpoint(write_nv_esm(esm, tmp_path / layout, layout=layout), "esm2")
    encoded, hiddens, _, _ = outputs(loaded)
    expected, _ = reference(te_gelu(esm), encoded)
    assert max_error(hiddens, expected, encoded.attention_mask) < TOLERANCE
    assert loaded.description["qkv_layout"] != "per head [q_h; k_h; v_h]"


def test_unpadded_base_model_without_head(esm, tmp_path):
    """An NVEsmModel saved alone (no prefix, no head) by an export before padding existed (no
    padded_vocab_size), and no vocab.txt: loads, with no masked-LM head."""
    directory = write_nv_esm(esm, tmp_path / "base", prefix="", padded_vocab_size=None, head=False, vocab_txt=False)
    assert "padded_vocab_size" not in json.loads((directory / "config.json").read_text())
    loaded = load_checkpoint(directory, "esm2")
    encoded, hiddens, _, log_probs = outputs(loaded)
    assert log_probs is None and loaded.lm_head is None
    assert max_error(hiddens, reference(te_gelu(esm), encoded)[0], encoded.attention_mask) < TOLERANCE


def test_stored_decoder_weight_is_cut_like_the_embeddings(esm, tmp_path):
    loaded = load_checkpoint(write_nv_esm(esm, tmp_path / "decoder", decoder_weight=True), "esm2")
    encoded, _, _, log_probs = outputs(loaded)
    _, logits = reference(te_gelu(esm), encoded)
    ids = [ESM_VOCAB.index(token) for token in loaded.alphabet]
    assert log_probs is not None
    assert max_error(log_probs, torch.log_softmax(logits[..., ids], dim=-1), encoded.attention_mask) < TOLERANCE


def test_bfloat16_exports(esm, exported, tmp_path):
    """A bfloat16 checkpoint (its rotary table in bfloat16 too) loads, computing in float32."""
    directory = edit_weights(copy_of(exported["esm."], tmp_path), lambda w: w.update(
        {key: tensor.bfloat16() for key, tensor in w.items() if tensor.is_floating_point()}))
    loaded = load_checkpoint(directory, "esm2")
    rounded = te_gelu(esm)
    with torch.no_grad():
        for parameter in rounded.parameters():
            parameter.copy_(parameter.bfloat16().float())
    encoded, hiddens, _, _ = outputs(loaded)
    assert max_error(hiddens, reference(rounded, encoded)[0], encoded.attention_mask) < TOLERANCE


def test_token_classifier(esm, tmp_path):
    """NVEsmForTokenClassification: `classifier` on every token, labels from id2label."""
    weight, bias = torch.randn(3, 32), torch.randn(3)
    loaded = load_checkpoint(write_nv_esm(esm, tmp_path / "token", classifier=(weight, bias)), "esm2")
    assert loaded.lm_head is None and loaded.classifier is not None and loaded.classifier.per_token
    assert loaded.classifier.labels == ("class_0", "class_1", "class_2")
    _, hiddens, _, _ = outputs(loaded)
    with torch.no_grad():
        torch.testing.assert_close(loaded.classifier(hiddens), hiddens @ weight.T + bias, rtol=0, atol=1e-5)


def test_tensors_not_loaded_are_reported_as_left_out(exported, tmp_path):
    """The stored rotary table (2025 exports) and an NVEsmModel's pooler: `inspect` lists them."""
    directory = edit_weights(copy_of(exported["esm."], tmp_path), lambda w: w.update(
        {"esm.pooler.dense.weight": torch.zeros(32, 32), "esm.pooler.dense.bias": torch.zeros(32)}))
    description = get_family("esm2").describe(read_checkpoint(directory))
    assert sorted(description.left_out) == ["esm.encoder.rotary_embeddings.inv_freq", "esm.pooler.dense.bias",
                                            "esm.pooler.dense.weight"]
    assert not any(key.startswith("pooler.") for key in description.state_dict)


def test_the_family_is_inferred_and_others_are_refused(exported):
    assert load_checkpoint(exported["model."]).family.name == "esm2"
    with pytest.raises(CheckpointError, match="nv_esm checkpoint, which the esm2 family reads, not bert: "
                                              "use `family` esm2"):
        load_checkpoint(exported["model."], "bert")
    with pytest.raises(CheckpointError, match="is a nv_esm checkpoint .*the prott5 family reads"):
        get_family("prott5").describe(read_checkpoint(exported["model."]))


# ------------------------------------------------------------------------------------ errors
def copy_of(directory, tmp_path):
    return shutil.copytree(directory, tmp_path / "copy")


def edit_weights(directory, edit):
    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors")
    return directory


@pytest.mark.parametrize(("edit", "message"), [
    (lambda w: w.pop("model.encoder.layers.1.self_attention.proj.weight"),
     r"model.safetensors does not match .*missing keys: model.encoder.layers.1.self_attention.proj.weight"),
    (lambda w: w.update({"model.encoder.layers.0.layernorm_mlp.fc1_weight":
                         w["model.encoder.layers.0.layernorm_mlp.fc1_weight"].T.contiguous()}),
     r"wrong shapes: model.encoder.layers.0.layernorm_mlp.fc1_weight is \(32, 64\), expected \(64, 32\)"),
    (lambda w: w.update({"model.encoder.layers.2.layernorm_mlp.fc2_bias": torch.zeros(32)}),
     r"unexpected keys: model.encoder.layers.2.layernorm_mlp.fc2_bias"),
    (lambda w: w.pop("lm_head.decoder.layer_norm_bias"), r"missing keys: lm_head.decoder.layer_norm_bias"),
    (lambda w: w.update({"model.encoder.rotary_embeddings.inv_freq": torch.ones(4)}),
     r"model.encoder.rotary_embeddings.inv_freq is not the standard rotary frequency table"),
    (lambda w: w.update({"model.embeddings.word_embeddings.weight":
                         w["model.embeddings.word_embeddings.weight"].to(torch.float8_e4m3fn)}),
     r"model.embeddings.word_embeddings.weight are stored in float8"),
    (lambda w: w.update({"embeds": w.pop("model.embeddings.word_embeddings.weight")}), r"has no word embeddings"),
])
def test_weight_errors_name_the_file_and_key(exported, tmp_path, edit, message):
    directory = edit_weights(copy_of(exported["model."], tmp_path), edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(directory, "esm2")


@pytest.mark.parametrize(("changes", "message"), [
    ({"encoder_activation": "relu"}, r"config.json: encoder_activation is 'relu'; this tool computes only 'gelu'"),
    ({"attn_mask_type": "causal"}, r"attn_mask_type is 'causal'"),
    ({"position_embedding_type": "absolute"}, r"position_embedding_type is 'absolute'"),
    ({"position_embedding_type": None}, r"position_embedding_type is 'absolute'"),
    ({"is_folding_model": True}, r"is_folding_model is True"),
    ({"vocab_size": 34}, r"vocab_size is 34; ESM-2's alphabet has 33 tokens"),
    ({"padded_vocab_size": 32}, r"padded_vocab_size 32 is smaller than vocab_size 33"),
    ({"mask_token_id": 3}, r"mask_token_id is 3; the ESM-2 alphabet has it at 32"),
    ({"hidden_size": None}, r"config.json has no hidden_size"),
    ({"num_attention_heads": 5}, r"hidden_size 32 is not a multiple of num_attention_heads 5"),
    ({"layer_norm_eps": "small"}, r"layer_norm_eps is 'small', expected a float"),
    ({"intermediate_size": 48}, r"wrong shapes: model.encoder.layers.0.layernorm_mlp.fc1_weight is \(64, 32\), "
                                r"expected \(48, 32\)"),
])
def test_config_settings_it_cannot_compute_are_refused_by_name(exported, tmp_path, changes, message):
    directory = edit_config(copy_of(exported["model."], tmp_path), **changes)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(directory, "esm2")


def test_tokenizer_files_must_be_the_esm2_alphabet(exported, tmp_path):
    directory = copy_of(exported["model."], tmp_path)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["L"], tokenizer["model"]["vocab"]["A"] = 5, 4
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match=r"tokenizer.json is not the ESM-2 alphabet: 'L' has id 5, expected 4"):
        load_checkpoint(directory, "esm2")
    shutil.copy(exported["model."] / "tokenizer.json", directory / "tokenizer.json")
    (directory / "vocab.txt").write_text("\n".join(["<pad>", *ESM_VOCAB[1:]]) + "\n")
    with pytest.raises(ValueError, match=r"vocab.txt is not the ESM-2 alphabet: line 1 is '<pad>'"):
        load_checkpoint(directory, "esm2")
