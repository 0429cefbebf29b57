"""A character-level tokenizer for protein sequences, vectorized with numpy.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library and numpy (never torch, transformers or bionemo_export).

Every input character is one token: BOS + residues + EOS, padded to the longest sequence in the
batch. Bad input is an error naming the sequence and the problem; nothing is lowercased, stripped
or replaced by an unknown token.

The mask character: a tokenizer whose vocabulary has a mask token (`<mask>`, `[MASK]`, `<MASK>`)
may be given one (MASK_CHAR, `_`, AntiBERTy's fill_masks convention), which input sequences may
carry at any position to hide that residue from a masked language model: it becomes the mask
token's id, and its position stays True in residue_mask (a residue whose identity is hidden).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

_INVALID = -1

MASK_CHAR = "_"
"""The character that marks a masked residue in input sequences (AntiBERTy's fill_masks convention;
in no protein or SMILES alphabet here)."""
MASK_TOKENS = ("<mask>", "[MASK]", "<MASK>")
"""Names a vocabulary's mask token goes by (ESM, BERT, MegaMolBART)."""


def find_mask_token(vocab: Sequence[str]) -> str | None:
    """The vocabulary's mask token (the first of MASK_TOKENS it holds), or None."""
    return next((token for token in MASK_TOKENS if token in vocab), None)


def check_mask_setting(mask_token: str | None, mask_char: str | None, ids: Mapping[str, int]) -> None:
    """Both or neither of mask_token/mask_char; the token in the vocabulary; the character one
    ASCII character (ValueError saying which setting is wrong)."""
    if (mask_token is None) != (mask_char is None):
        raise ValueError("mask_token and mask_char go together: set both or neither")
    if mask_token is None:
        return
    if mask_token not in ids:
        raise ValueError(f"mask token {mask_token!r} is not in the vocabulary")
    if not isinstance(mask_char, str) or len(mask_char) != 1 or len(mask_char.encode("utf-8")) != 1:
        raise ValueError(f"mask_char {mask_char!r} is not one ASCII character")


class TokenizationError(ValueError):
    """An input sequence the tokenizer cannot encode; the message names the sequence and why."""


T = TypeVar("T")


def read_tokenizer_file(path: str | Path, from_dict: Callable[[Mapping[str, Any]], T]) -> T:
    """What `from_dict` makes of the JSON object saved in file `path` (a model folder's
    tokenizer.json). Any problem with the content (not UTF-8, not JSON, not an object, a setting
    missing, unknown or invalid) is a ValueError naming the file: a served model that fails to
    load then says in the server log which file is broken, where a bare JSONDecodeError would not.
    A missing or unreadable file raises the OSError, which names it already."""
    try:
        settings = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        problem = str(err)
    else:
        if not isinstance(settings, dict):
            problem = f"a JSON {type(settings).__name__}, not an object"
        else:
            try:
                return from_dict(settings)
            except KeyError as err:
                problem = f"no {err} setting"
            except (ValueError, TypeError) as err:  # a setting of the wrong type or value, an unknown one
                problem = str(err)
    raise ValueError(f"{path} is not a valid tokenizer file ({problem}): rebuild the model repository it "
                     "belongs to, or restore the file the build wrote")


@dataclass(frozen=True)
class Encoded:
    """A tokenized batch: all arrays are [batch, length], padded to the longest sequence."""

    input_ids: np.ndarray  # int64, pad id on padding
    attention_mask: np.ndarray  # int64, 1 on BOS + residues + EOS, 0 on padding
    residue_mask: np.ndarray  # bool, True exactly on residues


class TokenIds:
    """The ids a tokenizer's special tokens have in its vocabulary: what every tokenizer here
    answers alike. A subclass sets `vocab`, `_ids` (token -> id) and the tokens (None: it has no
    such token)."""

    vocab: tuple[str, ...]
    _ids: dict[str, int]
    pad_token: str
    bos_token: str | None
    eos_token: str | None
    mask_token: str | None

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return self._ids[self.pad_token]

    @property
    def bos_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def mask_id(self) -> int | None:
        """The mask token's id (what the mask character encodes to), or None without one."""
        return self._id_of(self.mask_token)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._ids[token]


class CharacterTokenizer(TokenIds):
    """Maps each allowed character to one vocabulary id, adding optional BOS/EOS tokens.

    `residues` are the allowed input characters (ASCII); each is a vocabulary token or a key of
    `aliases`, which maps it to one (e.g. rare amino acids to "X"). `max_length` counts tokens
    including BOS/EOS. `mask_token` and `mask_char` (both or neither): inputs may carry
    `mask_char` (MASK_CHAR), encoded as the mask token's id (see the module docstring).
    """

    def __init__(
        self,
        vocab: Sequence[str],
        *,
        residues: str,
        pad_token: str,
        bos_token: str | None,
        eos_token: str | None,
        unk_token: str | None,
        max_length: int,
        aliases: Mapping[str, str] = {},
        mask_token: str | None = None,
        mask_char: str | None = None,
    ) -> None:
        self.vocab = tuple(vocab)
        self.residues = residues
        self.mask_token, self.mask_char = mask_token, mask_char
        self.pad_token, self.bos_token, self.eos_token = pad_token, bos_token, eos_token
        self.unk_token = unk_token  # recorded for consumers of the vocabulary; never emitted
        self.max_length = int(max_length)
        self.aliases = dict(aliases)

        self._ids = {token: i for i, token in enumerate(self.vocab)}
        if len(self._ids) != len(self.vocab):
            raise ValueError("the vocabulary has duplicate tokens")
        for token in (pad_token, bos_token, eos_token, unk_token):
            if token is not None and token not in self._ids:
                raise ValueError(f"special token {token!r} is not in the vocabulary")
        if self.max_residues < 1:
            raise ValueError(f"max_length {max_length} leaves no room for residues")
        check_mask_setting(mask_token, mask_char, self._ids)
        if mask_char is not None and mask_char in residues:
            raise ValueError(f"mask_char {mask_char!r} is one of the residues")
        self._table = self._lookup_table()

    def _lookup_table(self) -> np.ndarray:
        """Byte value -> token id (-1 where invalid); non-ASCII bytes are always invalid."""
        table = np.full(256, _INVALID, dtype=np.int64)
        if len(set(self.residues)) != len(self.residues):
            raise ValueError(f"residues {self.residues!r} repeat a character")
        for char in self.residues:
            if len(char.encode("utf-8")) != 1:
                raise ValueError(f"residue {char!r} is not an ASCII character")
            token = self.aliases.get(char, char)
            if token not in self._ids:
                raise ValueError(f"residue {char!r} maps to {token!r}, which is not in the vocabulary")
            table[ord(char)] = self._ids[token]
        unused = set(self.aliases) - set(self.residues)
        if unused:
            raise ValueError(f"aliases {sorted(unused)} are not among the residues")
        if self.mask_char is not None and self.mask_token is not None:  # both or neither: check_mask_setting
            table[ord(self.mask_char)] = self._ids[self.mask_token]
        return table

    @property
    def alphabet(self) -> tuple[str, ...]:
        """The residue characters a masked-LM head scores, in token-id order: one per distinct
        token the residues map to, aliases (U Z O B -> X) left out."""
        return tuple(char for char, _ in self._alphabet())

    @property
    def alphabet_ids(self) -> tuple[int, ...]:
        """The token ids of `alphabet`, in the same order."""
        return tuple(token_id for _, token_id in self._alphabet())

    def _alphabet(self) -> list[tuple[str, int]]:
        aliased = self._aliased_residues()
        pairs = {int(self._table[ord(char)]): char for char in reversed(self.residues) if char not in aliased}
        return [(char, token_id) for token_id, char in sorted(pairs.items())]

    def _aliased_residues(self) -> set[str]:
        """Residues that stand for another residue's token (not part of the alphabet)."""
        return {char for char, token in self.aliases.items() if token != char}

    @property
    def max_residues(self) -> int:
        """The longest sequence accepted without truncation (max_length minus BOS/EOS)."""
        return self.max_length - len(self._specials())

    def _specials(self) -> list[str]:
        return [token for token in (self.bos_token, self.eos_token) if token is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "vocab": list(self.vocab),
            "residues": self.residues,
            "pad_token": self.pad_token,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "max_length": self.max_length,
            "aliases": self.aliases,
            **self._mask_settings(),
        }

    def _mask_settings(self) -> dict[str, str]:
        """tokenizer.json's mask_token/mask_char, present only when the tokenizer has them (files
        written before they existed load without)."""
        if self.mask_token is None or self.mask_char is None:  # both or neither: check_mask_setting
            return {}
        return {"mask_token": self.mask_token, "mask_char": self.mask_char}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CharacterTokenizer:
        settings = dict(d)
        return cls(settings.pop("vocab"), **settings)

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> CharacterTokenizer:
        """The tokenizer saved in `path` (see `read_tokenizer_file`: errors name the file)."""
        return read_tokenizer_file(path, cls.from_dict)

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch. Sequences over `max_residues` are an error unless `truncate`."""
        raw = [_utf8(i, seq) for i, seq in enumerate(sequences)]
        if not raw:
            raise TokenizationError("no sequences to encode")
        lengths = np.fromiter(map(len, raw), dtype=np.int64, count=len(raw))
        # Residues are ASCII, so bytes are characters wherever the lookup succeeds.
        ids = self._table[np.frombuffer(b"".join(raw), dtype=np.uint8)]
        invalid = np.flatnonzero(ids == _INVALID)
        if invalid.size:
            starts = np.cumsum(lengths) - lengths
            index = int(np.searchsorted(starts, invalid[0], side="right")) - 1
            raise self._invalid_character(index, raw[index])
        too_long = np.flatnonzero(lengths > self.max_residues)
        if too_long.size and not truncate:
            raise self._too_long(int(too_long[0]), int(lengths[too_long[0]]))
        return assemble(ids, lengths, limit=self.max_residues, pad_id=self.pad_id, bos_id=self.bos_id,
                        eos_id=self.eos_id)


    def _invalid_character(self, index: int, raw: bytes) -> TokenizationError:
        # Only on the error path: find the first bad character by decoding (non-ASCII included).
        text = raw.decode("utf-8", "surrogatepass")
        position, char = next((p, c) for p, c in enumerate(text) if c not in self.residues and c != self.mask_char)
        masked = f" (and {self.mask_char!r} for a masked residue)" if self.mask_char is not None else ""
        return TokenizationError(
            f"sequence {index} has an invalid character {char!r} at position {position}; "
            f"allowed characters: {self.residues}{masked}"
        )

    def _too_long(self, index: int, length: int) -> TokenizationError:
        specials = self._specials()
        tokens = f"{self.max_length} tokens" + (f" including {'/'.join(specials)}" if specials else "")
        return TokenizationError(
            f"sequence {index} has {length} residues; the maximum is {self.max_residues} ({tokens})"
        )


def assemble(ids: np.ndarray, lengths: np.ndarray, *, limit: int, pad_id: int, bos_id: int | None,
             eos_id: int | None) -> Encoded:
    """Scatter flat token ids (each sequence's in turn, `lengths` of them) into a padded
    [batch, length] batch: BOS + at most `limit` tokens + EOS per row (one vectorized pass; every
    tokenizer here ends with it)."""
    first = 0 if bos_id is None else 1
    kept = np.minimum(lengths, limit)
    total = kept + first + (eos_id is not None)
    rows = np.repeat(np.arange(lengths.size), lengths)
    cols = np.arange(ids.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    keep = cols < limit

    input_ids = np.full((lengths.size, int(total.max())), pad_id, dtype=np.int64)
    input_ids[rows[keep], cols[keep] + first] = ids[keep]
    if bos_id is not None:
        input_ids[:, 0] = bos_id
    if eos_id is not None:
        input_ids[np.arange(lengths.size), kept + first] = eos_id

    positions = np.arange(input_ids.shape[1])
    attention_mask = (positions < total[:, None]).astype(np.int64)
    residue_mask = (positions >= first) & (positions < (kept + first)[:, None])
    return Encoded(input_ids, attention_mask, residue_mask)


def _utf8(index: int, sequence: str | bytes) -> bytes:
    """The sequence as UTF-8 bytes, checked to be text and non-empty."""
    if isinstance(sequence, str):
        # surrogatepass: a lone surrogate is reported as an invalid character, like any other.
        data = sequence.encode("utf-8", "surrogatepass")
    elif isinstance(sequence, (bytes, bytearray, memoryview)):
        data = bytes(sequence)
        if not data.isascii():
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                raise TokenizationError(f"sequence {index} is not valid UTF-8") from None
    else:
        raise TokenizationError(f"sequence {index} is {type(sequence).__name__}, not str or bytes")
    if not data:
        raise TokenizationError(f"sequence {index} is empty")
    return data
