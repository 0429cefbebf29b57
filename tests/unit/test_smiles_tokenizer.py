"""The numpy SMILES tokenizer: MegaMolBART's regex, ids, masks, errors, truncation, decoding, and
that the module runs with numpy alone beside character.py (it is copied into generated repositories)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bionemo_export.model_repository.encoder import served_package
from bionemo_export.serving.tokenizers import character, smiles
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.serving.tokenizers.smiles import SPECIAL_TOKENS, SmilesTokenizer, build_vocab, tokenize

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


def _copy_served_package(folder: Path) -> None:
    """The served package as a repository's version folder holds it (bionemo_serving/)."""
    for relative, source in served_package().items():
        assert isinstance(source, Path)
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_bytes(source.read_bytes())


def test_module_runs_in_the_copied_served_package_with_numpy_alone(tokenizer, tmp_path):
    """Imported from the served package copied into a version folder, as a generated model.py
    does, with torch, transformers and bionemo_export blocked."""
    assert character.__file__ is not None and smiles.__file__ is not None  # imported from their files
    _copy_served_package(tmp_path)
    tokenizer.save_json(tmp_path / "tokenizer.json")
    script = f"""
import sys
for blocked in ("torch", "transformers", "bionemo_export"):
    sys.modules[blocked] = None
sys.path.insert(0, {str(tmp_path)!r})
from bionemo_serving.tokenizers.character import TokenizationError
from bionemo_serving.tokenizers.smiles import SmilesTokenizer
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


# --- the generalized tokenizer: any regex, bos/eos around each sequence (BERT SMILES models) ----

# rxnfp's regex as its authors publish it (one capturing group, applied with re.findall): the
# independent reference for REACTION_SMILES_PATTERN.
RXNFP_REGEX = re.compile(
    r"(\%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>>?|\*|\$"
    r"|\%[0-9]{2}|[0-9])"
)
REACTIONS = [
    "CC(=O)O.OCC>>CC(=O)OCC",
    "Brc1ccccc1.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1",
    "C[C@@H](N)C(=O)O.[Na+].[OH-]>>C[C@@H](N)C(=O)[O-].[Na+]",
    "CCO",
    "C1CC%(123)CC1%(123)",  # three-digit ring closure
    "CC>O>CC|c1ccccc1",  # reagents between single '>' and the '|' fragment separator
    "F/C=C\\F",
]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_smiles(vocab, max_length=16, **options) -> SmilesTokenizer:
    settings = dict(pattern=smiles.REACTION_SMILES_PATTERN, pad_token="[PAD]", unk_token="[UNK]",
                    bos_token="[CLS]", eos_token="[SEP]", begin_token=None, end_token=None)
    return SmilesTokenizer(vocab, max_length=max_length, **{**settings, **options})


@pytest.fixture(scope="module")
def reaction_tokenizer() -> SmilesTokenizer:
    tokens = sorted({t for r in REACTIONS for t in RXNFP_REGEX.findall(r)})
    return bert_smiles(BERT_SPECIALS + tokens, max_length=64)


@pytest.mark.parametrize("text", REACTIONS)
def test_reaction_pattern_splits_like_rxnfps_regex(text):
    assert tokenize(text, smiles.REACTION_SMILES_PATTERN) == RXNFP_REGEX.findall(text)


def test_reaction_pattern_differs_from_megamolbarts_where_it_should():
    assert tokenize("CC>>CO", smiles.REACTION_SMILES_PATTERN) == ["C", "C", ">>", "C", "O"]
    assert tokenize("CC>>CO") == ["C", "C", ">", ">", "C", "O"]  # MegaMolBART's: two '>'
    assert tokenize("C%(123)", smiles.REACTION_SMILES_PATTERN) == ["C", "%(123)"]
    # A pattern with capturing groups still yields whole tokens, and the catch-all keeps every char.
    assert tokenize("C>>O x", r"(>>)|(C)|O") == ["C", ">>", "O", " ", "x"]


def test_bert_ids_and_masks_have_cls_and_sep(reaction_tokenizer):
    batch = ["CC(=O)O.OCC>>CC(=O)OCC", "CCO"]
    encoded = reaction_tokenizer.encode(batch)
    ids = {t: i for i, t in enumerate(reaction_tokenizer.vocab)}
    expected = [[ids["[CLS]"], *(ids[t] for t in RXNFP_REGEX.findall(s)), ids["[SEP]"]] for s in batch]
    width = max(map(len, expected))
    np.testing.assert_array_equal(encoded.input_ids, [row + [ids["[PAD]"]] * (width - len(row)) for row in expected])
    lengths = [len(row) for row in expected]
    np.testing.assert_array_equal(encoded.attention_mask, [[int(i < n) for i in range(width)] for n in lengths])
    # residue_mask: exactly the SMILES tokens, never [CLS]/[SEP]/padding.
    np.testing.assert_array_equal(encoded.residue_mask, [[0 < i < n - 1 for i in range(width)] for n in lengths])
    assert encoded.residue_mask.dtype == bool and encoded.input_ids.dtype == np.int64
    assert (reaction_tokenizer.bos_id, reaction_tokenizer.eos_id, reaction_tokenizer.pad_id) == (2, 3, 0)
    assert reaction_tokenizer.unknown_id == 1 and reaction_tokenizer.begin_id is None
    assert reaction_tokenizer.max_tokens == 62


def test_bert_max_length_counts_cls_and_sep():
    tokenizer = bert_smiles(BERT_SPECIALS + ["C", "O"], max_length=6)  # 4 SMILES tokens
    assert tokenizer.encode(["CCCO"]).input_ids.shape == (1, 6)
    with pytest.raises(TokenizationError, match=re.escape(
            "sequence 1 has 5 tokens; the maximum is 4 (6 tokens including [CLS]/[SEP])")):
        tokenizer.encode(["CO", "CCCCO"])
    truncated = tokenizer.encode(["CO", "CCCCO"], truncate=True)
    np.testing.assert_array_equal(truncated.input_ids, [[2, 5, 6, 3, 0, 0], [2, 5, 5, 5, 5, 3]])
    assert truncated.residue_mask[1].sum() == 4 and not truncated.residue_mask[:, [0, -1]].any()
    with pytest.raises(ValueError, match="max_length 2 leaves no room for tokens"):
        bert_smiles(BERT_SPECIALS + ["C"], max_length=2)


@pytest.mark.parametrize(
    ("sequences", "message"),
    [
        (["CCO", "CC[Xe]O"], "sequence 1: token '[Xe]' at character 2 is not in the vocabulary"),
        (["CC O"], "sequence 0: token ' ' at character 2 is not in the vocabulary"),
        (["CC>>CO", "CCé"], "sequence 1: token 'é' at character 2"),
        (["CC", ""], "sequence 1 is empty"),
    ],
)
def test_bert_unknown_tokens_are_errors_never_unk(reaction_tokenizer, sequences, message):
    with pytest.raises(TokenizationError, match=re.escape(message)):
        reaction_tokenizer.encode(sequences)


def test_bert_decode_inverts_encode(reaction_tokenizer):
    assert reaction_tokenizer.decode_batch(reaction_tokenizer.encode(REACTIONS).input_ids) == REACTIONS


def test_megamolbart_vocabulary_check_only_for_megamolbarts_begin_and_end():
    bert_smiles(BERT_SPECIALS + ["C"])  # no <PAD> ? ^ & ... prefix needed without ^/&
    with pytest.raises(ValueError, match="must start with the special tokens"):
        SmilesTokenizer(BERT_SPECIALS + ["^", "&", "C"], max_length=8, pad_token="[PAD]")
    with pytest.raises(ValueError, match=re.escape("special token '[CLS]' is not in the vocabulary")):
        bert_smiles(["[PAD]", "[UNK]", "[SEP]", "C"])
    with pytest.raises(ValueError, match="invalid tokenization pattern"):
        bert_smiles(BERT_SPECIALS + ["C"], pattern="[C")


def test_bert_settings_round_trip_and_old_dicts_keep_megamolbarts_defaults(reaction_tokenizer, tokenizer, tmp_path):
    reaction_tokenizer.save_json(tmp_path / "tokenizer.json")
    restored = SmilesTokenizer.from_json(tmp_path / "tokenizer.json")
    assert restored.to_dict() == reaction_tokenizer.to_dict()
    assert restored.to_dict()["type"] == "smiles" and restored.pattern == smiles.REACTION_SMILES_PATTERN
    np.testing.assert_array_equal(restored.encode(REACTIONS).input_ids, reaction_tokenizer.encode(REACTIONS).input_ids)
    # A tokenizer.json written before the settings existed: vocab and max_length only.
    old = SmilesTokenizer.from_dict({"type": "smiles", "vocab": list(tokenizer.vocab), "max_length": 24})
    assert old.to_dict() == tokenizer.to_dict()
    assert (old.pattern, old.pad_token, old.bos_token, old.eos_token, old.begin_token, old.end_token) == (
        smiles.MEGAMOLBART_PATTERN, "<PAD>", None, None, "^", "&")


def test_bert_module_runs_in_the_copied_served_package_with_numpy_alone(reaction_tokenizer, tmp_path):
    _copy_served_package(tmp_path)
    reaction_tokenizer.save_json(tmp_path / "tokenizer.json")
    script = f"""
import sys
for blocked in ("torch", "transformers", "bionemo_export"):
    sys.modules[blocked] = None
sys.path.insert(0, {str(tmp_path)!r})
from bionemo_serving.tokenizers.smiles import SmilesTokenizer
tokenizer = SmilesTokenizer.from_json({str(tmp_path / "tokenizer.json")!r})
encoded = tokenizer.encode([b"CC(=O)O.OCC>>CC(=O)OCC", "CCO"])
print(encoded.input_ids.tolist(), encoded.residue_mask.tolist())
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    encoded = reaction_tokenizer.encode(["CC(=O)O.OCC>>CC(=O)OCC", "CCO"])
    assert result.stdout.strip() == f"{encoded.input_ids.tolist()} {encoded.residue_mask.tolist()}"


def test_encoding_a_large_batch_is_fast(reaction_tokenizer):
    import time

    batch = REACTIONS * 150  # ~1,000 sequences
    reaction_tokenizer.encode(batch)
    # CPU seconds, not wall: five test workers share two cores, and a wall-clock bound measures them.
    start = time.process_time()
    encoded = reaction_tokenizer.encode(batch)
    elapsed = time.process_time() - start
    assert encoded.input_ids.shape[0] == len(batch)
    assert elapsed < 0.5, f"{elapsed:.3f} CPU-s for {len(batch)} sequences"
