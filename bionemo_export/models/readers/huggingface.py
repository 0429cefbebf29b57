"""The Hugging Face directory form: config.json, weights (safetensors or torch, maybe sharded) and
tokenizer files (vocab.txt, spiece.model, tokenizer.json, ...)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .base import (
    MAX_SIDE_FILE_BYTES,
    Checkpoint,
    CheckpointError,
    CheckpointPath,
    CheckpointReader,
    check_state_dict,
    register_reader,
    weights_error,
)
from .safetensors_files import load_safetensors
from .torch_files import load_torch_weights

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SAVED_FORM_TYPES = ("megamolbart",)
"""model_type values of the project's own saved form (readers/saved.py), not Hugging Face models."""
NV_ESM_TYPES = ("nv_esm",)
"""model_type values of NVIDIA's TransformerEngine ESM-2 (readers/nv_esm.py): TransformerEngine
names, not those of a transformers class."""


def read_weights(directory: Path) -> tuple[dict[str, Any], str, dict[str, str]]:
    """(state dict, weights file name, entries skipped) of `directory`: one file, or shards listed
    by an index."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            weights, skipped = read_weight_file(directory / name)
            return weights, name, skipped
        index = directory / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
                raise CheckpointError(f"{index} is not a weight index ({err})") from None
            weights: dict[str, Any] = {}
            skipped: dict[str, str] = {}
            for shard in shards:
                shard_weights, shard_skipped = read_weight_file(directory / shard)
                weights.update(shard_weights)
                skipped.update(shard_skipped)
            return weights, index.name, skipped
    raise CheckpointError(
        f"checkpoint {directory} has no weights: expected {' or '.join(WEIGHT_FILES)} "
        "(or a sharded *.index.json)"
    )


def read_weight_file(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """(state dict, entries skipped) of a safetensors or torch file; torch files are opened by
    torch_files.py (zip format only, weights_only=True), so no pickled code ever runs."""
    if path.suffix != ".safetensors":
        return load_torch_weights(path, str(path))
    try:
        weights = load_safetensors(path)
    except (OSError, ValueError) as err:
        raise weights_error(str(path), err) from None
    return check_state_dict(weights, str(path))


@register_reader
class HuggingFaceReader(CheckpointReader):
    form = "huggingface"
    description = "a Hugging Face directory (config.json + model.safetensors or pytorch_model.bin)"

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"huggingface directory ({checkpoint.weights_name})"

    def recognizes(self, found: CheckpointPath) -> bool:
        # Any directory but the saved form's: the most common form, so its errors ("no
        # config.json", "no weights") are the helpful ones for a directory that is neither.
        if not found.path.is_dir():
            return False
        try:
            return found.config_json().get("model_type") not in SAVED_FORM_TYPES + NV_ESM_TYPES
        except CheckpointError:
            return True  # ours to report

    def read(self, found: CheckpointPath) -> Checkpoint:
        path, config = found.path, found.config_json()
        weights, weights_name, skipped = read_weights(path)
        files = {
            item.name: item.read_bytes()
            for item in sorted(path.iterdir())
            if item.is_file() and item.stat().st_size <= MAX_SIDE_FILE_BYTES
            and not item.name.startswith(WEIGHT_FILES)
        }
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=weights_name,
                          files=files, model_class=config.get("model_type"), skipped=skipped)
