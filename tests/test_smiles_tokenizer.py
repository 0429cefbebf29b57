"""The numpy SMILES tokenizer: MegaMolBART's regex, ids, masks, errors, truncation, decoding, and
that the module runs with numpy alone beside character.py (it is copied into generated repositories)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bionemo_export.tokenizers import character, smiles
from bionemo_export.tokenizers.character import TokenizationError
from bionemo_export.tokenizers.smiles import SPECIAL_TOKENS, SmilesTokenizer, build_vocab, tokenize

MOLECULES = [
    "CCO",
    "CC(=O)Oc1ccccc1C(=O)O",
    "C[C@@H](Cl)Br",
    "c1ccc2c(c1)C%12CC2CC%12",
    "[NH3+]CC(=O)[O-].[Na+]",
    "F/C=C\\F",
    "C#N",
]


@pytest.fixture(scope="module")
def tokenizer() -> SmilesTokenizer:
    return SmilesTokenizer(build_vocab(MOLECULES), max_length=24)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("CCO", ["C", "C", "O"]),
        ("ClCBr", ["Cl", "C", "Br"]),  # two-letter halogens are one token
        ("BC", ["B", "C"]),  # ... but B and C alone are atoms too
        ("C[C@@H](N)c1ccccc1", ["C", "[C@@H]", "(", "N", ")", "c", "1", "c", "c", "c", "c", "c", "1"]),
        ("[NH3+]CC(=O)[O-]", ["[NH3+]", "C", "C", "(", "=", "O", ")", "[O-]"]),
        ("C%12CC%12", ["C", "%12", "C", "C", "%12"]),  # two-digit ring closures
        ("C12CC1C2", ["C", "1", "2", "C", "C", "1", "C", "2"]),  # single digits are separate
        ("F/C=C\\F", ["F", "/", "C", "=", "C", "\\", "F"]),
        ("C#N.[Na+]", ["C", "#", "N", ".", "[Na+]"]),
        ("[13CH4]", ["[13CH4]"]),
        ("Xe C\n", ["X", "e", " ", "C", "\n"]),  # the catch-all: every character is in some token
    ],
)
def test_regex_tokens(text, tokens):
    assert tokenize(text) == tokens


def test_vocabulary_starts_with_the_special_tokens_then_sorted_tokens():
    vocab = build_vocab(["CCl", "c1ccccc1"])
    assert vocab == ["<PAD>", "?", "^", "&", "<MASK>", "<SEP>", "1", "C", "Cl", "c"]


def test_ids_and_masks(tokenizer):
    encoded = tokenizer.encode(["CCO", "C[C@@H](Cl)Br"])
    ids = {token: i for i, token in enumerate(tokenizer.vocab)}
    expected = [
        [ids["C"], ids["C"], ids["O"], 0, 0, 0],
        [ids[t] for t in ("C", "[C@@H]", "(", "Cl", ")", "Br")],
    ]
    np.testing.assert_array_equal(encoded.input_ids, expected)
    np.testing.assert_array_equal(encoded.attention_mask, [[1, 1, 1, 0, 0, 0], [1] * 6])
    # MegaMolBART's mask is the padding mask: no begin/end tokens on the encoder input.
    np.testing.assert_array_equal(encoded.residue_mask, encoded.attention_mask.astype(bool))
    assert encoded.input_ids.dtype == np.int64 and encoded.attention_mask.dtype == np.int64
    assert encoded.residue_mask.dtype == bool


def test_special_ids_and_attributes(tokenizer):
    assert (tokenizer.pad_id, tokenizer.unknown_id, tokenizer.begin_id, tokenizer.end_id) == (0, 1, 2, 3)
    assert tokenizer.pad_token == "<PAD>" and tokenizer.bos_token is None and tokenizer.eos_token is None
    assert (tokenizer.begin_token, tokenizer.end_token) == ("^", "&")
    assert tokenizer.vocab_size == len(tokenizer.vocab) and tokenizer.max_length == 24


def test_str_bytes_and_triton_object_arrays_agree(tokenizer):
    as_str = tokenizer.encode(["CCO", "C#N"])
    triton_batch = np.array([[b"CCO"], [b"C#N"]], dtype=object).reshape(-1)
    for other in (tokenizer.encode([b"CCO", bytearray(b"C#N")]), tokenizer.encode(triton_batch)):
        np.testing.assert_array_equal(other.input_ids, as_str.input_ids)


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        (["CC", b"C\xffC"], "sequence 1 is not valid UTF-8"),
        (["CC", ""], "sequence 1 is empty"),
        (["CC", 7], "sequence 1 is int, not str or bytes"),
        ([], "no sequences to encode"),
        (["CCO", "CCXx"], "sequence 1: token 'X' at character 2 is not in the vocabulary"),
        (["CC[Fe]"], "sequence 0: token '[Fe]' at character 2 is not in the vocabulary"),
        (["CC O"], "sequence 0: token ' ' at character 2 is not in the vocabulary"),
        (["CCé"], "token 'é' at character 2"),
        (["C" * 25], "sequence 0 has 25 tokens; the maximum is 24"),
        (["CO", "Cl" * 25], "sequence 1 has 25 tokens; the maximum is 24"),
    ],
)
def test_bad_input_is_a_tokenization_error(tokenizer, sequences, message):
    with pytest.raises(TokenizationError, match=re.escape(message)):
        tokenizer.encode(sequences)


def test_unknown_token_is_never_emitted_silently(tokenizer):
    # '?' is MegaMolBART's unknown token; a token missing from the vocabulary is an error instead.
    with pytest.raises(TokenizationError, match=re.escape("token '[Si]' at character 1")):
        tokenizer.encode(["C[Si]"])
    assert tokenizer.unknown_id not in tokenizer.encode(MOLECULES).input_ids


def test_truncation_keeps_the_first_tokens(tokenizer):
    long = "CCl" * 15  # 30 tokens
    encoded = tokenizer.encode(["CO", long], truncate=True)
    assert encoded.input_ids.shape == (2, 24) and encoded.attention_mask[1].all()
    np.testing.assert_array_equal(encoded.input_ids[1], tokenizer.encode([long[:36]]).input_ids[0])
    with pytest.raises(TokenizationError, match="token 'X' at character 45"):
        tokenizer.encode([long + "X"], truncate=True)


def test_decode_inverts_encode(tokenizer):
    encoded = tokenizer.encode(MOLECULES)
    assert tokenizer.decode_batch(encoded.input_ids) == MOLECULES
    for molecule, ids in zip(MOLECULES, encoded.input_ids):
        assert tokenizer.decode(ids.tolist()) == molecule


def test_decode_skips_begin_and_padding_and_stops_at_end(tokenizer):
    ids = tokenizer.encode(["CCO"]).input_ids[0].tolist()
    assert tokenizer.decode([tokenizer.begin_id, *ids, tokenizer.end_id, *ids]) == "CCO"
    assert tokenizer.decode([tokenizer.begin_id, tokenizer.pad_id, *ids, tokenizer.pad_id]) == "CCO"
    assert tokenizer.decode([tokenizer.end_id, *ids]) == ""
    with pytest.raises(ValueError, match=r"id 99 is not in the vocabulary \(\d+ tokens\)"):
        tokenizer.decode([*ids, 99])


@pytest.mark.parametrize(
    ("vocab", "max_length", "message"),
    [
        (["<PAD>", "?", "^", "&", "<MASK>", "C"], 8, "must start with the special tokens"),
        (["?", "<PAD>", "^", "&", "<MASK>", "<SEP>"], 8, "must start with the special tokens"),
        ([*SPECIAL_TOKENS, "C", "C"], 8, "duplicate tokens"),
        ([*SPECIAL_TOKENS, "C"], 0, "max_length 0 leaves no room for tokens"),
    ],
)
def test_inconsistent_settings_are_refused(vocab, max_length, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SmilesTokenizer(vocab, max_length=max_length)


def test_round_trips_through_dict_and_json(tokenizer, tmp_path):
    assert tokenizer.to_dict()["type"] == "smiles"
    tokenizer.save_json(tmp_path / "tokenizer.json")
    restored = SmilesTokenizer.from_json(tmp_path / "tokenizer.json")
    assert restored.to_dict() == tokenizer.to_dict()
    np.testing.assert_array_equal(restored.encode(MOLECULES).input_ids, tokenizer.encode(MOLECULES).input_ids)
    with pytest.raises(ValueError, match="not a SMILES tokenizer: type is 'character'"):
        SmilesTokenizer.from_dict({**tokenizer.to_dict(), "type": "character"})


def test_module_runs_beside_character_with_numpy_alone(tokenizer, tmp_path):
    """Copied next to character.py and imported as top-level modules, as a generated model.py
    does, with torch, transformers and bionemo_export blocked."""
    for module in (character, smiles):
        (tmp_path / Path(module.__file__).name).write_text(Path(module.__file__).read_text())
    tokenizer.save_json(tmp_path / "tokenizer.json")
    script = f"""
import sys
for blocked in ("torch", "transformers", "bionemo_export"):
    sys.modules[blocked] = None
sys.path.insert(0, {str(tmp_path)!r})
from character import TokenizationError
from smiles import SmilesTokenizer
tokenizer = SmilesTokenizer.from_json({str(tmp_path / "tokenizer.json")!r})
print(tokenizer.encode([b"CCO", "C[C@@H](Cl)Br"]).input_ids.tolist())
try:
    tokenizer.encode(["CX"])
except TokenizationError as err:
    print(err)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    ids, error = result.stdout.strip().splitlines()
    assert ids == str(tokenizer.encode(["CCO", "C[C@@H](Cl)Br"]).input_ids.tolist())
    assert error == "sequence 0: token 'X' at character 1 is not in the vocabulary"
