"""What a checkpoint reader returns: one `Checkpoint`, whatever the form on disk.

A reader knows a file layout (a Hugging Face directory, a BioNeMo `.nemo` archive, the project's
saved form) and nothing about architectures: it hands over the configuration, the raw state dict
under the checkpoint's own key names, and the small side files (vocabularies, tokenizer models).
Families turn that into their module (models/base.py: `ModelFamily.describe`).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from bionemo_export.errors import UserError

if TYPE_CHECKING:
    import torch

MAX_SIDE_FILE_BYTES = 64 << 20
"""Side files (vocabularies, tokenizer models, configs) larger than this are not read into memory."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read; the message names the file (and key) and the problem."""


class KeyMismatchError(CheckpointError):
    """Weights that do not fit the module their configuration describes (a strict load failed), with
    the keys for callers that list them (`inspect`): named as the module names them."""

    def __init__(self, message: str, missing: list[str], unexpected: list[str], wrong_shapes: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.unexpected = unexpected
        self.wrong_shapes = wrong_shapes


@dataclass
class Checkpoint:
    """A checkpoint read into memory, in its own naming."""

    path: Path
    """The file or directory the user named."""
    form: str
    """The reader's name: "huggingface", "nemo", "saved"."""
    config: dict[str, Any]
    """config.json, or a .nemo's model_config.yaml (nested sections kept as they are)."""
    weights: Mapping[str, torch.Tensor]
    """The state dict, keys as stored."""
    weights_name: str
    """Where the weights came from, for messages ("model.safetensors", "model_weights.ckpt")."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Side files by name (vocab.txt, spiece.model, tokenizer.json, a .nemo's tokenizer artifacts)."""
    model_class: str | None = None
    """What the checkpoint says it is: config.json's model_type, or a .nemo's `target` class."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Stored entries the reader left out of `weights`, with why (TransformerEngine `_extra_state`,
    optimizer state, duplicates of other tensors): `inspect` reports them."""
    parallel: dict[str, int] = field(default_factory=dict)
    """How the stored weights were split before the reader merged them ({"tensor": 2,
    "pipeline": 1}); empty for single-rank checkpoints."""

    @property
    def weights_path(self) -> str:
        """The weights' location for error messages: 'dir/model.safetensors', 'x.nemo:model_weights.ckpt'."""
        return f"{self.path}:{self.weights_name}" if self.path.is_file() else str(self.path / self.weights_name)

    def file(self, name: str, what: str = "file") -> bytes:
        """The side file `name`; CheckpointError naming the checkpoint when it is missing."""
        try:
            return self.files[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no {what} {name!r} in the checkpoint") from None

    def lines(self, name: str, what: str = "file") -> list[str] | None:
        """The side text file `name` as lines (vocab.txt: one token per line, the id being the
        line number), as the reader read it; None when the checkpoint has no such file."""
        return self.text(name, what).splitlines() if name in self.files else None

    def text(self, name: str, what: str = "file") -> str:
        data = self.file(name, what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: {what} {name!r} is not UTF-8 text") from None


class CheckpointPath:
    """A path a checkpoint may be at, as `read_checkpoint` hands it to each reader in turn (does it
    look like your form?) and then to the one that reads it: what several readers look at, a
    directory's config.json, is read and parsed once, here."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._config_json: dict[str, Any] | str | None = None  # the parsed object, or why there is none

    def config_json(self) -> dict[str, Any]:
        """The directory's config.json as a dict (parsed on first use); CheckpointError naming the
        file when it is missing, not JSON or not an object."""
        if self._config_json is None:
            try:
                self._config_json = _parse_config_json(self.path)
            except CheckpointError as err:
                self._config_json = str(err)
        if isinstance(self._config_json, str):
            raise CheckpointError(self._config_json)
        return self._config_json


def _parse_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {directory} has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return config


class CheckpointReader:
    """One checkpoint form. Subclasses set `form` and implement `recognizes` and `read`."""

    form: ClassVar[str]
    description: ClassVar[str]

    def recognizes(self, found: CheckpointPath) -> bool:
        """Whether `found.path` looks like this form (cheap: no weights are read)."""
        raise NotImplementedError

    def read(self, found: CheckpointPath) -> Checkpoint:
        """The checkpoint at `found.path`; CheckpointError naming the file and the problem."""
        raise NotImplementedError

    def describe(self, checkpoint: Checkpoint) -> str:
        """One line on what `checkpoint` (which this reader read) is, as manifest.json's
        `checkpoint_form` and `inspect` record it."""
        raise NotImplementedError


READERS: dict[str, CheckpointReader] = {}


def register_reader(cls: type[CheckpointReader]) -> type[CheckpointReader]:
    """Class decorator: make a reader available under `cls.form`."""
    if cls.form in READERS:
        raise ValueError(f"checkpoint form {cls.form!r} is registered twice")
    READERS[cls.form] = cls()
    return cls


def describe_checkpoint(checkpoint: Checkpoint) -> str:
    """What the reader of `checkpoint`'s form says it is (`CheckpointReader.describe`)."""
    return READERS[checkpoint.form].describe(checkpoint)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read `path` with the first reader that recognizes it; the error lists the known forms."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    found = CheckpointPath(path)
    for reader in READERS.values():
        if reader.recognizes(found):
            return reader.read(found)
    forms = "; ".join(f"{r.form}: {r.description}" for r in READERS.values())
    what = "is not a directory nor a .nemo archive" if path.is_file() else "is not a checkpoint"
    raise CheckpointError(f"{path} {what}; this tool reads {forms}")


_TORCH_ADVICE = ("weights only load failed", "weights_only", "please file an issue", "check the documentation")
"""Lines of torch.load's weights_only messages that are advice, not the reason (the advice includes
"re-run with weights_only=False", which is exactly what must not be done with a refused file)."""
_PICKLED_NAME = (
    re.compile(r"\bGLOBAL\s+([^\s`]+)"),  # the opcode: "Unsupported global: GLOBAL x", "unsupported GLOBAL x"
    re.compile(r"\bunsupported global:?\s+([^\s`]+)", re.IGNORECASE),
    re.compile(r"\bunrecognized function\s+(<[^>\n]*>|[^\s`]+)", re.IGNORECASE),
    re.compile(r"\bbut got\s+(<[^>\n]*>|[^\s`]+)", re.IGNORECASE),
)
"""Where torch's weights_only unpickler names the global, function or class it would not load."""
_MOST_SHOWN = 200
"""Characters of a loader's reason or a pickled name shown (a hostile pickle's names can be megabytes)."""


def _shown(text: str) -> str:
    return text if len(text) <= _MOST_SHOWN else text[:_MOST_SHOWN] + "..."


def _loader_reason(err: BaseException) -> str:
    """The loader's own reason in one line: torch.load's messages are paragraphs about weights_only
    with the cause in the middle; the advice lines are dropped."""
    message = str(err).split("WeightsUnpickler error:", 1)[-1]
    lines = (line.strip() for line in message.splitlines())
    reason = next((line for line in lines if line and not any(a in line.lower() for a in _TORCH_ADVICE)), "")
    return _shown(reason) or "no reason given"


def unreadable_weights(source: str, err: BaseException) -> CheckpointError:
    """The error for weights their loader rejects (random bytes, a truncated download): it names
    the file, says it is not a readable checkpoint, and keeps the loader's reason to one line."""
    return CheckpointError(f"cannot read weights {source}: not a readable checkpoint (corrupt, truncated or not "
                           f"a weights file; {type(err).__name__}: {_loader_reason(err)})")


def refused_weights(source: str, err: BaseException) -> CheckpointError:
    """The error for weights that `torch.load(weights_only=True)` refused to unpickle (any
    UnpicklingError): the file holds a pickled global, a call or an opcode that only a full
    unpickler would run, so the checkpoint is refused, naming what it holds when torch says so.
    One line, whatever torch's wording; torch's advice to load it with weights_only=False is left out."""
    found = next((m for pattern in _PICKLED_NAME if (m := pattern.search(str(err)))), None)
    if found:
        return CheckpointError(f"cannot read weights {source}: it holds pickled code or objects other than tensors "
                               f"({_shown(found.group(1).rstrip('.,;:'))}), which will not be run; refusing it")
    return CheckpointError(f"cannot read weights {source}: it holds pickled code or objects that will not be run, "
                           f"or is corrupt ({_loader_reason(err)}); refusing it")


def weights_error(source: str, err: BaseException) -> CheckpointError:
    """The error for a torch state dict (`torch.load(weights_only=True)`) or safetensors file that
    failed to load: refused pickles (`refused_weights`) apart from unreadable files. Torch files are
    opened by torch_files.py, the one way the readers open them."""
    if isinstance(err, pickle.UnpicklingError):
        return refused_weights(source, err)
    return unreadable_weights(source, err)


EXTRA_STATE = "_extra_state"
"""The leaf name of TransformerEngine's serialized FP8 metadata (bytes, not weights): skipped, as
BioNeMo's own loaders skip it."""


def check_state_dict(weights: Any, source: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(`weights` checked to be a flat {name: tensor} dict, the entries skipped): some files wrap
    the dict in {"state_dict": ...}; TransformerEngine `_extra_state` entries (bytes, a buffer or
    None) are skipped."""
    import torch

    if isinstance(weights, dict) and isinstance(weights.get("state_dict"), dict):
        weights = weights["state_dict"]
    if not isinstance(weights, dict) or not weights:
        raise CheckpointError(f"{source} holds no state dict (found {type(weights).__name__})")
    skipped = {key: "TransformerEngine metadata (_extra_state), not a weight" for key in weights
               if isinstance(key, str) and key.rsplit(".", 1)[-1] == EXTRA_STATE}
    weights = {key: value for key, value in weights.items() if key not in skipped}
    if bad := [str(k) for k, v in weights.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]:
        raise CheckpointError(f"{source}: entries that are not named tensors: {', '.join(bad[:5])}")
    if not weights:
        raise CheckpointError(f"{source} holds no weights (only {len(skipped)} _extra_state entries)")
    return weights, skipped


def some(items: list[str], limit: int = 8) -> str:
    """A readable list of the first `limit` items."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".nemo", ".distcp")
"""Files whose bytes are weights, for `fp32_weight_bytes`."""


def fp32_weight_bytes(path: Path) -> int:
    """About how many bytes the checkpoint at `path` holds as fp32 tensors, before any is read:
    safetensors files by their headers (elements x 4, whatever their stored dtype; a folder's .bin
    copies of them are not counted again), other weight files by their size (a half-precision torch
    file is under-counted by half)."""
    return sum(_weight_elements(path).values())


def widened_weight_bytes(path: Path) -> int:
    """The fp32 bytes of the checkpoint's half-precision (F16, BF16) safetensors tensors, by their
    headers: what a build widens (models/readers/mapped.widened). 0 for other weight files."""
    return sum(size for dtype, size in _weight_elements(path).items() if dtype in ("F16", "BF16"))


def _weight_elements(path: Path) -> dict[str, int]:
    """fp32 bytes (elements x 4) per stored dtype of the checkpoint at `path` ("file": the sizes of
    weight files whose headers say nothing), for `fp32_weight_bytes`."""
    from .safetensors_files import read_header

    path = Path(path)
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file() and f.suffix in WEIGHT_SUFFIXES]
    if any(f.suffix == ".safetensors" for f in files):  # Hugging Face folders often hold a .bin copy too: one is read
        files = [f for f in files if f.suffix == ".safetensors"]
    totals: dict[str, int] = {}
    for file in files:
        if file.suffix != ".safetensors":
            totals["file"] = totals.get("file", 0) + file.stat().st_size
            continue
        try:
            with file.open("rb") as handle:
                header, _ = read_header(handle, file.stat().st_size)
            counted: dict[str, int] = {}
            for name, entry in header.items():
                if name != "__metadata__":
                    count = 1
                    for size in entry["shape"]:
                        count *= int(size)
                    counted[str(entry["dtype"])] = counted.get(str(entry["dtype"]), 0) + 4 * count
        except (OSError, ValueError, KeyError, TypeError, AttributeError):  # the reader will say what is wrong
            counted = {"file": file.stat().st_size}
        for dtype, size in counted.items():
            totals[dtype] = totals.get(dtype, 0) + size
    return totals
