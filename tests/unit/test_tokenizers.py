"""The numpy character tokenizer: ids equal to the transformers tokenizers', masks, errors, and
that the module runs with numpy alone (it is copied into generated repositories)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers

from bionemo_export.models.bert import BertFamily, antiberty_checkpoint
from bionemo_export.models.esm2 import ALPHABET, Esm2Family
from bionemo_export.models.readers import Checkpoint, read_checkpoint
from bionemo_export.serving.tokenizers import character
from bionemo_export.serving.tokenizers.character import CharacterTokenizer, TokenizationError

PROTEINS = ["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "A", "LAGVSERTIDPKQNFYMHWCXBUZO"]
ANTIBODY = ["EVQLV", "SRWGGDGFYAMDY", "C", "QVQLVQSGAEVKKPGASVKVSCKASGYTFT"]


@pytest.fixture(scope="module")
def esm2(tmp_path_factory) -> CharacterTokenizer:
    folder = tmp_path_factory.mktemp("esm2")  # no vocab.txt: the fixed alphabet
    return Esm2Family().build_tokenizer(Checkpoint(folder, "huggingface", {}, {}, "model.safetensors"), None, None)


@pytest.fixture(scope="module")
def antiberty() -> CharacterTokenizer:
    checkpoint = read_checkpoint(antiberty_checkpoint())  # its vocab.txt is in the folder above
    config = transformers.BertConfig.from_dict(checkpoint.config)
    tokenizer = BertFamily().build_tokenizer(checkpoint, config, None)
    assert isinstance(tokenizer, CharacterTokenizer)  # a protein vocabulary, not a SMILES one
    return tokenizer


def bert_reference(vocab_dir: Path, vocab_size: int) -> transformers.PreTrainedTokenizerBase:
    """transformers' BertTokenizer for a vocab.txt, checked to have really read it.

    transformers 5.x traps: `BertTokenizer(vocab_file=...)` ignores the file (5-token vocabulary),
    and do_lower_case defaults to True, which turns every residue into [UNK].
    """
    reference = transformers.BertTokenizer.from_pretrained(str(vocab_dir), do_lower_case=False)
    assert len(reference) == vocab_size
    assert reference.convert_tokens_to_ids(["[CLS]", "A", "Y"]) != [reference.unk_token_id] * 3
    return reference


def test_esm2_ids_equal_transformers_esm_tokenizer(esm2, tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(ALPHABET) + "\n")
    reference = transformers.EsmTokenizer(vocab_file=str(tmp_path / "vocab.txt"))
    assert len(reference) == 33 and reference.convert_tokens_to_ids(["<cls>", "L", "O"]) == [0, 4, 28]

    expected = reference(PROTEINS, padding=True, return_tensors="np")
    encoded = esm2.encode(PROTEINS)
    np.testing.assert_array_equal(encoded.input_ids, expected["input_ids"])
    np.testing.assert_array_equal(encoded.attention_mask, expected["attention_mask"])


def test_antiberty_ids_equal_transformers_bert_tokenizer(antiberty):
    reference = bert_reference(antiberty_checkpoint().parent, vocab_size=25)
    expected = reference([" ".join(s) for s in ANTIBODY], padding=True, return_tensors="np")
    assert reference.unk_token_id not in expected["input_ids"]
    encoded = antiberty.encode(ANTIBODY)
    np.testing.assert_array_equal(encoded.input_ids, expected["input_ids"])
    np.testing.assert_array_equal(encoded.attention_mask, expected["attention_mask"])


def test_protbert_maps_rare_residues_to_x_like_its_authors(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"LAGVESIKRDTPNQFYMHCWXUBZO"]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab))
    checkpoint = Checkpoint(tmp_path, "huggingface", {}, {}, "model.safetensors",
                            files={"vocab.txt": (tmp_path / "vocab.txt").read_bytes()})
    tokenizer = BertFamily().build_tokenizer(checkpoint, transformers.BertConfig(), None)
    sequences = ["MKUZOBX", "ACBD"]
    # ProtBert's model card: space-separate the residues and replace U, Z, O, B by X.
    reference = bert_reference(tmp_path, vocab_size=30)
    spaced = [" ".join(re.sub(r"[UZOB]", "X", s)) for s in sequences]
    expected = reference(spaced, padding=True, return_tensors="np")["input_ids"]
    np.testing.assert_array_equal(tokenizer.encode(sequences).input_ids, expected)


def test_masks_cover_bos_eos_and_residues(esm2):
    encoded = esm2.encode(["MK", "A", "LAG"])
    np.testing.assert_array_equal(
        encoded.input_ids, [[0, 20, 15, 2, 1], [0, 5, 2, 1, 1], [0, 4, 5, 6, 2]]
    )
    np.testing.assert_array_equal(
        encoded.attention_mask, [[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    )
    specials = np.isin(encoded.input_ids, [esm2.bos_id, esm2.eos_id, esm2.pad_id])
    np.testing.assert_array_equal(encoded.residue_mask, ~specials)
    assert encoded.input_ids.dtype == np.int64 and encoded.attention_mask.dtype == np.int64
    assert encoded.residue_mask.dtype == bool


def test_str_bytes_and_triton_object_arrays_agree(esm2):
    as_str = esm2.encode(["MKTAY", "LAG"])
    triton_batch = np.array([[b"MKTAY"], [b"LAG"]], dtype=object).reshape(-1)
    for other in (esm2.encode([b"MKTAY", bytearray(b"LAG")]), esm2.encode(triton_batch)):
        np.testing.assert_array_equal(other.input_ids, as_str.input_ids)


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        (["MK", "A", b"M\xffK"], "sequence 2 is not valid UTF-8"),
        (["MK", ""], "sequence 1 is empty"),
        ([b""], "sequence 0 is empty"),
        (["MKtAY"], "sequence 0 has an invalid character 't' at position 2; allowed characters: LAGV"),
        (["MK", " MK"], "sequence 1 has an invalid character ' ' at position 0"),
        (["MK\n"], r"invalid character '\n' at position 2"),
        (["MKé"], "invalid character 'é' at position 2"),
        ([b"MK\xc3\xa9"], "invalid character 'é' at position 2"),
        (["MK*"], "invalid character '*'"),
        (["<mask>"], "invalid character '<'"),
        (
            ["MK", "A" * 1100],
            "sequence 1 has 1100 residues; the maximum is 1022 (1024 tokens including <cls>/<eos>)",
        ),
        (["MK", 7], "sequence 1 is int, not str or bytes"),
        ([], "no sequences to encode"),
    ],
)
def test_bad_input_is_a_tokenization_error(esm2, sequences, message):
    with pytest.raises(TokenizationError) as raised:
        esm2.encode(sequences)
    assert message in str(raised.value)


def test_truncation_keeps_the_first_residues(esm2):
    long = ("MKTAYIAKQR" * 110)[:1100]
    encoded = esm2.encode(["MK", long], truncate=True)
    assert encoded.input_ids.shape == (2, 1024)
    np.testing.assert_array_equal(encoded.input_ids[1], esm2.encode([long[:1022]]).input_ids[0])
    assert encoded.input_ids[1, -1] == esm2.eos_id
    assert encoded.residue_mask[1].sum() == 1022 and encoded.attention_mask[1].all()


def test_truncation_still_rejects_invalid_characters(esm2):
    with pytest.raises(TokenizationError, match="invalid character 'z' at position 1099"):
        esm2.encode(["A" * 1099 + "z"], truncate=True)


def test_no_bos_eos_tokenizer():
    tokenizer = CharacterTokenizer(
        ["<pad>", "A", "B"], residues="AB", pad_token="<pad>", bos_token=None, eos_token=None,
        unk_token=None, max_length=3,
    )
    encoded = tokenizer.encode(["AB", "B"])
    np.testing.assert_array_equal(encoded.input_ids, [[1, 2], [2, 0]])
    np.testing.assert_array_equal(encoded.residue_mask, encoded.attention_mask.astype(bool))
    with pytest.raises(TokenizationError, match=r"has 4 residues; the maximum is 3 \(3 tokens\)$"):
        tokenizer.encode(["ABAB"])


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"residues": "AQ"}, "residue 'Q' maps to 'Q', which is not in the vocabulary"),
        ({"residues": "AB", "aliases": {"Z": "A"}}, "aliases ['Z'] are not among the residues"),
        ({"residues": "Aé"}, "residue 'é' is not an ASCII character"),
        ({"residues": "AA"}, "repeat a character"),
        ({"bos_token": "<cls>"}, "special token '<cls>' is not in the vocabulary"),
        ({"max_length": 2}, "max_length 2 leaves no room for residues"),
    ],
)
def test_inconsistent_settings_are_refused(settings, message):
    base = {"residues": "AB", "pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": None, "max_length": 8}
    with pytest.raises(ValueError, match=re.escape(message)):
        CharacterTokenizer(["<pad>", "<s>", "</s>", "A", "B"], **(base | settings))


def test_round_trips_through_dict_and_json(antiberty, tmp_path):
    aliased = CharacterTokenizer(
        ["[PAD]", "[CLS]", "[SEP]", "A", "X"], residues="AXU", pad_token="[PAD]",
        bos_token="[CLS]", eos_token="[SEP]", unk_token=None, max_length=16, aliases={"U": "X"},
    )
    for tokenizer, sequences in ((antiberty, ANTIBODY), (aliased, ["AU", "X"])):
        tokenizer.save_json(tmp_path / "tokenizer.json")
        restored = CharacterTokenizer.from_json(tmp_path / "tokenizer.json")
        assert restored.to_dict() == tokenizer.to_dict()
        assert CharacterTokenizer.from_dict(tokenizer.to_dict()).to_dict() == tokenizer.to_dict()
        np.testing.assert_array_equal(
            restored.encode(sequences).input_ids, tokenizer.encode(sequences).input_ids
        )


def test_module_runs_with_numpy_alone(esm2, tmp_path):
    """Loaded from its file, as a generated model.py does, with torch and transformers blocked."""
    esm2.save_json(tmp_path / "tokenizer.json")
    script = f"""
import importlib.util, sys
for blocked in ("torch", "transformers", "bionemo_export"):
    sys.modules[blocked] = None
spec = importlib.util.spec_from_file_location("character", {str(Path(character.__file__))!r})
module = importlib.util.module_from_spec(spec)
sys.modules["character"] = module
spec.loader.exec_module(module)
tokenizer = module.CharacterTokenizer.from_json({str(tmp_path / "tokenizer.json")!r})
print(tokenizer.encode([b"MKTAY", "LAG"]).input_ids.tolist())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == str(esm2.encode(["MKTAY", "LAG"]).input_ids.tolist())
