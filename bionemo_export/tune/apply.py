"""Writing the winner into the repository, and taking it back, atomically.

The repository is rebuilt beside itself (build_staging.staged_directory: the same staging a build
uses): every file linked (or copied) into the staging folder, the tuned models' config.pbtxt and
manifest.json written there, and the folder renamed over the repository in one step. A reader or a
server starting meanwhile sees the old repository or the new one, never a mix; an error or a
signal leaves the old one as it was. The configs it replaces are kept in the manifest's `tuning`
record, byte for byte, so that `restore` can put them back the same way.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from bionemo_export.build_staging import staged_directory
from bionemo_export.errors import UserError
from bionemo_export.model_repository.integrity import update_records
from bionemo_export.model_repository.manifest import MANIFEST_NAME, Manifest


class RestoreError(UserError, ValueError):
    """The repository has no earlier settings to restore."""


def _link_tree(source: Path, target: Path, skip: set[str]) -> None:
    """Every file of `source` under `target` (hard links where possible), `skip` (relative POSIX
    paths) and compiled Python aside."""
    for directory, _, names in os.walk(source):
        here = Path(directory)
        folder = target / here.relative_to(source)
        folder.mkdir(parents=True, exist_ok=True)
        for name in names:
            relative = (here / name).relative_to(source).as_posix()
            if relative in skip or name.endswith(".pyc"):
                continue
            try:
                os.link(here / name, folder / name)
            except OSError:
                shutil.copy2(here / name, folder / name)


def publish(repository: Path, configs: Mapping[str, str], tuning: dict[str, Any] | None,
            log: Callable[[str], None] = lambda message: None) -> Manifest:
    """Replace `repository` by itself with `configs` ({model: config.pbtxt text}) and the manifest's
    `tuning` record set to `tuning` (None: removed), in one rename. Returns the manifest written."""
    manifest = Manifest.read(repository)
    written = [f"{model}/config.pbtxt" for model in configs]
    with staged_directory(repository, force=True, log=log) as stage:
        _link_tree(repository, stage.repository, {*written, MANIFEST_NAME})
        for model, text in configs.items():
            (stage.repository / model / "config.pbtxt").write_text(text)
        files = update_records(manifest.files, stage.repository, written)
        manifest = replace(manifest, tuning=tuning, files=files).write(stage.repository)
    return manifest


def previous_configs(repository: Path, models: list[str]) -> dict[str, str]:
    """The config.pbtxt texts of `models` as the repository holds them now."""
    return {model: (repository / model / "config.pbtxt").read_text() for model in models}


def restore(repository: Path, log: Callable[[str], None] = lambda message: None) -> list[str]:
    """Put back the configs the last `tune` replaced; the models restored."""
    manifest = Manifest.read(repository)
    tuning = manifest.tuning or {}
    previous = tuning.get("previous") or {}
    if not previous:
        raise RestoreError(f"{repository / MANIFEST_NAME} records no tuning to undo: the repository has its "
                           "built settings")
    # The record of a tuning before this one (whose settings `previous` holds), if there was one.
    publish(repository, previous, tuning.get("earlier") or None, log)
    return sorted(previous)
