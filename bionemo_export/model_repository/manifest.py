"""`manifest.json`: what a repository was built from and how, at the repository root.

`verify`, `bench` and people read it to learn the family, the public models and the figures the
export was checked against, without guessing from folder names. `Manifest` is the one place that
reads and writes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from bionemo_export.errors import UserError

MANIFEST_NAME = "manifest.json"
# Packages whose versions decide what a repository contains or how it runs.
RECORDED_PACKAGES = ("torch", "transformers", "onnx", "onnxruntime", "triton-model-navigator",
                     "tritonclient", "nvidia-pytriton", "tensorrt", "numpy")


def checkpoint_digest(path: Path) -> str:
    """sha256 over a checkpoint file, or over every file of a checkpoint folder (relative names
    and contents, in sorted order), so that renaming or editing any file changes it."""
    digest = hashlib.sha256()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for file in files:
        if path.is_dir():
            digest.update(str(file.relative_to(path)).encode() + b"\0")
        with open(file, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def source_sha256(checkpoint_digests: Sequence[str], precision: str) -> str:
    """What a repository serves, as one hex digest: the sha256 of its checkpoints' digests
    (`checkpoint_digest`; an ensemble's members in order) and the precision its weights are stored
    in. Every model a build writes carries it as the SOURCE_SHA256 config parameter
    (parameters.py), which is how a client that sees configs only tells apart repositories built
    from different checkpoints. Derived from digests already computed, so that a checkpoint is
    read once per build; the same checkpoints and precision always give the same value."""
    canonical = json.dumps({"checkpoints": list(checkpoint_digests), "precision": precision},
                           sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def host_record() -> dict[str, Any]:
    """This host, as manifest.json's `build_host` records it and `doctor` shows it."""
    from bionemo_export.serving.host import cpu_description

    return {"cpu": cpu_description(), "platform": platform.platform(), "machine": platform.machine()}


class ManifestError(UserError, ValueError):
    """manifest.json cannot be read as a bionemo-export manifest; the message names the file."""


REQUIRED = ("family", "name", "tasks")
"""What every reader needs (and what a hand-written manifest must hold at least)."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """manifest.json as one typed record: `build` writes it, every reader reads it through `read`.

    Fields are the file's top-level keys, in the file's order (keyword-only, so that the required
    ones can follow `created`). Keys that older builds did not write have defaults (device "cpu":
    GPU serving came later), so repositories built before still read.
    """

    created: str | None = None
    """When it was first written (UTC, ISO 8601); `write` stamps it once and keeps it after."""
    tool: dict[str, Any] = field(default_factory=dict)
    """{"name": "bionemo-export", "version": ...}: which tool (and version) built the repository."""
    name: str
    """The --name: models are `<name>_<task>`."""
    family: str
    tasks: list[str]
    public_models: list[str] = field(default_factory=list)
    models: dict[str, Any] = field(default_factory=dict)
    """Every model folder -> its description."""
    checkpoint: dict[str, Any] = field(default_factory=dict)
    """path, digest and the family's facts about the checkpoint (an ensemble's: its first member's)."""
    members: list[dict[str, Any]] | None = None
    """A checkpoint ensemble's members in order, each recorded as `checkpoint` is, with its label
    (`m1`, ...: its models are N_m1_encoder, N_m1_lm_head), and in an int8 or fp16 build its own
    `accuracy` (the top-level `accuracy` is member 1's); None: one checkpoint."""
    precision: str = "fp32"
    precision_choice: dict[str, Any] | None = None
    """How `build --precision auto` chose `precision` (build_precision.PrecisionChoice): the
    precisions tried, why each refused one was, the rule, the build host's CPU; None: asked by name."""
    backend: str | None = None
    device: str = "cpu"
    exporter: str = "torch"
    export: dict[str, Any] = field(default_factory=dict)
    serving: dict[str, Any] = field(default_factory=dict)
    max_length: int | None = None
    max_decode_length: int | None = None
    verification: dict[str, Any] = field(default_factory=dict)
    accuracy: dict[str, Any] = field(default_factory=dict)
    """What the stored precision costs against fp32 PyTorch (int8/fp16 builds)."""
    versions: dict[str, str | None] = field(default_factory=dict)
    build_host: dict[str, Any] | None = None
    """The host that built and verified it (`host_record`): its CPU (model, the instruction-set
    features that decide ONNX Runtime's kernels, VNNI or not), OS and machine; None: built before
    this was recorded. The served models check their golden answers on their own host (serving/golden.py)."""
    engines: dict[str, Any] | None = None
    """TensorRT engines built on a GPU host (runtime/engines.py); None: none built."""
    tuning: dict[str, Any] | None = None
    """What `bionemo-export tune` measured and wrote (tune/record.py): the host, the objective, the
    settings and figures before and after, the previous config.pbtxt files; None: never tuned."""
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Every file the build wrote, manifest.json aside: relative POSIX path -> {"sha256": hex digest,
    "bytes": size}; serve and verify check them (integrity.py). Empty: none recorded (a repository
    built before digests were, or written by hand), and then no `files` key in the file."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys this version does not know (a newer build's), kept so that rewriting loses nothing."""

    @property
    def built_by_bionemo_export(self) -> bool:
        """The file names bionemo-export as its tool (hand-written manifests do not)."""
        return self.tool.get("name") == "bionemo-export"

    @property
    def source_sha256(self) -> str | None:
        """The SOURCE_SHA256 parameter the repository's models carry when built from what this
        manifest records (`source_sha256` of its checkpoint digests and precision); None when it
        records no digest for its checkpoint or one of its members (a hand-written manifest)."""
        records = self.members if self.members else [self.checkpoint]
        digests = [record.get("digest") if isinstance(record, dict) else None for record in records]
        known = [digest for digest in digests if isinstance(digest, str) and digest]
        return source_sha256(known, self.precision) if known and len(known) == len(digests) else None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of manifest.json (`created` first; no `engines` key when none were built,
        no `tuning` key when never tuned, no `files` key when no digests were recorded)."""
        known = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        optional = ("created", "members", "precision_choice", "build_host", "engines", "tuning")
        return {**{key: value for key, value in known.items()
                   if not (value is None and key in optional) and not (key == "files" and not value)},
                **self.extra}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: Path | str = MANIFEST_NAME) -> Manifest:
        """The manifest a JSON object holds; ManifestError naming `source` when it is not one."""
        if not isinstance(data, dict):
            raise ManifestError(f"{source} is not a JSON object")
        if missing := [key for key in REQUIRED if key not in data]:
            raise ManifestError(f"{source} has no {', '.join(missing)}: not written by `bionemo-export build repo`")
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})

    @classmethod
    def read(cls, root: Path) -> Manifest:
        """The manifest.json of repository `root`: FileNotFoundError when it has none, ManifestError
        naming the file when it is not valid JSON or not a bionemo-export manifest."""
        path = root / MANIFEST_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{root} has no {MANIFEST_NAME}: was it built by `bionemo-export build repo`?")
        try:
            data = json.loads(path.read_text())
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise ManifestError(f"{path} is not valid JSON ({err})") from None
        return cls.from_dict(data, path)

    def write(self, root: Path) -> Manifest:
        """Write `root`/manifest.json; the manifest as written (`created` stamped if it was not)."""
        stamped = self if self.created else replace(
            self, created=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        (root / MANIFEST_NAME).write_text(json.dumps(stamped.to_dict(), indent=2) + "\n")
        return stamped
