"""`tune --precision`: build the repository again from the checkpoint its manifest names, in another
precision (`auto`: the build's choice for this host, build_precision.py), before its serving
settings are searched.

The precision is the graph itself, so a precision chosen on one host (int8 pays 2-4x fp32 where
8-bit dot products accumulate in 32 bits: VNNI, AMX) is only a guess on another. `tune` measures
the host it runs on; with `--precision auto` it lets the build measure the precisions here too.

What the rebuild keeps from manifest.json: the family, the checkpoint (and an ensemble's members),
the name, the tasks, the exporter, the backend and device, the serving options and the lengths.
It refuses when a checkpoint's bytes changed since the build (its digest): a rebuild would serve
another model under the same name. Options a manifest does not record take their defaults
(`--block-size`, `--min-cosine`, `--no-optimize`); per-role serving options, which only library
callers set, are refused. The build is atomic: the repository is replaced whole or left as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bionemo_export.choices import Exporter, build_precision
from bionemo_export.errors import UserError
from bionemo_export.model_repository.manifest import Manifest, checkpoint_digest
from bionemo_export.model_repository.options import GenerationLimits, ServingOptions

if TYPE_CHECKING:
    from bionemo_export.build import BuildRequest


class RebuildError(UserError, RuntimeError):
    """The repository cannot be built again from what its manifest records; the message says why."""


def serving_options(recorded: dict[str, Any], source: Path) -> ServingOptions:
    """The ServingOptions manifest.json's `serving` recorded (dataclasses.asdict of the build's)."""
    if recorded.get("roles"):
        raise RebuildError(f"{source}: built with per-role serving options ({', '.join(recorded['roles'])}), which "
                           "a rebuild cannot restore; build it again with `build_repository` and those options")
    known = {f.name for f in fields(ServingOptions)} - {"roles", "limits"}
    flat = {name: value for name, value in recorded.items() if name in known}
    limits = GenerationLimits(**recorded.get("limits") or {})
    return ServingOptions(**flat, limits=limits)


def rebuild_request(repository: Path, precision: str) -> BuildRequest:
    """The BuildRequest that builds `repository` again in `precision`, from its manifest.json; every
    checkpoint is read, and one whose digest differs from the build's refused."""
    from bionemo_export.build import BuildRequest  # torch: only when a rebuild is asked for

    manifest = Manifest.read(repository)
    source = repository / "manifest.json"
    records = manifest.members or [manifest.checkpoint]
    paths = []
    for record in records:
        path = Path(str(record.get("path", "")))
        if not record.get("path") or not path.exists():
            raise RebuildError(f"{source}: its checkpoint {record.get('path')!r} is not on this host; build the "
                               "repository again with `build repo --checkpoint ...`")
        if record.get("digest") and checkpoint_digest(path) != record["digest"]:
            raise RebuildError(f"{path}: changed since {repository} was built from it (its digest differs from "
                               f"{source}'s); build the repository again with `build repo` if that is intended")
        paths.append(path)
    return BuildRequest(family=manifest.family, checkpoint=paths[0], members=tuple(paths[1:]), name=manifest.name,
                        out=repository, tasks=tuple(manifest.tasks),
                        exporter=Exporter.parse(manifest.exporter, f"{source}: exporter"),
                        backend=manifest.backend or "auto", serving=serving_options(manifest.serving, source),
                        max_length=manifest.max_length, max_decode_length=manifest.max_decode_length,
                        precision=build_precision(precision), force=True)


def rebuild(repository: Path, precision: str, progress: Callable[[str], None] = lambda message: None) -> Manifest:
    """Build `repository` again in `precision` (`rebuild_request`); its new manifest."""
    from bionemo_export.build import build_repository

    return build_repository(rebuild_request(repository, precision), progress=progress).manifest
