"""The project's own saved form (MegaMolBART): config.json with "model_type": "megamolbart" and
its sizes, model.safetensors, and vocab.txt (one token per line, the id being the line number)."""

from __future__ import annotations

from .base import Checkpoint, CheckpointError, CheckpointPath, CheckpointReader, register_reader
from .huggingface import SAVED_FORM_TYPES, read_weights


@register_reader
class SavedFormReader(CheckpointReader):
    form = "saved"
    description = "the project's saved form (config.json with model_type megamolbart, model.safetensors, vocab.txt)"

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"{checkpoint.model_class} directory ({checkpoint.weights_name})"

    def recognizes(self, found: CheckpointPath) -> bool:
        try:
            return found.path.is_dir() and found.config_json().get("model_type") in SAVED_FORM_TYPES
        except CheckpointError:
            return False

    def read(self, found: CheckpointPath) -> Checkpoint:
        path, config = found.path, found.config_json()
        vocab = path / "vocab.txt"
        if not vocab.is_file():
            raise CheckpointError(f"checkpoint {path} has no vocab.txt")
        weights, weights_name, skipped = read_weights(path)
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=weights_name,
                          files={"vocab.txt": vocab.read_bytes()}, model_class=config["model_type"], skipped=skipped)
