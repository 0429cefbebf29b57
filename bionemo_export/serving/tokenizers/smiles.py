"""Regex SMILES tokenizers (MegaMolBART's, and BERT reaction-SMILES models such as rxnfp's), with
numpy outputs.

Part of the served package, copied whole into generated Triton Python-backend model folders, next to
character.py, and imported there as a top-level module: it imports only the standard library,
numpy and its sibling (never torch or bionemo_export).

A SMILES string is split by a regular expression (bracket atoms, two-letter halogens, ring
closures, ...) and each token is looked up in the vocabulary, whose ids are its line order. The
defaults are MegaMolBART's: its regex, `<PAD>`, no begin/end tokens on the encoder input, and
decoding that starts from `^` and stops at `&`. BERT SMILES models put `[CLS]`/`[SEP]` around each
sequence (bos_token/eos_token) and pad with `[PAD]`. A token missing from the vocabulary is an error
naming it, never silently the unknown token (`?`, `[UNK]`).

A tokenizer given a mask token and a mask character (character.MASK_CHAR, `_`) reads that
character, wherever the regex makes it a token of its own, as the mask token: a masked position
for a masked language model (rxnfp's BERTs), True in residue_mask.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import numpy as np

from .character import (
    Encoded,
    TokenIds,
    TokenizationError,
    _utf8,
    assemble,
    check_mask_setting,
    read_tokenizer_file,
)

SPECIAL_TOKENS = ("<PAD>", "?", "^", "&", "<MASK>", "<SEP>")
"""MegaMolBART's special tokens, at ids 0..5: pad, unknown, begin, end, mask, separator."""

MEGAMOLBART_PATTERN = (
    r"\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|/|:|~|@|\?|>|\*|\$"
    r"|%[0-9]{2}|[0-9]"
)
"""MegaMolBART's tokenization regex (the default pattern)."""

REACTION_SMILES_PATTERN = (
    r"%\([0-9]{3}\)|\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\||\(|\)|\.|=|#|-|\+|\\|/|:|~|@"
    r"|\?|>>?|\*|\$|%[0-9]{2}|[0-9]"
)
"""The reaction-SMILES regex of rxnfp's BERT models (Schwaller et al.): MegaMolBART's plus `>>`
(the reaction arrow) as one token, `|` and three-digit ring closures `%(123)`."""

_CATCH_ALL = r"|[\s\S]"
# Appended to every pattern: it makes every character part of some token, so that anything the
# pattern does not know (a space, a newline, 'X') is reported as a token missing from the
# vocabulary instead of being skipped silently.

_RESERVED = re.compile(r"\[unused[0-9]+\]")
"""BERT's placeholder tokens (`[unused1]`...): in the vocabulary, never produced by tokenization."""

SMILES_PATTERN = re.compile(f"(?:{MEGAMOLBART_PATTERN}){_CATCH_ALL}")
"""MegaMolBART's tokenization regex (applied with findall), plus a final catch-all character."""


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """`pattern` plus the catch-all, compiled; ValueError for an invalid regular expression."""
    try:
        return re.compile(f"(?:{pattern}){_CATCH_ALL}")
    except re.error as err:
        raise ValueError(f"invalid tokenization pattern {pattern!r}: {err}") from None


def tokenize(smiles: str, pattern: str | re.Pattern[str] = SMILES_PATTERN) -> list[str]:
    """The tokens of one SMILES string, in order (every character belongs to one token).
    `pattern`: a compiled pattern used as is, or a pattern string (the catch-all is added)."""
    compiled = pattern if isinstance(pattern, re.Pattern) else compile_pattern(pattern)
    return _splitter(compiled)(smiles)


def _splitter(compiled: re.Pattern[str]):
    """A function text -> whole-match tokens (findall returns groups when the pattern has any)."""
    if compiled.groups == 0:
        return compiled.findall
    return lambda text: [match.group() for match in compiled.finditer(text)]


def build_vocab(smiles: Iterable[str]) -> list[str]:
    """A vocabulary for a set of SMILES: the special tokens first, then every token seen, sorted."""
    seen = {token for text in smiles for token in tokenize(text)}
    return [*SPECIAL_TOKENS, *sorted(seen - set(SPECIAL_TOKENS))]


class SmilesTokenizer(TokenIds):
    """SMILES -> token ids with a regex and a vocabulary (defaults: MegaMolBART's).

    - `pattern`: the tokenization regex (a catch-all is added so that unknown characters are
      reported as tokens missing from the vocabulary). REACTION_SMILES_PATTERN for rxnfp.
    - `pad_token`; `unk_token`: recorded (unknown_id), never emitted.
    - `bos_token`/`eos_token`: put before/after every sequence (None: nothing). MegaMolBART's
      encoder input has neither; BERT SMILES models use `[CLS]`/`[SEP]`.
    - `begin_token`/`end_token`: decoding starts from / stops at these (MegaMolBART's `^`/`&`;
      None where the model does not decode). With MegaMolBART's `^`/`&` the vocabulary must start
      with SPECIAL_TOKENS at their ids, as MegaMolBART's decoder assumes.
    - `max_length` counts tokens including bos/eos.
    - `mask_token`/`mask_char` (both or neither): `mask_char` in an input is the mask token.

    residue_mask is True exactly on the SMILES's own tokens (not bos/eos, not padding);
    attention_mask is 1 on bos + tokens + eos.
    """

    def __init__(
        self,
        vocab: Sequence[str],
        *,
        max_length: int,
        pattern: str = MEGAMOLBART_PATTERN,
        pad_token: str = "<PAD>",
        unk_token: str | None = "?",
        bos_token: str | None = None,
        eos_token: str | None = None,
        begin_token: str | None = "^",
        end_token: str | None = "&",
        mask_token: str | None = None,
        mask_char: str | None = None,
    ) -> None:
        self.vocab = tuple(vocab)
        self.mask_token, self.mask_char = mask_token, mask_char
        self.max_length = int(max_length)
        self.pattern = pattern
        self.pad_token, self.unk_token = pad_token, unk_token
        self.bos_token, self.eos_token = bos_token, eos_token
        self.begin_token, self.end_token = begin_token, end_token

        self._ids = {token: i for i, token in enumerate(self.vocab)}
        if len(self._ids) != len(self.vocab):
            raise ValueError("the vocabulary has duplicate tokens")
        if (begin_token, end_token) == ("^", "&") and self.vocab[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(
                f"the vocabulary must start with the special tokens {list(SPECIAL_TOKENS)}, "
                f"found {list(self.vocab[: len(SPECIAL_TOKENS)])}"
            )
        for token in (pad_token, unk_token, bos_token, eos_token, begin_token, end_token):
            if token is not None and token not in self._ids:
                raise ValueError(f"special token {token!r} is not in the vocabulary")
        if self.max_tokens < 1:
            raise ValueError(f"max_length {max_length} leaves no room for tokens")
        self._split = _splitter(compile_pattern(pattern))
        check_mask_setting(mask_token, mask_char, self._ids)
        if mask_char is not None and mask_char in self._ids:
            raise ValueError(f"mask_char {mask_char!r} is a token of the vocabulary")
        self._lookup = dict(self._ids)
        """Token -> id for encoding: the vocabulary, plus the mask character."""
        if mask_char is not None and mask_token is not None:  # both or neither: check_mask_setting
            self._lookup[mask_char] = self._ids[mask_token]

    @property
    def unknown_id(self) -> int | None:
        return self._id_of(self.unk_token)

    @property
    def begin_id(self) -> int | None:
        return self._id_of(self.begin_token)

    @property
    def end_id(self) -> int | None:
        return self._id_of(self.end_token)

    @property
    def alphabet(self) -> tuple[str, ...]:
        """The SMILES tokens a masked-LM head scores, in id order: the vocabulary without its
        special tokens (pad, unknown, bos/eos, begin/end, mask, MegaMolBART's SPECIAL_TOKENS) and
        BERT's `[unusedN]` placeholders."""
        return tuple(self.vocab[i] for i in self.alphabet_ids)

    @property
    def alphabet_ids(self) -> tuple[int, ...]:
        """The token ids of `alphabet`, in the same order."""
        specials = {self.pad_token, self.unk_token, self.bos_token, self.eos_token, self.begin_token,
                    self.end_token, self.mask_token}
        if (self.begin_token, self.end_token) == ("^", "&"):
            specials.update(SPECIAL_TOKENS)
        return tuple(i for i, token in enumerate(self.vocab)
                     if token not in specials and not _RESERVED.fullmatch(token))

    @property
    def max_tokens(self) -> int:
        """The longest SMILES accepted without truncation, in tokens (max_length minus bos/eos)."""
        return self.max_length - len(self._specials())

    def _specials(self) -> list[str]:
        return [token for token in (self.bos_token, self.eos_token) if token is not None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "smiles",
            "vocab": list(self.vocab),
            "max_length": self.max_length,
            "pattern": self.pattern,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "begin_token": self.begin_token,
            "end_token": self.end_token,
            **({"mask_token": self.mask_token, "mask_char": self.mask_char} if self.mask_token is not None else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SmilesTokenizer:
        """Rebuild from `to_dict`; keys it lacks (dicts written before they existed) keep
        MegaMolBART's defaults."""
        if d.get("type") != "smiles":
            raise ValueError(f"not a SMILES tokenizer: type is {d.get('type')!r}, expected 'smiles'")
        options = ("pattern", "pad_token", "unk_token", "bos_token", "eos_token", "begin_token", "end_token",
                   "mask_token", "mask_char")
        return cls(d["vocab"], max_length=d["max_length"], **{key: d[key] for key in options if key in d})

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> SmilesTokenizer:
        """The tokenizer saved in `path` (character.read_tokenizer_file: errors name the file)."""
        return read_tokenizer_file(path, cls.from_dict)

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch: bos + tokens + eos, padded with the pad token to the longest. SMILES
        over `max_tokens` tokens are an error unless `truncate` (which keeps the first ones)."""
        # _utf8 checks the type, UTF-8 and emptiness; a lone surrogate in a str comes back as
        # its own character and so as a token missing from the vocabulary.
        texts = [_utf8(index, sequence).decode("utf-8", "surrogatepass") for index, sequence in enumerate(sequences)]
        if not texts:
            raise TokenizationError("no sequences to encode")
        rows = list(map(self._split, texts))  # the regex runs in C, one call per sequence
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        # Vocabulary lookup of every token of the batch in one C-level pass; -1 where missing.
        ids = np.fromiter(map(self._lookup.get, chain.from_iterable(rows), repeat(-1)), dtype=np.int64,
                          count=int(lengths.sum()))
        missing = np.flatnonzero(ids < 0)
        if missing.size:  # checked before truncation: a bad token is an error wherever it is
            starts = np.cumsum(lengths) - lengths
            index = int(np.searchsorted(starts, missing[0], side="right")) - 1
            raise self._missing_token(index, rows[index], int(missing[0] - starts[index]))
        too_long = np.flatnonzero(lengths > self.max_tokens)
        if too_long.size and not truncate:
            raise self._too_long(int(too_long[0]), int(lengths[too_long[0]]))
        return assemble(ids, lengths, limit=self.max_tokens, pad_id=self.pad_id, bos_id=self.bos_id,
                        eos_id=self.eos_id)

    def _missing_token(self, index: int, tokens: list[str], position: int) -> TokenizationError:
        character = sum(map(len, tokens[:position]))
        return TokenizationError(
            f"sequence {index}: token {tokens[position]!r} at character {character} is not in the vocabulary"
        )

    def _too_long(self, index: int, length: int) -> TokenizationError:
        specials = self._specials()
        limit = f" ({self.max_length} tokens including {'/'.join(specials)})" if specials else ""
        return TokenizationError(f"sequence {index} has {length} tokens; the maximum is {self.max_tokens}{limit}")

    def decode(self, ids: Sequence[int]) -> str:
        """The SMILES spelled by `ids`: up to the first end token (eos when there is no end token);
        begin, bos and pad tokens skipped."""
        stop = self.end_id if self.end_token is not None else self.eos_id
        skipped = {self._ids[t] for t in (self.begin_token, self.bos_token, self.pad_token) if t is not None}
        tokens = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == stop:
                break
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"id {token_id} is not in the vocabulary ({self.vocab_size} tokens)")
            if token_id not in skipped:
                tokens.append(self.vocab[token_id])
        return "".join(tokens)

    def decode_batch(self, ids: Sequence[Sequence[int]] | np.ndarray) -> list[str]:
        """`decode` for each row of a [batch, length] array of ids."""
        return [self.decode(row) for row in ids]
