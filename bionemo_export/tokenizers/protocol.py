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

from bionemo_export.tokenizers.character import Encoded


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

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def encode(self, sequences: Sequence[str | bytes], *, truncate: bool = False) -> Encoded:
        """Tokenize a batch; TokenizationError (naming the sequence) for bad input."""

    def to_dict(self) -> dict[str, Any]:
        """Everything needed to rebuild the tokenizer (written as the repository's tokenizer.json)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tokenizer: ...

    def save_json(self, path: str | Path) -> None: ...
