"""`manifest.json`: what a repository was built from and how, at the repository root.

`verify`, `bench` and people read it to learn the family, the public models and the figures the
export was checked against, without guessing from folder names.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

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


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = platform.python_version()
    return versions


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    stamped = {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"), **manifest}
    path = root / MANIFEST_NAME
    path.write_text(json.dumps(stamped, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{root} has no {MANIFEST_NAME}: was it built by `bionemo-export build repo`?")
    return json.loads(path.read_text())
