"""MegaMolBART's regex SMILES tokenizer, with numpy outputs.

This file is copied verbatim into generated Triton Python-backend model folders, next to
character.py, and imported there as a top-level module: it imports only the standard library,
numpy and its sibling (never torch or bionemo_export).

A SMILES string is split by MegaMolBART's regular expression (bracket atoms, two-letter halogens,
ring closures, ...) and each token is looked up in the vocabulary, whose ids are its line order.
The encoder input has no begin/end tokens; decoding starts from `^` and stops at `&`. A token
missing from the vocabulary is an error naming it, never silently the unknown token `?`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

try:  # inside the bionemo_export package
    from .character import Encoded, TokenizationError, _utf8
except ImportError:  # copied beside character.py into a Triton model folder
    from character import Encoded, TokenizationError, _utf8

SPECIAL_TOKENS = ("<PAD>", "?", "^", "&", "<MASK>", "<SEP>")
"""MegaMolBART's special tokens, at ids 0..5: pad, unknown, begin, end, mask, separator."""

SMILES_PATTERN = re.compile(
    r"\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|/|:|~|@|\?|>|\*|\$"
    r"|%[0-9]{2}|[0-9]"
    # The catch-all (DOTALL: newlines too) makes every character part of some token, so that
    # anything the pattern does not know is reported as a token missing from the vocabulary.
    r"|.",
    re.DOTALL,
)
"""MegaMolBART's tokenization regex (applied with findall), plus a final catch-all character."""


def tokenize(smiles: str) -> list[str]:
    """The tokens of one SMILES string, in order (every character belongs to one token)."""
    return SMILES_PATTERN.findall(smiles)


def build_vocab(smiles: Iterable[str]) -> list[str]:
    """A vocabulary for a set of SMILES: the special tokens first, then every token seen, sorted."""
    seen = {token for text in smiles for token in tokenize(text)}
    return [*SPECIAL_TOKENS, *sorted(seen - set(SPECIAL_TOKENS))]


class SmilesTokenizer:
    """SMILES -> token ids with MegaMolBART's regex and vocabulary.

    `vocab` must start with SPECIAL_TOKENS at their ids. `max_length` counts tokens (the encoder
    input has no begin/end tokens, so it is the longest SMILES accepted, in tokens).
    """

    pad_token = "<PAD>"
    bos_token = None  # the encoder input has no begin token ...
    eos_token = None  # ... and no end token: those frame the decoder's output only
    begin_token = "^"
    end_token = "&"

    def __init__(self, vocab: Sequence[str], *, max_length: int) -> None:
        self.vocab = tuple(vocab)
        self.max_length = int(max_length)
        self._ids = {token: i for i, token in enumerate(self.vocab)}
        if len(self._ids) != len(self.vocab):
            raise ValueError("the vocabulary has duplicate tokens")
        if self.vocab[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
            raise ValueError(
                f"the vocabulary must start with the special tokens {list(SPECIAL_TOKENS)}, "
                f"found {list(self.vocab[: len(SPECIAL_TOKENS)])}"
            )
        if self.max_length < 1:
            raise ValueError(f"max_length {max_length} leaves no room for tokens")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return self._ids[self.pad_token]

    @property
    def unknown_id(self) -> int:
        return self._ids["?"]

    @property
    def begin_id(self) -> int:
        return self._ids[self.begin_token]

    @property
    def end_id(self) -> int:
        return self._ids[self.end_token]

    def to_dict(self) -> dict[str, Any]:
        return {"type": "smiles", "vocab": list(self.vocab), "max_length": self.max_length}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SmilesTokenizer:
        if d.get("type") != "smiles":
            raise ValueError(f"not a SMILES tokenizer: type is {d.get('type')!r}, expected 'smiles'")
        return cls(d["vocab"], max_length=d["max_length"])

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> SmilesTokenizer:
        return cls.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch, padded with <PAD> to the longest. Sequences over `max_length` tokens
        are an error unless `truncate` (which keeps the first `max_length` tokens)."""
        rows = [self._ids_of(index, sequence) for index, sequence in enumerate(sequences)]
        if not rows:
            raise TokenizationError("no sequences to encode")
        too_long = [index for index, row in enumerate(rows) if len(row) > self.max_length]
        if too_long and not truncate:
            index = too_long[0]
            raise TokenizationError(
                f"sequence {index} has {len(rows[index])} tokens; the maximum is {self.max_length}"
            )
        lengths = np.array([min(len(row), self.max_length) for row in rows], dtype=np.int64)
        input_ids = np.full((len(rows), int(lengths.max())), self.pad_id, dtype=np.int64)
        for index, row in enumerate(rows):
            input_ids[index, : lengths[index]] = row[: lengths[index]]
        # MegaMolBART's mask is the padding mask: every real token is part of the molecule.
        residue_mask = np.arange(input_ids.shape[1]) < lengths[:, None]
        return Encoded(input_ids, residue_mask.astype(np.int64), residue_mask)

    def _ids_of(self, index: int, sequence: str | bytes) -> list[int]:
        """The token ids of sequence `index`; TokenizationError names the first unknown token."""
        # _utf8 checks the type, UTF-8 and emptiness; a lone surrogate in a str comes back as
        # its own character and so as a token missing from the vocabulary.
        text = _utf8(index, sequence).decode("utf-8", "surrogatepass")
        ids = []
        for match in SMILES_PATTERN.finditer(text):
            token_id = self._ids.get(match.group())
            if token_id is None:
                raise TokenizationError(
                    f"sequence {index}: token {match.group()!r} at character {match.start()} "
                    "is not in the vocabulary"
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The SMILES spelled by `ids`: up to the first end token, begin and pad tokens skipped."""
        tokens = []
        for token_id in ids:
            token_id = int(token_id)
            if token_id == self.end_id:
                break
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"id {token_id} is not in the vocabulary ({self.vocab_size} tokens)")
            if token_id not in (self.begin_id, self.pad_id):
                tokens.append(self.vocab[token_id])
        return "".join(tokens)

    def decode_batch(self, ids: Sequence[Sequence[int]] | np.ndarray) -> list[str]:
        """`decode` for each row of a [batch, length] array of ids."""
        return [self.decode(row) for row in ids]
