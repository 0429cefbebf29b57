"""rxnfp's real pretrained reaction-SMILES BERT (from the rxnfp==0.1.0 wheel) through the `bert`
family, without a server: token ids against independent references, hiddens against transformers'
own BertModel (the repository built from it and served: tests/e2e/test_rxnfp.py)."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import LoadedModel, get_family
from bionemo_export.models.bert import (
    RXNFP_VARIANTS,
    SAMPLE_SMILES,
    BertFamily,
    is_smiles_vocab,
    rxnfp_checkpoint,
)
from bionemo_export.serving.tokenizers.character import CharacterTokenizer, TokenizationError
from bionemo_export.serving.tokenizers.smiles import REACTION_SMILES_PATTERN, SmilesTokenizer
from bionemo_export.testing.checkpoints import save_random_checkpoint

# rxnfp's regex as published in rxnfp/tokenization.py, applied with re.findall: the reference split.
RXNFP_REGEX = re.compile(
    r"(\%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>>?|\*|\$"
    r"|\%[0-9]{2}|[0-9])"
)


REACTIONS = [
    "CC(=O)O.OCC>>CC(=O)OCC",
    "CCO",
    "Brc1ccccc1.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1",
    "c1ccccc1",
    "C[C@@H](N)C(=O)O.[Na+].[OH-]>>C[C@@H](N)C(=O)[O-].[Na+]",
    "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",
]


def reference_ids(sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask) from the rxnfp regex and a vocab.txt lookup written here."""
    lines = (rxnfp_checkpoint() / "vocab.txt").read_text(encoding="utf-8").splitlines()
    vocab = {token: i for i, token in enumerate(lines)}
    rows = [[vocab["[CLS]"], *(vocab[t] for t in RXNFP_REGEX.findall(s)), vocab["[SEP]"]] for s in sequences]
    width = max(map(len, rows))
    ids = np.array([row + [vocab["[PAD]"]] * (width - len(row)) for row in rows], dtype=np.int64)
    mask = np.array([[1] * len(row) + [0] * (width - len(row)) for row in rows], dtype=np.int64)
    return ids, mask


def run(model: LoadedModel, sequences: list[str]):
    encoded = model.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = model.encoder(*(torch.from_numpy(a) for a in
                                              (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens.numpy(), embeddings.numpy(), encoded


def test_checkpoint_is_found_in_the_wheel_without_importing_rxnfp():
    folder = rxnfp_checkpoint()
    assert {"config.json", "pytorch_model.bin", "vocab.txt"} <= {p.name for p in folder.iterdir()}
    assert "model_type" not in json.loads((folder / "config.json").read_text())  # read as the named family
    assert all(rxnfp_checkpoint(variant).name == variant for variant in RXNFP_VARIANTS)
    with pytest.raises(ValueError, match="unknown rxnfp model 'bert_large'"):
        rxnfp_checkpoint("bert_large")


def test_checkpoint_names_the_package_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps rxnfp==0.1.0")):
        rxnfp_checkpoint()


def test_the_vocabulary_picks_the_tokenizer(rxnfp):
    assert isinstance(rxnfp.tokenizer, SmilesTokenizer)
    assert rxnfp.tokenizer.pattern == REACTION_SMILES_PATTERN
    tokenizer = rxnfp.tokenizer
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("[CLS]", "[SEP]", "[PAD]")
    assert rxnfp.tokenizer.max_length == 512 and rxnfp.tokenizer.vocab_size == 591
    assert is_smiles_vocab(rxnfp.tokenizer.vocab)
    assert not is_smiles_vocab(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"ACDEFGHIKLMNPQRSTVWY"])


def test_samples_fit_the_loaded_checkpoint(rxnfp, tmp_path):
    # The family's own samples stay protein; the loaded SMILES model's family gives SMILES.
    registered = get_family("bert")
    assert isinstance(registered, BertFamily) and registered.alphabet == "protein"
    assert BertFamily().sample_sequences()[0] == "EVQLV"
    samples = rxnfp.family.sample_sequences()
    assert rxnfp.family.name == "bert" and samples == list(SAMPLE_SMILES)
    assert any(">>" in s for s in samples) and any(">>" not in s for s in samples)
    assert rxnfp.tokenizer.encode(samples).residue_mask.sum() == sum(len(RXNFP_REGEX.findall(s)) for s in samples)
    protein = get_family("bert").load(save_random_checkpoint("bert", tmp_path / "protein"))
    assert isinstance(protein.tokenizer, CharacterTokenizer) and protein.family.sample_sequences()[0] == "EVQLV"


def test_token_ids_equal_the_rxnfp_regex_with_a_vocab_lookup(rxnfp):
    ids, mask = reference_ids(REACTIONS + list(SAMPLE_SMILES))
    encoded = rxnfp.tokenizer.encode(REACTIONS + list(SAMPLE_SMILES))
    np.testing.assert_array_equal(encoded.input_ids, ids)
    np.testing.assert_array_equal(encoded.attention_mask, mask)
    # residue_mask: the SMILES tokens only ([CLS], [SEP] and padding excluded).
    np.testing.assert_array_equal(encoded.residue_mask, (mask == 1) & (ids != 12) & (ids != 13))
    assert 1 not in encoded.input_ids  # never [UNK]


def test_token_ids_equal_transformers_bert_tokenizer_on_pre_split_tokens(rxnfp):
    # transformers' BERT pre-tokenizer would split "[C@@H]" and ">>" apart: give it rxnfp's tokens.
    reference = transformers.BertTokenizer.from_pretrained(str(rxnfp_checkpoint()), do_lower_case=False)
    assert len(reference) == 591  # it really read vocab.txt (docs/reference/platform.md's trap)
    assert reference.convert_tokens_to_ids(["[PAD]", "[CLS]", "[SEP]", ">>", "[C@@H]"]) == [0, 12, 13, 29, 35]
    encoded = rxnfp.tokenizer.encode(REACTIONS)
    for row, smiles in enumerate(REACTIONS):
        expected = [reference.cls_token_id, *reference.convert_tokens_to_ids(RXNFP_REGEX.findall(smiles)),
                    reference.sep_token_id]
        assert reference.unk_token_id not in expected
        length = int(encoded.attention_mask[row].sum())
        assert encoded.input_ids[row, :length].tolist() == expected


def test_unknown_tokens_are_errors_naming_them(rxnfp):
    unknown = "sequence 1: token '[Xx]' at character 2 is not in the vocabulary"
    with pytest.raises(TokenizationError, match=re.escape(unknown)):
        rxnfp.tokenizer.encode(["CCO", "CC[Xx]O"])
    with pytest.raises(TokenizationError, match=re.escape("sequence 0: token ' ' at character 3")):
        rxnfp.tokenizer.encode(["CCO CC"])


def test_hiddens_equal_transformers_bert_model(rxnfp):
    # transformers annotates from_pretrained as returning the model alone, output_loading_info or not
    reference, info = transformers.BertModel.from_pretrained(  # pyright: ignore[reportGeneralTypeIssues]
        str(rxnfp_checkpoint()), add_pooling_layer=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    ids, mask = reference_ids(REACTIONS)
    with torch.no_grad():
        expected = reference.eval()(input_ids=torch.from_numpy(ids),
                                    attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    hiddens, embeddings, encoded = run(rxnfp, REACTIONS)
    real = mask.astype(bool)
    assert np.abs(hiddens - expected)[real].max() < 1e-5
    residues = encoded.residue_mask[..., None]
    pooled = (expected * residues).sum(1) / residues.sum(1)
    assert np.abs(embeddings - pooled).max() < 1e-5
    assert rxnfp.description["layers"] == 12 and rxnfp.hidden_size == 256


def test_fine_tuned_variant_loads_strictly():
    model = get_family("bert").load(rxnfp_checkpoint("bert_ft"))
    assert isinstance(model.tokenizer, SmilesTokenizer) and model.hidden_size == 256
