"""Numpy-only tokenizers, importable without torch and copied verbatim into generated repositories."""

from bionemo_export.tokenizers.character import CharacterTokenizer, Encoded, TokenizationError
from bionemo_export.tokenizers.smiles import SmilesTokenizer

__all__ = ["CharacterTokenizer", "Encoded", "SmilesTokenizer", "TokenizationError"]
