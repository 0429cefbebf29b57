"""The tokenizer a served model uses: `tokenizer.json` beside its model.py, read by the class that the
config's `tokenizer_class` parameter names ("module.Class", one of `TOKENIZER_CLASSES`).

The build copies the tokenizer's module (and character.py, which holds the shared Encoded and
TokenizationError types) beside model.py, so one static model.py serves every family: which
tokenizer it runs is a setting, not code rendered into it.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

TOKENIZER_CLASSES = ("character.CharacterTokenizer", "sentencepiece_vocab.SentencePieceTokenizer",
                     "structure_aware.StructureAwareTokenizer",
                     "smiles.SmilesTokenizer")
"""The tokenizer classes a repository may name (bionemo_export/serving/tokenizers/, copied as modules)."""
TOKENIZER_FILE = "tokenizer.json"


def tokenizer_type(name: str) -> Any:
    """The class `name` ("module.Class") names; ValueError for one outside TOKENIZER_CLASSES."""
    if name not in TOKENIZER_CLASSES:
        raise ValueError(f"parameter tokenizer_class is {name!r}, not one of {', '.join(TOKENIZER_CLASSES)}; "
                         "rebuild the repository")
    module, _, class_name = name.partition(".")
    return getattr(importlib.import_module(f".tokenizers.{module}", __package__), class_name)


def load_tokenizer(folder: str, parameters: Mapping[str, str]) -> Any:
    """The tokenizer of the model whose version folder is `folder` and whose config parameters are
    `parameters`."""
    return tokenizer_type(parameters.get("tokenizer_class", "")).from_json(os.path.join(folder, TOKENIZER_FILE))
