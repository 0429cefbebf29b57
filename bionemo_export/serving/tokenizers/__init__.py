"""Numpy-only tokenizers, importable without torch and copied verbatim into generated repositories."""

from .character import CharacterTokenizer, Encoded, TokenizationError
from .smiles import SmilesTokenizer

__all__ = ["CharacterTokenizer", "Encoded", "SmilesTokenizer", "TokenizationError"]
