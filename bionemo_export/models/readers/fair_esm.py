"""fair-esm's checkpoint files: what `esm.pretrained` downloads into ~/.cache/torch/hub/checkpoints
(`esm2_t33_650M_UR50D.pt`, `esm1b_t33_650M_UR50S.pt`, `esm1v_t33_650M_UR90S_1.pt` ... `_5.pt`).

A file is a torch.save'd dict: "model", the state dict under fairseq's names
(`encoder.sentence_encoder.layers.0.self_attn.q_proj.weight`, `encoder.lm_head.dense.weight`, ...),
and the architecture's settings: ESM-2's `cfg["model"]` (encoder_layers, encoder_embed_dim,
encoder_attention_heads, token_dropout), ESM-1b's and ESM-1v's `args` (arch "roberta_large",
layers, embed_dim, ffn_embed_dim, attention_heads, token_dropout), each an argparse.Namespace. The
contact head's weights ship apart, as `<stem>-contact-regression.pt` ({"model": {"contact_head.
regression.weight": ..., ...}}): picked up when it sits beside the model file, as fair-esm's own
loader does.

Both are opened as every torch file here (torch_files.py): torch's zip format only, loaded with
`torch.load(weights_only=True)` allowing argparse.Namespace besides tensors (torch_files.SAFE_CLASSES);
no pickled code runs, and a legacy pickle or a TorchScript archive under these names is refused. The
settings are the Namespace's plain values (numbers, strings, booleans).
"""

from __future__ import annotations

import argparse
from typing import Any

from .base import Checkpoint, CheckpointError, CheckpointPath, CheckpointReader, check_state_dict, register_reader
from .torch_files import open_torch_file

REGRESSION_SUFFIX = "-contact-regression"


def _settings(value: Any) -> dict[str, Any]:
    """The plain settings (numbers, strings, booleans) of a Namespace or a dict; {} for anything else."""
    if isinstance(value, argparse.Namespace):
        value = vars(value)
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, bool | int | float | str)}
    return {}


@register_reader
class FairEsmReader(CheckpointReader):
    form = "fair_esm"
    description = ("fair-esm's .pt files (esm2_t33_650M_UR50D.pt, esm1b_t33_650M_UR50S.pt, esm1v_*_1.pt ...; "
                   "a -contact-regression.pt beside them is read too)")

    def describe(self, checkpoint: Checkpoint) -> str:
        regression = f" + {checkpoint.config['contact_regression']}" if checkpoint.config.get("contact_regression") \
            else ""
        return f"fair-esm {checkpoint.model_class} file {checkpoint.path.name}{regression}"

    def recognizes(self, found: CheckpointPath) -> bool:
        path = found.path
        # Any .pt file, zip or not: a legacy pickle or a TorchScript archive is refused as such.
        return path.is_file() and path.suffix == ".pt"

    def read(self, found: CheckpointPath) -> Checkpoint:
        path = found.path
        if path.stem.endswith(REGRESSION_SUFFIX):
            raise CheckpointError(f"{path} is a contact regression file: give the model file beside it "
                                  f"({path.name.removesuffix(REGRESSION_SUFFIX + '.pt')}.pt)")
        data = open_torch_file(path, str(path))
        if not isinstance(data, dict) or "model" not in data or not ({"cfg", "args"} & data.keys()):
            held = ", ".join(map(str, list(data)[:8])) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{path} is not a fair-esm checkpoint: expected a dict with 'model' and 'cfg' "
                                  f"(ESM-2) or 'args' (ESM-1b/1v), found {held}")
        weights, skipped = check_state_dict(data["model"], f"{path}:model")
        if "cfg" in data:
            cfg = data["cfg"]
            settings = _settings(cfg.get("model") if isinstance(cfg, dict) else getattr(cfg, "model", None))
            architecture = "esm2"
        else:
            settings = _settings(data["args"])
            architecture = str(settings.get("arch", "unknown"))
        found_regression = None
        regression = path.with_name(path.stem + REGRESSION_SUFFIX + ".pt")
        if regression.is_file():
            extra = open_torch_file(regression, str(regression))
            if not isinstance(extra, dict) or "model" not in extra:
                raise CheckpointError(f"{regression} is not a contact regression file (no 'model')")
            head, _ = check_state_dict(extra["model"], f"{regression}:model")
            if unexpected := [key for key in head if not key.startswith("contact_head.")]:
                raise CheckpointError(f"{regression}: {', '.join(unexpected[:4])} are not the contact head's")
            weights.update(head)
            found_regression = regression.name
        model_class = {"esm2": "ESM-2", "roberta_large": "ESM-1v" if path.name.startswith("esm1v") else "ESM-1b"
                       }.get(architecture, architecture)
        config = {**settings, "architecture": architecture, "contact_regression": found_regression}
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name="model",
                          model_class=model_class, skipped=skipped)
