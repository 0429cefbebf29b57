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

No pickled code runs: the file is unpickled by `_RestrictedUnpickler`, which builds tensors with
torch's own rebuild functions and storages, ordered dicts as ordered dicts, and every other class
the pickle names (argparse.Namespace, fairseq's and omegaconf's config types, and anything a
hostile file names) as an inert `Record` of the arguments and state it was given; nothing of the
named class is imported or called. The settings are read from those records; the weights must be
tensors, or the file is refused.
"""

from __future__ import annotations

import collections
import pickle
import types
import zipfile
from pathlib import Path
from typing import Any

from .base import Checkpoint, CheckpointError, CheckpointReader, check_state_dict, register_reader

REGRESSION_SUFFIX = "-contact-regression"
MAX_SETTINGS = 4096
"""Settings read from a record at most (a real one has a few hundred)."""


class Record:
    """An object of a class the checkpoint names, built inert: the positional arguments it was
    made with and the state it was given, nothing else (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args
        self.__dict__["_state"] = {}

    def __setstate__(self, state: Any) -> None:
        self.__dict__.setdefault("_state", {})  # made by NEWOBJ: __init__ did not run
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[0], dict | type(None)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slots)
        if isinstance(state, dict):
            self.__dict__["_state"].update({key: value for key, value in state.items() if isinstance(key, str)})

    def settings(self) -> dict[str, Any]:
        """The record's state as plain settings: numbers, strings, booleans and None only."""
        state = self.__dict__.get("_state", {})
        return {key: value for key, value in list(state.items())[:MAX_SETTINGS]
                if isinstance(value, bool | int | float | str | type(None))}


def _record_class(module: str, name: str) -> type[Record]:
    return type(name[:100], (Record,), {"__module__": f"recorded.{module}"[:200]})


class _RestrictedUnpickler(pickle.Unpickler):
    """Tensors through torch's rebuild functions (torch.load supplies the storages), ordered dicts
    as themselves, any other global as a Record class."""

    def find_class(self, module: str, name: str) -> Any:
        import torch._utils

        allowed = {("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
                   ("torch._utils", "_rebuild_tensor"): torch._utils._rebuild_tensor,
                   ("torch._utils", "_rebuild_parameter"): torch._utils._rebuild_parameter,
                   ("collections", "OrderedDict"): collections.OrderedDict}
        found = allowed.get((module, name))
        return found if found is not None else _record_class(module, name)


RESTRICTED_PICKLE = types.SimpleNamespace(Unpickler=_RestrictedUnpickler, load=pickle.load, __name__="restricted")
"""What torch.load takes as `pickle_module`: its zip reader and storages, our unpickler."""


def load_restricted(path: Path) -> Any:
    """The object torch.save wrote to `path`, unpickled without running code (see the module)."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=RESTRICTED_PICKLE)
    except Exception as err:  # not a torch file, truncated, or a pickle the unpickler cannot build
        reason = " ".join(str(err).split())[:200]
        raise CheckpointError(f"cannot read {path}: {type(err).__name__}: {reason}") from None


def _settings(value: Any) -> dict[str, Any]:
    if isinstance(value, Record):
        return value.settings()
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

    def recognizes(self, path: Path) -> bool:
        return path.is_file() and path.suffix == ".pt" and zipfile.is_zipfile(path)

    def read(self, path: Path) -> Checkpoint:
        if path.stem.endswith(REGRESSION_SUFFIX):
            raise CheckpointError(f"{path} is a contact regression file: give the model file beside it "
                                  f"({path.name.removesuffix(REGRESSION_SUFFIX + '.pt')}.pt)")
        data = load_restricted(path)
        if not isinstance(data, dict) or "model" not in data or not ({"cfg", "args"} & data.keys()):
            found = ", ".join(map(str, list(data)[:8])) if isinstance(data, dict) else type(data).__name__
            raise CheckpointError(f"{path} is not a fair-esm checkpoint: expected a dict with 'model' and 'cfg' "
                                  f"(ESM-2) or 'args' (ESM-1b/1v), found {found}")
        weights, skipped = check_state_dict(data["model"], f"{path}:model")
        if "cfg" in data:
            cfg = data["cfg"]
            model = cfg.get("model") if isinstance(cfg, dict) else cfg.__dict__.get("_state", {}).get("model")
            settings = _settings(model)
            architecture = "esm2"
        else:
            settings = _settings(data["args"])
            architecture = str(settings.get("arch", "unknown"))
        found_regression = None
        regression = path.with_name(path.stem + REGRESSION_SUFFIX + ".pt")
        if regression.is_file():
            extra = load_restricted(regression)
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
