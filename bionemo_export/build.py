"""Build a model repository from a checkpoint: load -> export -> verify -> plan -> write, atomically.

The repository is assembled in a hidden staging folder beside the destination and renamed into
place only when everything succeeded, so a failed build leaves nothing behind and an existing
repository is replaced (with `force`) in one rename.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bionemo_export import __version__
from bionemo_export.model_repository.encoder import ServingOptions, plan_encoder_repository
from bionemo_export.model_repository.manifest import checkpoint_digest, package_versions, write_manifest
from bionemo_export.models import LoadedModel, get_family

Progress = Callable[[str], None]


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class BuildRequest:
    family: str
    checkpoint: Path
    name: str
    out: Path
    tasks: tuple[str, ...] | None = None
    """Public tasks to serve; None: every task the family supports."""
    exporter: str = "torch"
    backend: str = "auto"
    max_length: int | None = None
    force: bool = False
    serving: ServingOptions = field(default_factory=ServingOptions)
    tritonserver: str | None = None
    """Server whose backends decide `--backend auto`."""


@dataclass(frozen=True)
class BuildResult:
    repository: Path
    manifest: dict
    models: list[str]


def resolve_backend(backend: str, tritonserver: str | None = None) -> str:
    """`auto` -> `native` when the target tritonserver has the onnxruntime backend, else `python`."""
    if backend != "auto":
        return backend
    from bionemo_export.runtime import TritonNotFoundError, find_tritonserver

    try:
        install = find_tritonserver(tritonserver)
    except TritonNotFoundError:
        return "python"
    return "native" if install.can_load("onnxruntime") else "python"


def _check_request(request: BuildRequest) -> None:
    if not request.name.replace("_", "").replace("-", "").isalnum():
        raise BuildError(f"--name {request.name!r}: use letters, digits, '_' or '-' (it prefixes model names)")
    if request.out.exists() and not request.force:
        raise BuildError(f"{request.out} already exists; pass --force to replace it")
    if not request.checkpoint.exists():
        raise BuildError(f"checkpoint not found: {request.checkpoint}")


def _sample_batches(loaded: LoadedModel) -> list[list[str]]:
    """Batches for the export check: all samples together (mixed lengths, padding), the shortest
    alone and the longest alone (different sequence lengths)."""
    samples = loaded.family.sample_sequences()
    by_length = sorted(samples, key=len)
    return [samples, [by_length[0]], [by_length[-1]]]


def _encode_batch(loaded: LoadedModel, sequences: list[str]) -> dict:
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def build_repository(request: BuildRequest, progress: Progress = lambda message: None) -> BuildResult:
    """Build the repository described by `request`; raises BuildError (or the exporter's
    verification error) and leaves nothing on disk when anything fails."""
    from bionemo_export.exporters import export_onnx, verify_onnx

    _check_request(request)
    family = get_family(request.family)
    tasks = request.tasks or family.tasks
    unsupported = [t for t in tasks if t not in family.tasks]
    if unsupported:
        raise BuildError(f"family {family.name!r} serves {', '.join(family.tasks)}; not {', '.join(unsupported)}")
    backend = resolve_backend(request.backend, request.tritonserver)
    serving = dataclasses.replace(request.serving, backend=backend)

    progress(f"loading {family.name} checkpoint {request.checkpoint}")
    try:
        loaded = family.load(request.checkpoint, max_length=request.max_length)
    except (ValueError, OSError) as err:
        raise BuildError(f"cannot load {request.checkpoint} as {family.name}: {err}") from err

    request.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.building-", dir=request.out.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="bionemo-export-onnx-") as export_dir:
            progress(f"exporting the encoder to ONNX ({request.exporter})")
            batches = [_encode_batch(loaded, batch) for batch in _sample_batches(loaded)]
            exported = export_onnx(
                loaded.encoder, loaded.inputs, loaded.outputs, batches[0],
                Path(export_dir) / "model.onnx", exporter=request.exporter,
            )
            progress("checking the ONNX graph against PyTorch")
            report = verify_onnx(loaded.encoder, exported.path, batches, atol=family.atol,
                                 min_cosine=family.min_cosine,
                                 output_names=[t.name for t in loaded.outputs])
            report.raise_for_tolerance()

            progress(f"writing the repository ({backend} backend)")
            tokenizer = loaded.tokenizer
            plan = plan_encoder_repository(
                request.name,
                family=family.name,
                hidden_size=loaded.hidden_size,
                tokenizer=tokenizer,
                onnx_files={p.name: p for p in Path(export_dir).iterdir() if p.is_file()},
                tasks=tasks,
                options=serving,
            )
            plan.write(staging)
        manifest = {
            "tool": {"name": "bionemo-export", "version": __version__},
            "name": request.name,
            "family": family.name,
            "tasks": list(tasks),
            "public_models": [f"{request.name}_{task}" for task in tasks],
            "models": {m.name: m.description for m in plan.models},
            "checkpoint": {"path": str(request.checkpoint.resolve()), "digest": checkpoint_digest(request.checkpoint),
                           **loaded.description},
            "precision": "fp32",
            "backend": backend,
            "export": _relative_paths(exported.to_dict(), exported, f"{request.name}_encoder/1"),
            "serving": dataclasses.asdict(serving),
            "max_length": tokenizer.max_length,
            "verification": {**report.to_dict(), "onnx_path": f"{request.name}_encoder/1/{exported.path.name}"},
            "versions": package_versions(),
        }
        write_manifest(staging, manifest)
        _move_into_place(staging, request.out, request.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"built {request.out}")
    return BuildResult(request.out, manifest, [m.name for m in plan.models])


def _relative_paths(export: dict, exported, folder: str) -> dict:
    """The export record with the graph's paths as they are inside the repository (the export
    itself happened in a temporary folder that no longer exists)."""
    export["path"] = f"{folder}/{exported.path.name}"
    if exported.data_path is not None:
        export["data_path"] = f"{folder}/{exported.data_path.name}"
    return export


def _move_into_place(staging: Path, out: Path, force: bool) -> None:
    if not out.exists():
        staging.rename(out)
        return
    if not force:
        raise BuildError(f"{out} appeared during the build; pass --force to replace it")
    # Swap with two renames so `out` is never a half-written folder.
    retired = out.with_name(f".{out.name}.replaced-{staging.name.rsplit('-', 1)[-1]}")
    out.rename(retired)
    staging.rename(out)
    shutil.rmtree(retired, ignore_errors=True)
