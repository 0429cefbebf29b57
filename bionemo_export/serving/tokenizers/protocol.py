"""The one interface every tokenizer implements (character, SentencePiece vocabulary, regex SMILES).

The package's code (export checks, verification, repository planning, the PyTorch references)
sees tokenizers only through this protocol. The implementations are numpy-only modules that are
copied verbatim into generated repositories, where the model.py of the tokenizer model imports the
concrete class by name; this file is for the package's typing and is not copied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .character import Encoded


@runtime_checkable
class Tokenizer(Protocol):
    """Strings -> padded [batch, length] token arrays, serializable to the repository's JSON."""

    vocab: tuple[str, ...]
    """Every token, the id being the index."""
    max_length: int
    """Most tokens per sequence, special tokens included."""
    pad_token: str
    bos_token: str | None
    """Put before every sequence (None: nothing)."""
    eos_token: str | None
    """Put after every sequence (None: nothing)."""
    mask_token: str | None
    """The token a masked residue encodes to (None: the tokenizer has no mask)."""
    mask_char: str | None
    """The input character that stands for mask_token (set with it, or both None)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def alphabet(self) -> tuple[str, ...]:
        """The residue characters (SMILES tokens) a masked-LM head scores, in id order."""
        ...

    @property
    def alphabet_ids(self) -> tuple[int, ...]:
        """The token ids of `alphabet`, in the same order."""
        ...

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch; TokenizationError (naming the sequence) for bad input."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the tokenizer (written as the repository's tokenizer.json)."""
        ...

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tokenizer: ...

    def save_json(self, path: str | Path) -> None: ...


@runtime_checkable
class DecodingTokenizer(Tokenizer, Protocol):
    """A tokenizer that also turns a decoder's token ids back into text (encoder-decoder families)."""

    @property
    def begin_id(self) -> int | None:
        """The token that starts every decoded sequence (None: the vocabulary has none)."""
        ...

    @property
    def end_id(self) -> int | None:
        """The token that ends a decoded sequence (None: the vocabulary has none)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The text spelled by `ids`, up to the end token."""
        ...
