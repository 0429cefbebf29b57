"""SaProt's structure-aware tokenizer: every token pairs a residue with a Foldseek 3Di structure
letter, vectorized with numpy.

Part of the served package, copied whole into generated Triton Python-backend model folders, next to
character.py, and imported there as a top-level module: it imports only the standard library,
numpy and its sibling (never torch or bionemo_export).

SaProt's vocabulary (its Hugging Face vocab.txt; utils/esm_loader.py of westlake-repl/SaProt
builds the same list) is 5 special tokens, `<cls> <pad> <eos> <unk> <mask>`, then one token per
(residue, structure letter) pair, residue-major: the residues `ACDEFGHIKLMNPQRSTVWY#` times the
structure letters `pynwrqhgdlvtmfsaeikc#` (446 tokens). `#` as the structure letter means the
structure is unknown; `#` as the residue means the residue is masked (its structure still known).

An input sequence is read in one of two forms:

- **structure-aware**: residue and 3Di letter alternate, `MdEvVp` (residues uppercase, 3Di letters
  lowercase, `#` in either place as above). A sequence is read this way when it holds a lowercase
  letter, or when it has an even length and every second character is `#` (`M#E#V#`, all
  structure unknown);
- **plain**: residues only, `MEV`, each read with the unknown structure letter (`M#`, `E#`, `V#`),
  and `#` a masked residue (`##`).

One token per residue: BOS (`<cls>`) + residues + EOS (`<eos>`), padded with `<pad>`; lengths and
limits count residues (pairs), not characters. Bad input is an error naming the sequence, the
character (0-based, as the character tokenizer counts) and the residue (1-based); nothing is
lowercased, stripped or replaced by `<unk>`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from .character import Encoded, TokenIds, TokenizationError, _utf8, assemble, read_tokenizer_file

RESIDUES = "ACDEFGHIKLMNPQRSTVWY"
"""SaProt's amino acids, in vocabulary order (utils/constants.py's foldseek_seq_vocab without `#`)."""
STRUCTURE_LETTERS = "pynwrqhgdlvtmfsaeikc"
"""Foldseek's 3Di letters, in vocabulary order (utils/constants.py's foldseek_struc_vocab without `#`)."""
UNKNOWN = "#"
"""The structure letter of an unknown structure, and the residue of a masked one."""
SPECIAL_TOKENS = ("<cls>", "<pad>", "<eos>", "<unk>", "<mask>")
"""SaProt's first five token ids, in order."""


def saprot_vocabulary() -> list[str]:
    """SaProt's 446 tokens in id order: the specials, then every residue (and `#`) paired with every
    3Di letter (and `#`), residue-major."""
    return [*SPECIAL_TOKENS, *(residue + letter for residue in RESIDUES + UNKNOWN
                               for letter in STRUCTURE_LETTERS + UNKNOWN)]


PAIRED_TOKENS = 100
"""How many residue/3Di tokens make a vocabulary SaProt-like (SaProt's has 441; a SMILES BERT's
`Cl` and `Br` are two)."""


def paired_tokens(tokens: Sequence[str]) -> int:
    """How many of `tokens` are a SaProt residue (or `#`) followed by a 3Di letter (or `#`)."""
    residues, letters = set(RESIDUES + UNKNOWN), set(STRUCTURE_LETTERS + UNKNOWN)
    return sum(1 for t in tokens if len(t) == 2 and t[0] in residues and t[1] in letters)


_LOWERCASE = re.compile("[a-z]")
_RESIDUE_SET = frozenset(RESIDUES + UNKNOWN)
_LETTER_SET = frozenset(STRUCTURE_LETTERS + UNKNOWN)


def is_structure_aware(text: str) -> bool:
    """Whether `text` is read as a structure-aware sequence (see the module docstring)."""
    if _LOWERCASE.search(text):
        return True
    return len(text) % 2 == 0 and text[1::2] == UNKNOWN * (len(text) // 2)


def split_pairs(text: str, index: int = 0) -> tuple[str, str]:
    """(residues, structure letters) of one sequence in either form, one character each per residue;
    TokenizationError naming sequence `index` for anything else. Residues are RESIDUES or `#`,
    structure letters STRUCTURE_LETTERS or `#`."""
    if not text:
        raise TokenizationError(f"sequence {index} is empty")
    paired = is_structure_aware(text)
    if not paired:
        residues, letters = text, UNKNOWN * len(text)
    else:
        if len(text) % 2:
            raise TokenizationError(
                f"sequence {index} is structure-aware (it holds lowercase 3Di letters) but has an odd length, "
                f"{len(text)} characters: write each residue followed by its 3Di letter ('#' where the structure "
                "is unknown), like MdEvVp")
        residues, letters = text[0::2], text[1::2]
    if set(residues) <= _RESIDUE_SET and set(letters) <= _LETTER_SET:  # C-speed check; the loop finds the error
        return residues, letters
    for residue_index, (residue, letter) in enumerate(zip(residues, letters)):
        if residue not in RESIDUES and residue != UNKNOWN:
            place = 2 * residue_index if paired else residue_index
            raise TokenizationError(_bad_residue(index, place, residue_index, residue))
        if letter not in STRUCTURE_LETTERS and letter != UNKNOWN:
            raise TokenizationError(
                f"sequence {index} has {letter!r} at character {2 * residue_index + 1} (residue {residue_index + 1}'s "
                f"structure letter), which is not a Foldseek 3Di letter; 3Di letters: {STRUCTURE_LETTERS}, and "
                f"'{UNKNOWN}' for an unknown structure")
    return residues, letters


def _bad_residue(index: int, character: int, residue_index: int, residue: str) -> str:
    if residue.isascii() and residue.islower():
        why = "a residue is an uppercase letter (its 3Di letter follows it in lowercase)"
    else:
        why = f"residues: {RESIDUES}, and '{UNKNOWN}' for a masked residue"
    return (f"sequence {index} has {residue!r} at character {character} (residue {residue_index + 1}), which is not "
            f"one of SaProt's residues; {why}")


class StructureAwareTokenizer(TokenIds):
    """SaProt's tokenizer over `vocab` (its vocab.txt, checked to be SaProt's pairs): see the
    module docstring. `max_length` counts tokens, BOS/EOS included. The mask character is `#`
    (the residue of a masked pair); the masked-LM alphabet is the 20 residues, whose log-probability
    marginalizes the 21 structure letters (models/saprot.py)."""

    structure_aware = True
    """Sequences are structure-aware (read by split_pairs): what N_scores' planner asks."""

    def __init__(self, vocab: Sequence[str], *, max_length: int, pad_token: str = "<pad>",
                 bos_token: str | None = "<cls>", eos_token: str | None = "<eos>", unk_token: str | None = "<unk>",
                 mask_token: str | None = "<mask>", mask_char: str | None = UNKNOWN) -> None:
        self.vocab = tuple(vocab)
        self.max_length = int(max_length)
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = pad_token, bos_token, eos_token, unk_token
        self.mask_token, self.mask_char = mask_token, mask_char
        self._ids = {token: i for i, token in enumerate(self.vocab)}
        if len(self._ids) != len(self.vocab):
            raise ValueError("the vocabulary has duplicate tokens")
        for token in (pad_token, bos_token, eos_token, unk_token, mask_token):
            if token is not None and token not in self._ids:
                raise ValueError(f"special token {token!r} is not in the vocabulary")
        if mask_char != UNKNOWN:
            raise ValueError(f"mask_char is {mask_char!r}; SaProt's masked residue is written {UNKNOWN!r}")
        missing = [r + s for r in RESIDUES + UNKNOWN for s in STRUCTURE_LETTERS + UNKNOWN if r + s not in self._ids]
        if missing:
            raise ValueError(f"the vocabulary lacks SaProt's pair tokens {missing[:5]}"
                             f"{' ...' if len(missing) > 5 else ''}")
        if self.max_residues < 1:
            raise ValueError(f"max_length {max_length} leaves no room for residues")
        # pair table: [residue byte, structure byte] -> token id (only the valid pairs are ever read)
        self._pairs = np.full((128, 128), -1, dtype=np.int64)
        for residue in RESIDUES + UNKNOWN:
            for letter in STRUCTURE_LETTERS + UNKNOWN:
                self._pairs[ord(residue), ord(letter)] = self._ids[residue + letter]

    @property
    def residues(self) -> str:
        """The residue letters a plain sequence may hold (besides `#`)."""
        return RESIDUES

    @property
    def alphabet(self) -> tuple[str, ...]:
        """The residues a masked-LM head scores, in vocabulary order (`#`, the masked residue, is not one)."""
        return tuple(RESIDUES)

    @property
    def alphabet_ids(self) -> tuple[int, ...]:
        """The token of each alphabet residue read without structure (`A#`, ...): what a plain residue encodes to."""
        return tuple(self._ids[residue + UNKNOWN] for residue in RESIDUES)

    def structure_groups(self) -> tuple[tuple[int, ...], ...]:
        """For each alphabet residue, in order, the ids of its tokens with every structure letter
        (the 21 ids whose probabilities sum to the residue's)."""
        return tuple(tuple(self._ids[residue + letter] for letter in STRUCTURE_LETTERS + UNKNOWN)
                     for residue in RESIDUES)

    def paired(self, text: str | bytes) -> str:
        """`text` spelled structure-aware, two characters a residue (a plain residue with `#`): how
        windows over long proteins cut it (serving/encoding.py). TokenizationError for bad input."""
        data = _utf8(0, text)
        if not data.isascii():
            return self._non_ascii(0, data)
        residues, letters = split_pairs(data.decode("ascii"))
        return "".join(residue + letter for residue, letter in zip(residues, letters))

    @property
    def max_residues(self) -> int:
        return self.max_length - len(self._specials())

    def _specials(self) -> list[str]:
        return [token for token in (self.bos_token, self.eos_token) if token is not None]

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch (either form, per sequence). Over `max_residues` residues is an error
        unless `truncate`."""
        raw = [_utf8(i, seq) for i, seq in enumerate(sequences)]
        if not raw:
            raise TokenizationError("no sequences to encode")
        residue_bytes, letter_bytes = [], []
        for index, data in enumerate(raw):
            if not data.isascii():
                self._non_ascii(index, data)
            residues, letters = split_pairs(data.decode("ascii"), index)
            residue_bytes.append(residues.encode("ascii"))
            letter_bytes.append(letters.encode("ascii"))
        lengths = np.fromiter(map(len, residue_bytes), dtype=np.int64, count=len(raw))
        too_long = np.flatnonzero(lengths > self.max_residues)
        if too_long.size and not truncate:
            first = int(too_long[0])
            raise TokenizationError(f"sequence {first} has {int(lengths[first])} residues; the maximum is "
                                    f"{self.max_residues} ({self.max_length} tokens including "
                                    f"{'/'.join(self._specials())})")
        ids = self._pairs[np.frombuffer(b"".join(residue_bytes), dtype=np.uint8),
                          np.frombuffer(b"".join(letter_bytes), dtype=np.uint8)]
        return assemble(ids, lengths, limit=self.max_residues, pad_id=self.pad_id, bos_id=self.bos_id,
                        eos_id=self.eos_id)

    @staticmethod
    def _non_ascii(index: int, data: bytes) -> NoReturn:
        text = data.decode("utf-8", "surrogatepass")
        position, char = next((p, c) for p, c in enumerate(text) if not c.isascii())
        raise TokenizationError(f"sequence {index} has an invalid character {char!r} at character {position}; SaProt "
                                f"reads residues {RESIDUES}, 3Di letters {STRUCTURE_LETTERS} and '{UNKNOWN}'")

    def to_dict(self) -> dict[str, Any]:
        return {"vocab": list(self.vocab), "residues": RESIDUES, "max_length": self.max_length,
                "pad_token": self.pad_token, "bos_token": self.bos_token, "eos_token": self.eos_token,
                "unk_token": self.unk_token, "mask_token": self.mask_token, "mask_char": self.mask_char}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StructureAwareTokenizer:
        settings = dict(d)
        residues = settings.pop("residues", RESIDUES)  # what a plain sequence holds (bench reads it)
        if residues != RESIDUES:
            raise ValueError(f"residues is {residues!r}; SaProt's are {RESIDUES}")
        return cls(settings.pop("vocab"), **settings)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> StructureAwareTokenizer:
        return read_tokenizer_file(path, cls.from_dict)
