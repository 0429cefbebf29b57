"""NVIDIA's Hugging Face ESM-2 format (`nv_esm`, bionemo-recipes `models/esm2`): a Hugging Face
directory whose config.json says `"model_type": "nv_esm"`, with TransformerEngine layer names in
its weights (models/transformer_engine_esm.py documents the layout), tokenizer files and the
modeling code its `auto_map` names (esm_nv.py).

Only config.json, the weights and the tokenizer files are read; the modeling code is never
imported, run or even read. TransformerEngine `_extra_state` entries (older exports) are skipped
and recorded in `Checkpoint.skipped`.
"""

from __future__ import annotations

from .base import MAX_SIDE_FILE_BYTES, Checkpoint, CheckpointError, CheckpointPath, CheckpointReader, register_reader
from .huggingface import NV_ESM_TYPES, read_weights

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
"""The side files read (what NVIDIA's exports carry besides config, weights, code and README)."""


@register_reader
class NvEsmReader(CheckpointReader):
    form = "nv_esm"
    description = ("NVIDIA's TransformerEngine ESM-2 directory (config.json with model_type nv_esm, "
                   "model.safetensors; bionemo-recipes)")

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"NVIDIA TransformerEngine ESM-2 directory (nv_esm, {checkpoint.weights_name})"

    def recognizes(self, found: CheckpointPath) -> bool:
        try:
            return found.path.is_dir() and found.config_json().get("model_type") in NV_ESM_TYPES
        except CheckpointError:
            return False  # the Hugging Face reader reports directories without a readable config.json

    def read(self, found: CheckpointPath) -> Checkpoint:
        path, config = found.path, found.config_json()
        weights, weights_name, skipped = read_weights(path)
        files = {name: (path / name).read_bytes() for name in TOKENIZER_FILES
                 if (path / name).is_file() and (path / name).stat().st_size <= MAX_SIDE_FILE_BYTES}
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=weights_name,
                          files=files, model_class=config["model_type"], skipped=skipped)
