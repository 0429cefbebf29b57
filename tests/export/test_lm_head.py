"""Masked-LM heads (issue 17): LoadedModel.lm_head and .alphabet, the tokenizers' mask character,
and the exported head graph lm_head.onnx.

The served log-probabilities are `lm_head(encoder(...).hiddens)`. Each family's are compared with
transformers' own masked-LM classes (`EsmForMaskedLM`, `BertForMaskedLM`) on the same weights:
their logits restricted to the alphabet's token ids, renormalized with log_softmax (the special
tokens excluded, as AntiBERTy's runner excludes them). Small random models have every parameter
perturbed, so that layer norms and biases are not their trivial initial values. Reference token
ids are written out here from the literal vocabularies, not taken from the package's tokenizers
(except for rxnfp's regex SMILES tokenization, which test_rxnfp checks on its own).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bionemo_export.exporters import NoLMHeadError, export_lm_head, lm_head_check_batches
from bionemo_export.models import LoadedModel, get_family
from bionemo_export.models.bert import ANTIBERTY_VOCAB, antiberty_checkpoint, rxnfp_checkpoint
from bionemo_export.models.esm1 import ESM1NV_PIECES, esm1nv_tokenizer
from bionemo_export.models.readers import CheckpointError
from bionemo_export.serving.tokenizers.character import MASK_CHAR, CharacterTokenizer, TokenizationError
from bionemo_export.serving.tokenizers.sentencepiece_vocab import SentencePieceTokenizer
from bionemo_export.serving.tokenizers.smiles import SmilesTokenizer
from bionemo_export.testing.checkpoints import save_huggingface, save_random_checkpoint
from tests.helpers.nemo_archives import esm2_to_megatron, esm2nv_config, pad_rows, write_nemo
from tests.helpers.random_models import perturb

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
"""The 33 Hugging Face ESM token ids (docs/reference/tokenizers.md), written out."""
ESM1NV_VOCAB = ["<unk>", "<s>", "</s>", "<pad>", "<mask>", *"LASGVERTDIPKNFQYHMCWXBZUO"]
HF_OF_ESM1NV = {"<s>": "<cls>", "</s>": "<eos>"}
HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
ATOL = 1e-4
PROTEINS = ["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "MK_AYLA_", "_SLKRKNIALIPAAGIGVRFGLAGVSERTIDPKQNFYMHWCX"]
"""Protein inputs, some with masked positions (the mask character `_`)."""
ANTIBODIES = ["EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVA", "DIQMTQSPSS_SASVGDRVTITC", "QVQ_VQSG"]


# ------------------------------------------------------------------------------------- helpers


def token_ids(sequences: list[str], vocab: list[str], bos: str, eos: str, pad: str, mask: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): bos + one token per character (`_` = the mask token) + eos,
    right-padded, looked up in the literal `vocab`."""
    rows = [[bos, *(mask if c == MASK_CHAR else c for c in s), eos] for s in sequences]
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), vocab.index(pad))
    attention = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor([vocab.index(t) for t in row])
        attention[r, : len(row)] = 1
    return ids, attention


def served(loaded: LoadedModel, sequences: list[str]) -> tuple[torch.Tensor, np.ndarray]:
    """(log_probs [B, L, A], attention_mask) as the repository computes them: encoder, then head."""
    assert loaded.lm_head is not None, "the checkpoint carries no masked-LM head"
    encoded = loaded.tokenizer.encode(sequences)
    with torch.inference_mode():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in
                                      (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        return loaded.lm_head(hiddens), encoded.attention_mask


def reference(model: torch.nn.Module, ids: torch.Tensor, attention: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """transformers' logits at the alphabet's token ids `rows`, renormalized."""
    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=attention).logits
    return torch.log_softmax(logits[..., rows], dim=-1)


def max_abs(actual: torch.Tensor, expected: torch.Tensor, attention: np.ndarray) -> float:
    """Largest difference over real (not padded) positions."""
    assert actual.shape == expected.shape
    valid = torch.from_numpy(attention.astype(bool))
    return float((actual - expected).abs()[valid].max())


def esm_config(**settings) -> transformers.EsmConfig:
    base = dict(vocab_size=len(ESM_VOCAB), pad_token_id=1, mask_token_id=32, hidden_size=HIDDEN,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN, layer_norm_eps=1e-5,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.EsmConfig(**{**base, **settings})


# ------------------------------------------------------------------------------------ ESM-2
@pytest.fixture(scope="module")
def esm2_mlm() -> transformers.EsmForMaskedLM:
    config = esm_config(position_embedding_type="rotary", token_dropout=True, emb_layer_norm_before=False,
                        max_position_embeddings=1026)
    torch.manual_seed(3)
    return perturb(transformers.EsmForMaskedLM(config), seed=3)


@pytest.fixture(scope="module")
def esm2_dir(esm2_mlm, tmp_path_factory) -> Path:
    return save_huggingface(esm2_mlm, tmp_path_factory.mktemp("esm2_mlm"), ESM_VOCAB)


@pytest.fixture(scope="module")
def esm2_loaded(esm2_dir) -> LoadedModel:
    return get_family("esm2").load(esm2_dir)


def test_esm2_alphabet_is_the_25_residue_letters(esm2_loaded):
    assert esm2_loaded.alphabet == tuple("LAGVSERTIDPKQNFYMHWCXBUZO")
    assert esm2_loaded.lm_head.alphabet_ids == tuple(range(4, 29))
    assert esm2_loaded.lm_head_outputs[0].dims == ("batch", "length", 25)


def test_esm2_huggingface_log_probs_match_esm_for_masked_lm(esm2_mlm, esm2_loaded):
    log_probs, attention = served(esm2_loaded, PROTEINS)
    ids, hf_attention = token_ids(PROTEINS, ESM_VOCAB, "<cls>", "<eos>", "<pad>", "<mask>")
    assert np.array_equal(hf_attention.numpy(), attention)
    expected = reference(esm2_mlm, ids, hf_attention, [ESM_VOCAB.index(c) for c in esm2_loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL
    # rows are distributions over the alphabet
    torch.testing.assert_close(log_probs.exp().sum(-1), torch.ones(log_probs.shape[:2]), atol=1e-5, rtol=0)


def test_esm2_untied_file_with_decoder_weight_loads(esm2_mlm, esm2_dir, tmp_path):
    """transformers may or may not write lm_head.decoder.weight: with it the head is the same."""
    out = tmp_path / "with_decoder"
    out.mkdir()
    for name in ("config.json", "vocab.txt"):
        (out / name).write_bytes((esm2_dir / name).read_bytes())
    weights = load_file(esm2_dir / "model.safetensors")
    weights["lm_head.decoder.weight"] = esm2_mlm.esm.embeddings.word_embeddings.weight.detach().clone()
    save_file(weights, out / "model.safetensors")
    loaded = get_family("esm2").load(out)
    log_probs, attention = served(loaded, PROTEINS)
    ids, hf_attention = token_ids(PROTEINS, ESM_VOCAB, "<cls>", "<eos>", "<pad>", "<mask>")
    expected = reference(esm2_mlm, ids, hf_attention, [ESM_VOCAB.index(c) for c in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


def test_esm2nv_nemo_log_probs_match_esm_for_masked_lm(esm2_mlm, tmp_path):
    state = {k: v.detach().clone() for k, v in esm2_mlm.state_dict().items()}
    megatron = esm2_to_megatron(state, LAYERS, HEADS)
    archive = write_nemo(tmp_path / "esm2nv.nemo", esm2nv_config(esm2_mlm.config), megatron)
    loaded = get_family("esm2").load(archive)
    assert loaded.alphabet == tuple("LAGVSERTIDPKQNFYMHWCXBUZO")
    log_probs, attention = served(loaded, PROTEINS)
    ids, hf_attention = token_ids(PROTEINS, ESM_VOCAB, "<cls>", "<eos>", "<pad>", "<mask>")
    expected = reference(esm2_mlm, ids, hf_attention, [ESM_VOCAB.index(c) for c in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


def test_esm2nv_nemo_head_bias_shorter_than_the_vocabulary_is_an_error(esm2_mlm, tmp_path):
    state = {k: v.detach().clone() for k, v in esm2_mlm.state_dict().items()}
    megatron = esm2_to_megatron(state, LAYERS, HEADS)
    megatron["model.lm_head.bias"] = megatron["model.lm_head.bias"][:20]
    archive = write_nemo(tmp_path / "short_bias.nemo", esm2nv_config(esm2_mlm.config), megatron)
    with pytest.raises(CheckpointError, match=r"short_bias\.nemo.*lm_head\.bias is \(20,\)"):
        get_family("esm2").load(archive)


def test_missing_head_key_is_an_error_naming_file_and_key(esm2_dir, tmp_path):
    out = tmp_path / "no_dense_bias"
    out.mkdir()
    for name in ("config.json", "vocab.txt"):
        (out / name).write_bytes((esm2_dir / name).read_bytes())
    weights = load_file(esm2_dir / "model.safetensors")
    del weights["lm_head.dense.bias"]
    save_file(weights, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no_dense_bias/model\.safetensors.*missing keys: lm_head\.dense\.bias"):
        get_family("esm2").load(out)


def test_unexpected_head_key_is_an_error(esm2_dir, tmp_path):
    out = tmp_path / "extra"
    out.mkdir()
    for name in ("config.json", "vocab.txt"):
        (out / name).write_bytes((esm2_dir / name).read_bytes())
    weights = load_file(esm2_dir / "model.safetensors")
    weights["lm_head.surprise.weight"] = torch.zeros(3)
    save_file(weights, out / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"unexpected keys: lm_head\.surprise\.weight"):
        get_family("esm2").load(out)


def test_checkpoint_without_head_has_none(tmp_path):
    config = esm_config(position_embedding_type="rotary", emb_layer_norm_before=False, max_position_embeddings=1026)
    out = save_huggingface(transformers.EsmModel(config, add_pooling_layer=False), tmp_path / "plain", ESM_VOCAB)
    loaded = get_family("esm2").load(out)
    assert loaded.lm_head is None and loaded.alphabet == ()
    with pytest.raises(NoLMHeadError, match="plain has no masked-LM head"):
        export_lm_head(loaded, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_random_checkpoints_carry_a_head(tmp_path):
    for name, size in (("esm2", 25), ("esm1", 25), ("bert", 20)):
        loaded = get_family(name).load(save_random_checkpoint(name, tmp_path / name, seed=1))
        assert loaded.lm_head is not None and len(loaded.alphabet) == size, name


# ------------------------------------------------------------------------------------ ESM-1
def test_esm1b_huggingface_log_probs_match_esm_for_masked_lm(tmp_path):
    config = esm_config(position_embedding_type="absolute", token_dropout=False, emb_layer_norm_before=True,
                        max_position_embeddings=514)
    torch.manual_seed(5)
    model = perturb(transformers.EsmForMaskedLM(config), seed=5)
    loaded = get_family("esm1").load(save_huggingface(model, tmp_path / "esm1b", ESM_VOCAB))
    assert loaded.alphabet == tuple("LAGVSERTIDPKQNFYMHWCXBUZO")
    log_probs, attention = served(loaded, PROTEINS)
    ids, hf_attention = token_ids(PROTEINS, ESM_VOCAB, "<cls>", "<eos>", "<pad>", "<mask>")
    expected = reference(model, ids, hf_attention, [ESM_VOCAB.index(c) for c in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


def test_esm1nv_nemo_log_probs_match_esm_for_masked_lm(tmp_path):
    """An ESM-1nv archive written by test_esm1's converter (the documented Megatron BERT layout) from
    an EsmForMaskedLM with learned positions, plus its head: `model.lm_head.dense`, `.layernorm`
    and `.bias` in ESM-1nv id order, zero-padded to 128 rows."""
    from tests.e2e.test_esm1 import MAX_TOKENS, megatron_state_dict
    from tests.e2e.test_esm1 import write_nemo as write_esm1nv

    config = esm_config(position_embedding_type="absolute", token_dropout=False, emb_layer_norm_before=False,
                        max_position_embeddings=MAX_TOKENS + 2)
    torch.manual_seed(9)
    model = perturb(transformers.EsmForMaskedLM(config), seed=9)
    state = megatron_state_dict(model.esm)
    head = model.lm_head
    hf_rows = [ESM_VOCAB.index(HF_OF_ESM1NV.get(token, token)) for token in ESM1NV_VOCAB]
    state["model.lm_head.dense.weight"] = head.dense.weight.detach().clone()
    state["model.lm_head.dense.bias"] = head.dense.bias.detach().clone()
    state["model.lm_head.layernorm.weight"] = head.layer_norm.weight.detach().clone()
    state["model.lm_head.layernorm.bias"] = head.layer_norm.bias.detach().clone()
    state["model.lm_head.bias"] = pad_rows(head.bias.detach()[hf_rows].clone())
    loaded = get_family("esm1").load(write_esm1nv(tmp_path / "esm1nv.nemo", state))
    assert loaded.alphabet == tuple("LASGVERTDIPKNFQYHMCWXBZUO")  # ESM-1nv's id order
    log_probs, attention = served(loaded, PROTEINS)
    ids, hf_attention = token_ids(PROTEINS, ESM_VOCAB, "<cls>", "<eos>", "<pad>", "<mask>")
    expected = reference(model, ids, hf_attention, [ESM_VOCAB.index(c) for c in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


# ------------------------------------------------------------------------------------- BERT
def test_bert_log_probs_match_bert_for_masked_lm(tmp_path):
    config = transformers.BertConfig(vocab_size=len(ANTIBERTY_VOCAB), pad_token_id=0, hidden_size=HIDDEN,
                                     num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                                     max_position_embeddings=128, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(13)
    model = perturb(transformers.BertForMaskedLM(config), seed=13)
    loaded = get_family("bert").load(save_huggingface(model, tmp_path / "bert", ANTIBERTY_VOCAB))
    assert loaded.alphabet == tuple("ACDEFGHIKLMNPQRSTVWY")
    log_probs, attention = served(loaded, ANTIBODIES)
    ids, hf_attention = token_ids(ANTIBODIES, ANTIBERTY_VOCAB, "[CLS]", "[SEP]", "[PAD]", "[MASK]")
    expected = reference(model, ids, hf_attention, [ANTIBERTY_VOCAB.index(c) for c in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


def test_bert_without_head_has_none():
    loaded = get_family("bert").load(rxnfp_checkpoint("bert_ft"))  # a plain BertModel
    assert loaded.lm_head is None and loaded.alphabet == ()


def test_real_antiberty_head_matches_bert_for_masked_lm(antiberty):
    """AntiBERTy's cls.predictions in transformers' BertForMaskedLM (its species/chain/graft heads
    are not part of it) against the package's head."""
    vocab = (antiberty_checkpoint().parent / "vocab.txt").read_text().splitlines()
    model = transformers.BertForMaskedLM.from_pretrained(antiberty_checkpoint()).eval()
    assert antiberty.alphabet == tuple("ACDEFGHIKLMNPQRSTVWY")
    log_probs, attention = served(antiberty, ANTIBODIES)
    ids, hf_attention = token_ids(ANTIBODIES, vocab, "[CLS]", "[SEP]", "[PAD]", "[MASK]")
    expected = reference(model, ids, hf_attention, [vocab.index(c) for c in antiberty.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL
    # a trained head: the true residue of an unmasked position is the likeliest
    top = log_probs[0, 1:-1].argmax(-1)
    predicted = "".join(antiberty.alphabet[i] for i in top[: len(ANTIBODIES[0])])
    assert sum(a == b for a, b in zip(predicted, ANTIBODIES[0])) >= 0.9 * len(ANTIBODIES[0])


def test_real_rxnfp_pretrained_head_matches_bert_for_masked_lm():
    loaded = get_family("bert").load(rxnfp_checkpoint("bert_pretrained"))
    model = transformers.BertForMaskedLM.from_pretrained(rxnfp_checkpoint("bert_pretrained")).eval()
    vocab = (rxnfp_checkpoint("bert_pretrained") / "vocab.txt").read_text().splitlines()
    specials = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    assert loaded.alphabet == tuple(t for t in vocab if t not in specials and not t.startswith("[unused"))
    smiles = ["CC(=O)O.OCC>>CC(=O)OCC", "_c1ccccc1", "CN1C=NC2=C1C(=O)N(C(=O)N2C)C"]
    encoded = loaded.tokenizer.encode(smiles)
    assert encoded.input_ids[1, 1] == vocab.index("[MASK]")
    log_probs, attention = served(loaded, smiles)
    expected = reference(model, torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
                         [vocab.index(t) for t in loaded.alphabet])
    assert max_abs(log_probs, expected, attention) <= ATOL


# -------------------------------------------------------------------------------- ONNX graph
def test_lm_head_onnx_matches_pytorch(esm2_loaded, tmp_path):
    exported = export_lm_head(esm2_loaded, tmp_path)
    assert exported.result.path == tmp_path / "lm_head.onnx"
    assert exported.report.passed and exported.report.outputs[0].max_abs_error <= ATOL
    assert exported.alphabet == esm2_loaded.alphabet
    session = ort.InferenceSession(str(exported.result.path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["hiddens"]
    assert [o.name for o in session.get_outputs()] == ["log_probs"]
    # any batch and length, unlike the traced sample
    for batch in lm_head_check_batches(esm2_loaded, [["MK_AY"], ["M", "MSLKRKNIALIPAAGIG", "LAGV_"]]):
        (onnx_log_probs,) = session.run(None, {"hiddens": batch["hiddens"]})
        assert isinstance(onnx_log_probs, np.ndarray)
        with torch.inference_mode():
            expected = esm2_loaded.lm_head(torch.from_numpy(batch["hiddens"])).numpy()
        assert onnx_log_probs.shape == expected.shape
        assert float(np.abs(onnx_log_probs - expected).max()) <= ATOL


def test_real_antiberty_lm_head_onnx_matches_pytorch(antiberty, tmp_path):
    exported = export_lm_head(antiberty, tmp_path)
    check = exported.report.outputs[0]
    assert exported.report.passed and check.max_abs_error <= ATOL
    assert check.shapes[0][-1] == 20


# -------------------------------------------------------------------------- the mask character
def test_mask_character_is_in_no_alphabet():
    assert MASK_CHAR == "_"
    protein = set("LAGVSERTIDPKQNFYMHWCXBUZO") | set("ACDEFGHIKLMNPQRSTVWY")
    assert MASK_CHAR not in protein
    rxnfp_vocab = (rxnfp_checkpoint("bert_pretrained") / "vocab.txt").read_text().splitlines()
    assert not any(MASK_CHAR in token for token in rxnfp_vocab)


def test_mask_character_maps_to_the_mask_id_and_round_trips(esm2_loaded, tmp_path):
    tokenizer = esm2_loaded.tokenizer
    encoded = tokenizer.encode(["MK_AY"])
    tokens = ["<cls>", "M", "K", "<mask>", "A", "Y", "<eos>"]
    assert encoded.input_ids[0].tolist() == [ESM_VOCAB.index(t) for t in tokens]
    assert encoded.residue_mask[0].tolist() == [False, True, True, True, True, True, False]
    assert tokenizer.to_dict()["mask_char"] == "_" and tokenizer.to_dict()["mask_token"] == "<mask>"
    path = tmp_path / "tokenizer.json"
    tokenizer.save_json(path)
    restored = CharacterTokenizer.from_json(path)
    assert restored.to_dict() == tokenizer.to_dict()
    assert restored.encode(["MK_AY"]).input_ids.tolist() == encoded.input_ids.tolist()


def test_tokenizer_json_without_mask_fields_still_loads(esm2_loaded):
    settings = esm2_loaded.tokenizer.to_dict()
    del settings["mask_char"], settings["mask_token"]
    old = CharacterTokenizer.from_dict(json.loads(json.dumps(settings)))
    assert old.mask_char is None and old.encode(["MKTAY"]).input_ids.shape == (1, 7)
    with pytest.raises(TokenizationError, match="invalid character '_' at position 2"):
        old.encode(["MK_AY"])


def test_invalid_character_error_mentions_the_mask_character(esm2_loaded):
    with pytest.raises(TokenizationError, match=r"invalid character 'j' at position 3.*'_' for a masked residue"):
        esm2_loaded.tokenizer.encode(["MK_jY"])


def test_bert_and_sentencepiece_and_smiles_mask_characters(antiberty, tmp_path):
    encoded = antiberty.tokenizer.encode(["QV_V"])
    assert encoded.input_ids[0, 3] == ANTIBERTY_VOCAB.index("[MASK]") and encoded.residue_mask[0, 3]
    esm1nv = esm1nv_tokenizer(ESM1NV_PIECES, 512)
    assert esm1nv.to_dict()["mask_token"] == "<mask>"
    restored = SentencePieceTokenizer.from_dict(json.loads(json.dumps(esm1nv.to_dict())))
    assert restored.encode(["L_A"]).input_ids[0].tolist() == [1, 5, 4, 6, 2]
    assert restored.alphabet == tuple("LASGVERTDIPKNFQYHMCWXBZUO")
    rxnfp = get_family("bert").load(rxnfp_checkpoint("bert_pretrained")).tokenizer
    assert isinstance(rxnfp, SmilesTokenizer) and rxnfp.to_dict()["mask_token"] == "[MASK]"
    again = SmilesTokenizer.from_dict(json.loads(json.dumps(rxnfp.to_dict())))
    assert again.encode(["C_O"]).input_ids.tolist() == rxnfp.encode(["C_O"]).input_ids.tolist()
    assert again.encode(["C_O"]).input_ids[0, 2] == rxnfp.vocab.index("[MASK]")


def test_mask_settings_are_checked():
    vocab = ["<pad>", "<mask>", "A", "B"]
    common: dict[str, Any] = dict(residues="AB", pad_token="<pad>", bos_token=None, eos_token=None, unk_token=None,
                                  max_length=8)
    with pytest.raises(ValueError, match="set both or neither"):
        CharacterTokenizer(vocab, mask_token="<mask>", **common)
    with pytest.raises(ValueError, match="mask_char 'A' is one of the residues"):
        CharacterTokenizer(vocab, mask_token="<mask>", mask_char="A", **common)
    with pytest.raises(ValueError, match="mask token '\\[MASK\\]' is not in the vocabulary"):
        CharacterTokenizer(vocab, mask_token="[MASK]", mask_char="_", **common)


def test_alphabet_leaves_out_aliases():
    """A ProtBert-style vocabulary with X: U Z O B are accepted (as X) but not scored separately."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"LAGEX"]
    tokenizer = CharacterTokenizer(vocab, residues="LAGEXUZOB", pad_token="[PAD]", bos_token="[CLS]",
                                   eos_token="[SEP]", unk_token="[UNK]", max_length=16,
                                   aliases={c: "X" for c in "UZOB"}, mask_token="[MASK]", mask_char="_")
    assert tokenizer.alphabet == tuple("LAGEX")
    assert tokenizer.alphabet_ids == (5, 6, 7, 8, 9)
