"""The BioNeMo 2 / NeMo 2 checkpoint form: a directory holding `context/` and `weights/`.

- `context/model.yaml` is the model's configuration with every default filled in (NeMo's
  `IOMixin.io_dump`): the Lightning module's arguments, the model config under `config:`, callables
  and classes written as `{_target_: module.name, _call_: ...}`. It is read as plain YAML with the
  bounded loader of the `.nemo` reader; `context/io.json` (a fiddle graph that NeMo would execute)
  and any other file in `context/` are never read.
- `weights/` is a torch distributed checkpoint as Megatron-core's `torch_dist` backend writes it:
  `.metadata` (pickled torch.distributed.checkpoint dataclasses: every entry's global shape, dtype
  and chunks, and where each chunk is stored), `__<rank>_<i>.distcp` files (each chunk a
  `torch.save` record), `metadata.json` (the backend's name) and `common.pt` (trainer state).

Nothing from the checkpoint is executed or unpickled beyond data:
- `.metadata` is unpickled by `_MetadataUnpickler`, which builds only the checkpoint metadata
  dataclasses, torch sizes, dtypes and layouts and paths, and refuses any other pickled global;
  what it built is then checked field by field (shapes, chunk coverage, file names and offsets);
- every chunk's record (a torch.save'd tensor inside a `.distcp` file) is opened by
  torch_files.py, as every torch file here: zip format only, `torch.load(weights_only=True)`;
  stored objects (bytes) are never read;
- `common.pt` is not read at all: Megatron keeps every model weight in the sharded part, and the
  trainer state it holds (optimizer settings, schedulers, callbacks) is of no use here.

Optimizer state (`optimizer.*`) and stored objects (TransformerEngine `_extra_state`, which
Megatron stores as bytes) are left out and recorded in `Checkpoint.skipped`. The weights keep the
checkpoint's own names (`module.encoder.layers.<...>`, per-layer tensors stacked on a leading
axis); families map them (models/megatron_core.py).
"""

from __future__ import annotations

import collections
import dataclasses
import io
import json
import math
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .base import (
    EXTRA_STATE,
    MAX_SIDE_FILE_BYTES,
    Checkpoint,
    CheckpointError,
    CheckpointPath,
    CheckpointReader,
    register_reader,
)
from .bounded_yaml import MAX_CONFIG_BYTES, parse_yaml_mapping
from .torch_files import open_torch_file

if TYPE_CHECKING:
    import torch

CONTEXT = "context"
WEIGHTS = "weights"
MODEL_YAML = "model.yaml"
METADATA = ".metadata"
BACKEND_FILE = "metadata.json"
MAX_METADATA_BYTES = 256 << 20
"""Largest `.metadata`; a 3B-parameter model's with optimizer state is a few MB."""
OPTIMIZER_PREFIX = "optimizer."


def _is_extra_state(key: str) -> bool:
    """TransformerEngine metadata: Megatron stores it as a ShardedObject keyed
    `<module>._extra_state/shard_<offsets>_<shape>` (offsets and shape joined with dots)."""
    return key.split("/", 1)[0].rsplit(".", 1)[-1] == EXTRA_STATE


# ------------------------------------------------------------------------------------ .metadata
def _allowed_globals() -> dict[tuple[str, str], Any]:
    """What a `.metadata` pickle may name: torch.distributed.checkpoint's metadata dataclasses, torch
    sizes, dtypes, layouts and memory formats, and the path a checkpoint records as its id. Building
    any of them runs no code of the checkpoint's choosing."""
    import pathlib

    import torch
    import torch.distributed.checkpoint.filesystem as filesystem
    import torch.distributed.checkpoint.metadata as metadata

    allowed: dict[tuple[str, str], Any] = {("torch", "Size"): torch.Size}
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed["torch", name] = value
    allowed["torch.serialization", "_get_layout"] = torch.serialization._get_layout  # a name -> torch.layout lookup
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
        if hasattr(metadata, name):
            allowed[metadata.__name__, name] = getattr(metadata, name)
    allowed[filesystem.__name__, "_StorageInfo"] = filesystem._StorageInfo
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed["pathlib", name] = getattr(pathlib, name)
    allowed["collections", "OrderedDict"] = collections.OrderedDict
    return allowed


class _Refused(pickle.UnpicklingError):
    """What `_MetadataUnpickler` will not build; the message says what (a global's name)."""


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler, building checkpoint metadata only: globals are looked up in
    `_allowed_globals` (any other is refused, by name), and state is set only on instances of the
    metadata dataclasses, which the pickle itself made (a BUILD on a class, a function, a dtype or
    an enum member would change torch's own objects for the whole process)."""

    dispatch: dict[int, Callable[[Any], None]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the unpickler's stack (set by load(); typeshed does not declare it)

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.allowed = _allowed_globals()
        self.buildable = {value for value in self.allowed.values() if dataclasses.is_dataclass(value)
                          and isinstance(value, type)}

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[module, name]
        except KeyError:
            raise _Refused(f"{module}.{name}"[:200]) from None

    def load_build(self) -> None:
        target = self.stack[-2]
        if type(target) not in self.buildable:
            what = "class" if isinstance(target, type) else "function" if callable(target) else "object"
            named = getattr(target, "__qualname__", None) or type(target).__qualname__
            raise _Refused(f"state for the {what} {named:.100}")
        super().load_build()  # pyright: ignore[reportAttributeAccessIssue] - pickle's private opcode handler

    dispatch[pickle.BUILD[0]] = load_build


def _read_metadata(path: Path) -> Any:
    """The torch.distributed.checkpoint Metadata in `path`, unpickled by `_MetadataUnpickler`."""
    from torch.distributed.checkpoint.metadata import Metadata

    if path.stat().st_size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{path} is over {MAX_METADATA_BYTES >> 20} MiB, more than checkpoint metadata "
                              "ever is; refusing it")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except _Refused as err:
        raise CheckpointError(f"{path} holds a pickled {err}, which is not torch.distributed.checkpoint metadata "
                              "and will not be loaded; refusing the checkpoint") from None
    except Exception as err:  # truncated or not a pickle at all; its own words, one line
        reason = " ".join(str(err).split())[:200]
        raise CheckpointError(f"{path} is not readable torch.distributed.checkpoint metadata "
                              f"({type(err).__name__}: {reason})") from None
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(metadata, "storage_data", None), dict):
        raise CheckpointError(f"{path} is not torch.distributed.checkpoint metadata (it holds a "
                              f"{type(metadata).__name__})")
    return metadata


def _shape(value: Any) -> tuple[int, ...] | None:
    """`value` as a shape (a sequence of ints >= 0), None if it is not one."""
    if not isinstance(value, (tuple, list)) or not all(type(n) is int and n >= 0 for n in value):
        return None
    return tuple(value)


def _check_chunks(key: str, size: tuple[int, ...], chunks: Any, source: Path) -> None:
    """The chunks of `key` as (offsets, sizes) pairs, checked to tile its global `size` exactly:
    each inside it, none overlapping, together as many elements as it has (so every element of the
    loaded tensor comes from the file)."""
    boxes = []
    for chunk in chunks if isinstance(chunks, list) else [None]:
        offsets, sizes = _shape(getattr(chunk, "offsets", None)), _shape(getattr(chunk, "sizes", None))
        if offsets is None or sizes is None or len(offsets) != len(size) or len(sizes) != len(size) \
                or any(o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CheckpointError(f"{source}: {key} has a chunk that is not inside its shape {size}; "
                                  "the metadata is corrupt")
        boxes.append((offsets, sizes))
    if sum(math.prod(s) for _, s in boxes) != math.prod(size):
        raise CheckpointError(f"{source}: the chunks of {key} do not cover its shape {size} exactly; "
                              "the metadata is corrupt or the checkpoint incomplete")
    if size:  # sweep along the first axis; only chunks that meet there can overlap
        active: list[tuple[tuple[int, ...], ...]] = []
        for offsets, sizes in sorted(boxes):
            active = [b for b in active if b[0][0] + b[1][0] > offsets[0]]
            for other in active:
                if all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(offsets, sizes, *other)):
                    raise CheckpointError(f"{source}: {key} has overlapping chunks; the metadata is corrupt")
            active.append((offsets, sizes))


def _select(metadata: Any, source: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, str]]:
    """(the model's tensors: key -> (shape, dtype), entries skipped with why) of the checkpoint."""
    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    skipped: dict[str, str] = {}
    reformulated = getattr(metadata, "mcore_data", None) or {}
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CheckpointError(f"{source}: an entry is named {key!r}, not a string; the metadata is corrupt")
        if key.startswith(OPTIMIZER_PREFIX):
            skipped[key] = "optimizer state"
        elif _is_extra_state(key):  # bytes as Megatron stores it, whatever TransformerEngine made of it
            skipped[key] = "TransformerEngine metadata (_extra_state), not a weight"
        elif isinstance(entry, BytesStorageMetadata):
            skipped[key] = "a stored object (bytes), not a tensor"
        elif isinstance(entry, TensorStorageMetadata):
            size = _shape(getattr(entry, "size", None))
            dtype = getattr(getattr(entry, "properties", None), "dtype", None)
            if size is None or not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"{source}: {key} has no valid shape and dtype; the metadata is corrupt")
            original = (reformulated.get(key) or {}).get("nd_reformulated_orig_global_shape") \
                if isinstance(reformulated, dict) else None
            if original is not None and tuple(original) != size:
                raise CheckpointError(f"{source}: {key} is stored flattened (Megatron's N-D reformulation, shape "
                                      f"{tuple(original)}), which is not read; save the model without it")
            _check_chunks(key, size, getattr(entry, "chunks", None), source)
            tensors[key] = (size, dtype)
        else:
            raise CheckpointError(f"{source}: {key} is a {type(entry).__name__}, not a tensor nor bytes entry")
    if not tensors:
        raise CheckpointError(f"{source} lists no model tensors (only {len(skipped)} optimizer or object entries)")
    return tensors, skipped


def _check_storage(metadata: Any, tensors: dict[str, tuple[tuple[int, ...], Any]], weights: Path) -> None:
    """Every chunk of the tensors to load must be stored in a file of `weights/` itself, inside it,
    uncompressed; and the tensors may not declare more bytes than those files hold (so a forged
    `.metadata` cannot make the reader allocate more memory than the checkpoint's size)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    source = weights / METADATA
    stored = {(getattr(index, "fqn", None), tuple(getattr(index, "offset", None) or ()))
              for index in metadata.storage_data}
    for key in tensors:
        for chunk in metadata.state_dict_metadata[key].chunks:
            if (key, tuple(chunk.offsets)) not in stored:
                raise CheckpointError(f"{source}: the chunk of {key} at {tuple(chunk.offsets)} is stored nowhere; the "
                                      "metadata is corrupt or the checkpoint incomplete")
    files: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if getattr(index, "fqn", None) not in tensors:
            continue
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str) or name != Path(name).name \
                or name in ("", ".", "..") or type(info.offset) is not int or type(info.length) is not int:
            raise CheckpointError(f"{source}: where {index.fqn} is stored is not a file of {weights} with an offset "
                                  f"and a length ({info!r:.200}); refusing the checkpoint")
        if info.transform_descriptors:
            raise CheckpointError(f"{source}: {index.fqn} is stored with transforms "
                                  f"{info.transform_descriptors!r:.100} (compression); only plain torch_dist "
                                  "checkpoints are read")
        if name not in files:
            path = weights / name
            if not path.is_file():
                raise CheckpointError(f"{weights}: {name}, which holds {index.fqn}, is missing; the checkpoint is "
                                      "incomplete")
            files[name] = path.stat().st_size
        if info.offset < 0 or info.length < 0 or info.offset + info.length > files[name]:
            raise CheckpointError(f"{weights / name} is shorter than {source} says ({index.fqn} at bytes "
                                  f"{info.offset}+{info.length}); the checkpoint is truncated")
    declared = sum(math.prod(size) * dtype.itemsize for size, dtype in tensors.values())
    if declared > sum(files.values()):
        raise CheckpointError(f"{source} declares {declared} bytes of tensors but its files hold "
                              f"{sum(files.values())}; refusing the checkpoint")


def load_distributed(weights: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the model's tensors at their global shapes, entries skipped) of a torch distributed
    checkpoint folder: every chunk's record (a torch.save'd tensor at an offset of a `.distcp`
    file) opened by `open_torch_file` and copied into place. Stored objects (bytes) are never read."""
    import torch

    metadata = _read_metadata(weights / METADATA)
    tensors, skipped = _select(metadata, weights / METADATA)
    _check_storage(metadata, tensors, weights)
    where = {(getattr(index, "fqn", None), tuple(getattr(index, "offset", None) or ())): info
             for index, info in metadata.storage_data.items()}  # stored objects have no offsets
    state = {key: torch.empty(size, dtype=dtype) for key, (size, dtype) in tensors.items()}
    handles: dict[str, Any] = {}
    try:
        for key, target in state.items():
            for chunk in metadata.state_dict_metadata[key].chunks:
                info = where[key, tuple(chunk.offsets)]
                if info.relative_path not in handles:
                    handles[info.relative_path] = (weights / info.relative_path).open("rb")
                handle = handles[info.relative_path]
                handle.seek(info.offset)
                name = f"{weights / info.relative_path}:{key}@{tuple(chunk.offsets)}"
                record = open_torch_file(io.BytesIO(handle.read(info.length)), name)
                if not isinstance(record, torch.Tensor) or tuple(record.shape) != tuple(chunk.sizes) \
                        or record.dtype != target.dtype:
                    found = f"{record.dtype} {tuple(record.shape)}" if isinstance(record, torch.Tensor) \
                        else f"a {type(record).__name__}"
                    raise CheckpointError(f"cannot read weights {name}: it holds {found}, not the "
                                          f"{target.dtype} {tuple(chunk.sizes)} chunk {METADATA} lists; the "
                                          "checkpoint is corrupt")
                target[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))] = record
    finally:
        for handle in handles.values():
            handle.close()
    return state, skipped


def _check_backend(weights: Path) -> None:
    """metadata.json, when there, must name the torch_dist backend (Megatron also writes zarr)."""
    path = weights / BACKEND_FILE
    if not path.is_file():
        return
    try:
        with path.open("rb") as handle:
            backend = json.loads(handle.read(MAX_SIDE_FILE_BYTES)).get("sharded_backend")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{path} is not the JSON object Megatron writes ({err})") from None
    if backend not in (None, "torch_dist"):
        raise CheckpointError(f"{path}: sharded_backend is {backend!r}; only 'torch_dist' checkpoints are read "
                              "(convert it with Megatron's dist_checkpointing to torch_dist)")


# ------------------------------------------------------------------------------------ the reader
def read_model_yaml(directory: Path) -> dict[str, Any]:
    """context/model.yaml as a mapping, read with the `.nemo` reader's bounded YAML loader."""
    path = directory / CONTEXT / MODEL_YAML
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {CONTEXT}/{MODEL_YAML}: a NeMo 2 checkpoint keeps its model "
                              f"config there (written by NeMo with the weights; {CONTEXT}/io.json is never read)")
    with path.open("rb") as handle:
        data = handle.read(MAX_CONFIG_BYTES + 1)
    return parse_yaml_mapping(data, str(path))


def model_config(checkpoint: Checkpoint) -> dict[str, Any]:
    """The `config:` section of context/model.yaml (the model's settings)."""
    section = checkpoint.config.get("config")
    if not isinstance(section, dict):
        raise CheckpointError(f"{checkpoint.path / CONTEXT / MODEL_YAML} has no config: section (the model's "
                              "settings, as NeMo writes them)")
    return section


def _target(value: Any) -> str | None:
    target = value.get("_target_") if isinstance(value, dict) else None
    return target if isinstance(target, str) and target else None


@register_reader
class Nemo2Reader(CheckpointReader):
    form = "nemo2"
    description = "a BioNeMo 2 / NeMo 2 directory (context/model.yaml + weights/ as a torch_dist checkpoint)"

    def describe(self, checkpoint: Checkpoint) -> str:
        return f"NeMo 2 directory ({checkpoint.model_class or 'no config class'}, {checkpoint.weights_name})"

    def recognizes(self, found: CheckpointPath) -> bool:
        path = found.path
        # Either folder is enough, so that a directory missing the other gets this reader's error.
        return path.is_dir() and not (path / "config.json").is_file() and \
            ((path / CONTEXT).is_dir() or (path / WEIGHTS).is_dir())

    def read(self, found: CheckpointPath) -> Checkpoint:
        path = found.path
        weights_dir = path / WEIGHTS
        if not weights_dir.is_dir():
            raise CheckpointError(f"{path} has no {WEIGHTS}/ folder: a NeMo 2 checkpoint holds {CONTEXT}/ and "
                                  f"{WEIGHTS}/ (the torch_dist weights)")
        config = read_model_yaml(path)
        _check_backend(weights_dir)
        if not (weights_dir / METADATA).is_file():
            raise CheckpointError(f"{weights_dir} has no {METADATA}: not a torch distributed (torch_dist) checkpoint, "
                                  "or an incomplete copy")
        weights, skipped = load_distributed(weights_dir)
        if (weights_dir / "common.pt").is_file():
            skipped["common.pt"] = "trainer state, not read (Megatron keeps every model weight in the sharded part)"
        model_class = _target(config.get("config")) or _target(config)
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=f"{WEIGHTS}/",
                          model_class=model_class, skipped=skipped)
