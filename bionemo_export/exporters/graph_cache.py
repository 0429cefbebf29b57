"""A folder of exported ONNX graphs, keyed by everything that decides what the exporter writes.

torch.onnx's dynamo exporter traces, decomposes and translates the whole model every time: a
median 5.7 s per graph for this project's tiny test models, minutes for a large checkpoint. A
build of the same checkpoint with other serving options (another backend, instance count, batch
limits, precision, a re-run after a failed step) exports the very same graphs again. With a cache
folder, the second build copies them instead:

    bionemo-export build repo ... --graph-cache ~/.cache/bionemo-export/graphs
    export BIONEMO_EXPORT_GRAPH_CACHE=~/.cache/bionemo-export/graphs   # the same, for every build

The key is a SHA-256 over:
- the module: every submodule's name, class and plain attributes (numbers, strings, configs,
  tensors kept as attributes), every parameter and buffer's dtype, shape and bytes, and the
  contents of the source files that define their classes (outside torch, whose version counts);
- the declared input and output specs, the sample arguments the trace runs on (dtypes, shapes,
  values), the exporter, opset, external-data choice and the file's name;
- the versions of torch, onnx, onnxscript, transformers and Model Navigator, and the contents of
  bionemo_export's own source files (an upgrade of this package starts a fresh set of keys).

A hit is checked as a fresh export is (onnx.checker, the declared signature) and then, in a
build, against PyTorch at several batch sizes and lengths: a cached graph that fails the check is
removed and exported again (build.py), so a key that missed something costs time, never a wrong
repository. Entries are written whole (a staging folder renamed into place); a per-key lock makes
concurrent builds of the same graph export it once. Nothing is evicted by age or size: the folder
is the user's, and removing it (or any entry) is always safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import fcntl
import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bionemo_export.choices import Exporter
from bionemo_export.digests import file_digest

if TYPE_CHECKING:  # torch loads when a key is computed: reading the setting needs no torch
    import torch

    from bionemo_export.tensors import TensorSpec

ENVIRONMENT_VARIABLE = "BIONEMO_EXPORT_GRAPH_CACHE"
FORMAT = 1
"""Bumped when what an entry holds changes: entries of another format are never read."""
RECORD = "export.json"
DESCRIBE_DEPTH = 6
"""How deep plain attributes (configs inside configs) are described; deeper values count by type."""
VERSIONED_DISTRIBUTIONS = ("torch", "onnx", "onnxscript", "transformers", "triton-model-navigator")
PACKAGE = Path(__file__).resolve().parents[1]
WHERE_IT_WAS_READ = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})
"""Config fields that say where a checkpoint was read from, not what it computes: the same weights
read from another folder export the same graph."""


def default_graph_cache() -> Path | None:
    """The folder $BIONEMO_EXPORT_GRAPH_CACHE names, or None (no cache) when it is unset or empty."""
    value = os.environ.get(ENVIRONMENT_VARIABLE, "").strip()
    return Path(value).expanduser() if value else None


class GraphCache:
    """Exported graphs under `root`, one folder per key: the .onnx, its external weights file when
    it has one, and export.json (the ExportResult of the export that wrote it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def key(self, module: torch.nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
            arguments: Sequence[torch.Tensor], *, file_name: str, exporter: Exporter, opset: int,
            external: bool) -> str:
        """The hex SHA-256 of everything the exported file depends on (see the module's docstring)."""
        digest = hashlib.sha256()

        def add(*parts: object) -> None:
            for part in parts:
                digest.update(repr(part).encode())
                digest.update(b"\0")

        # The exporter by its value, not its repr (which names the enum's class: renaming the class
        # would orphan every entry).
        add(FORMAT, _environment_digest(), file_name, exporter.value, opset, external)
        add([repr(spec) for spec in inputs], [repr(spec) for spec in outputs])
        for argument in arguments:
            add(_describe(argument, 0))
        _add_module(module, digest)
        return digest.hexdigest()

    @contextlib.contextmanager
    def entry(self, key: str) -> Iterator[CacheEntry]:
        """The entry of `key`, held under its lock (another process exporting the same graph waits
        here, then finds it stored)."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            yield CacheEntry(self.root, key)

    def evict(self, key: str) -> None:
        """Remove the entry of `key` (a graph that failed its check against PyTorch)."""
        with self.entry(key) as entry:
            entry.remove()


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One key's folder; use it only inside GraphCache.entry (under the key's lock)."""

    root: Path
    key: str

    @property
    def folder(self) -> Path:
        return self.root / self.key[:2] / self.key

    def restore(self, out_path: Path) -> dict[str, Any] | None:
        """Copy the stored graph (and weights file) to `out_path` and return its export record, or
        None when nothing complete is stored."""
        try:
            record = json.loads((self.folder / RECORD).read_text())
        except (OSError, ValueError):
            return None
        if record.get("graph_cache_format") != FORMAT:
            return None
        try:
            for name in record["files"]:
                shutil.copyfile(self.folder / name, out_path.with_name(name))
        except (OSError, KeyError, TypeError):
            return None
        return record["export"]

    def store(self, written: Sequence[Path], export: Mapping[str, Any]) -> None:
        """Store the files an export wrote (the .onnx first) with its record: staged, then renamed
        into place, so a reader never sees half an entry."""
        self.remove()
        staging = self.root / "staging" / f"{self.key}.{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        try:
            for path in written:
                shutil.copyfile(path, staging / path.name)
            record = {"graph_cache_format": FORMAT, "files": [p.name for p in written], "export": dict(export)}
            (staging / RECORD).write_text(json.dumps(record, indent=1) + "\n")
            self.folder.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(self.folder)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


# -- the key's parts ---------------------------------------------------------------------------------
@functools.cache
def _environment_digest() -> str:
    """Versions of the exporting packages and the contents of this package's source files."""
    digest = hashlib.sha256()
    for distribution in VERSIONED_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            version = "absent"
        digest.update(f"{distribution}={version}\0".encode())
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0")
        digest.update(_file_digest(str(path)).encode())
    return digest.hexdigest()


@functools.cache
def _file_digest(path: str) -> str:
    return file_digest(Path(path))["sha256"]


@functools.cache
def _module_internals() -> frozenset[str]:
    """The attributes every torch Module has (parameters, hooks, the training flag): not the
    model's own settings. The mode is fixed by the export (eval) and the weights are added apart."""
    import torch

    return frozenset(vars(torch.nn.Module()))


def _add_module(module: torch.nn.Module, digest: Any) -> None:
    sources: set[str] = set()
    for name, submodule in module.named_modules(remove_duplicate=False):
        cls = type(submodule)
        digest.update(f"{name}:{cls.__module__}.{cls.__qualname__}\0".encode())
        sources.update(_class_sources(cls))
        for attribute, value in sorted(vars(submodule).items()):
            if attribute not in _module_internals():
                digest.update(f"{attribute}={_describe(value, 0)}\0".encode())
    tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in tensors:
        digest.update(f"{name}:{_describe(tensor, 0)}\0".encode())
    for path in sorted(sources):
        digest.update(_file_digest(path).encode())


@functools.cache
def _class_sources(cls: type) -> tuple[str, ...]:
    """The source files of the classes `cls` inherits from, outside torch and the standard
    library (torch's version is in the key; this package's files always are)."""
    files = []
    for base in cls.__mro__:
        if base.__module__.split(".")[0] in ("torch", "builtins", "typing", "abc"):
            continue
        with contextlib.suppress(TypeError, OSError):
            source = inspect.getsourcefile(base)
            if source and Path(source).is_file():
                files.append(source)
    return tuple(files)


def _tensor_digest(tensor: torch.Tensor) -> str:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    digest = hashlib.sha256()
    if flat.numel():
        digest.update(flat.view(torch.uint8).numpy().data)  # no copy
    return digest.hexdigest()


def _describe(value: Any, depth: int) -> str:
    """A stable text for a value that may decide the graph; never a memory address."""
    import torch

    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, torch.Tensor):
        return f"tensor({value.dtype},{tuple(value.shape)},{_tensor_digest(value)})"
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        return f"ndarray({array.dtype},{array.shape},{hashlib.sha256(array.view(np.uint8).data).hexdigest()})"
    if isinstance(value, torch.dtype | torch.device | torch.Size):
        return repr(value)
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if depth >= DESCRIBE_DEPTH:
        return name
    if isinstance(value, list | tuple):
        return f"{name}[{','.join(_describe(item, depth + 1) for item in value)}]"
    if isinstance(value, set | frozenset):
        return f"{name}{{{','.join(sorted(_describe(item, depth + 1) for item in value))}}}"
    if isinstance(value, Mapping):
        items = sorted((_describe(k, depth + 1), _describe(v, depth + 1)) for k, v in value.items())
        return f"{name}{{{','.join(f'{k}:{v}' for k, v in items)}}}"
    if isinstance(value, torch.nn.Module):
        return name  # a registered submodule is described on its own; an unregistered one by class
    if callable(value) and hasattr(value, "__qualname__"):
        return f"callable:{getattr(value, '__module__', '')}.{value.__qualname__}"
    if hasattr(value, "__dict__"):  # a config object, a dataclass: its fields
        fields = {k: v for k, v in vars(value).items() if k not in WHERE_IT_WAS_READ}
        return f"{name}({_describe(fields, depth + 1)})"
    return name
