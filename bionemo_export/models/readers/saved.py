"""The project's own saved form (MegaMolBART): config.json with "model_type": "megamolbart" and
its sizes, model.safetensors, and vocab.txt (one token per line, the id being the line number)."""

from __future__ import annotations

from pathlib import Path

from .base import Checkpoint, CheckpointError, CheckpointReader, register_reader
from .huggingface import SAVED_FORM_TYPES, read_config_json, read_weights


@register_reader
class SavedFormReader(CheckpointReader):
    form = "saved"
    description = "the project's saved form (config.json with model_type megamolbart, model.safetensors, vocab.txt)"

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"{checkpoint.model_class} directory ({checkpoint.weights_name})"

    def recognizes(self, path: Path) -> bool:
        try:
            return path.is_dir() and read_config_json(path).get("model_type") in SAVED_FORM_TYPES
        except CheckpointError:
            return False

    def read(self, path: Path) -> Checkpoint:
        config = read_config_json(path)
        vocab = path / "vocab.txt"
        if not vocab.is_file():
            raise CheckpointError(f"checkpoint {path} has no vocab.txt")
        weights, weights_name, skipped = read_weights(path)
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=weights_name,
                          files={"vocab.txt": vocab.read_bytes()}, model_class=config["model_type"], skipped=skipped)
