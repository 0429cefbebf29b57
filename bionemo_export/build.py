"""Build a model repository from a checkpoint: load -> export -> verify -> plan -> write, atomically.

The repository is assembled in a hidden staging folder beside the destination and renamed into
place only when everything succeeded, so a failed build leaves nothing behind and an existing
repository is replaced (with `force`) in one rename.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from bionemo_export import __version__
from bionemo_export.model_repository.encoder import plan_encoder_repository
from bionemo_export.model_repository.options import ServingOptions
from bionemo_export.model_repository.manifest import checkpoint_digest, package_versions, write_manifest
from bionemo_export.model_repository.seq2seq import plan_seq2seq_repository
from bionemo_export.models import LoadedModel, get_family, load_checkpoint
from bionemo_export.models.base import seq2seq_graph_specs
from bionemo_export.exporters.optimize import PrecisionError
from bionemo_export.generation.reference import decoder_check_batches

Progress = Callable[[str], None]
LOG = logging.getLogger(__name__)
PRECISIONS = ("fp32", "int8", "fp16")


class BuildError(RuntimeError):
    """The build cannot go on; the message says why and what to do."""


@dataclass(frozen=True)
class BuildRequest:
    family: str | None
    """Model family; None: the one a .nemo archive's `target` names."""
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
    max_decode_length: int | None = None
    """Decoding families: most tokens a decode produces (default: the model's limit)."""
    precision: str = "fp32"
    """The encoder graph's precision: fp32; int8 (dynamic quantization, CPU); fp16 (GPU hosts)."""
    optimize: bool = True
    """Store the graphs optimized (exporters/optimize.py); False: the plain export."""


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
    if request.precision not in PRECISIONS:
        raise BuildError(f"--precision {request.precision!r}: choose one of {', '.join(PRECISIONS)}")


def _check_tasks(family, tasks: tuple[str, ...] | None) -> tuple[str, ...]:
    """The tasks to serve: those asked for, which the family must serve, or all it serves."""
    tasks = tasks or family.tasks
    unsupported = [t for t in tasks if t not in family.tasks]
    if unsupported:
        raise BuildError(f"family {family.name!r} serves {', '.join(family.tasks)}; not {', '.join(unsupported)}")
    return tasks


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


@dataclass(frozen=True)
class ExportedGraph:
    """One graph exported and checked; `files` are what goes into its model's version folder."""

    name: str
    files: dict[str, Path]
    record: dict
    verification: dict


def _export_graph(name: str, module, inputs, outputs, batches: list[dict], export_dir: Path, exporter: str,
                  family, progress: Progress, mask_input: str = "attention_mask", *, precision: str = "fp32",
                  optimize: bool = True, num_heads: int | None = None,
                  hidden_size: int | None = None) -> ExportedGraph:
    """Export `module` to ONNX under export_dir/name, check it against PyTorch on `batches`, then
    store it optimized (and in `precision`) when that graph verifies too; raises
    ExportVerificationError when the plain export is over the family's tolerance."""
    from bionemo_export.exporters import export_onnx, optimize_and_verify, verify_onnx

    progress(f"exporting the {name} graph to ONNX ({exporter})")
    folder = export_dir / name
    folder.mkdir()
    exported = export_onnx(module, inputs, outputs, batches[0], folder / "model.onnx", exporter=exporter)
    progress(f"checking the {name} graph against PyTorch")
    output_names = [t.name for t in outputs]
    report = verify_onnx(module, exported.path, batches, atol=family.atol, min_cosine=family.min_cosine,
                         output_names=output_names, mask_input=mask_input)
    report.raise_for_tolerance()
    if optimize or precision != "fp32":
        progress(f"optimizing the {name} graph ({precision}) and checking it against PyTorch")

    def log(message: str) -> None:
        LOG.warning(message)
        progress(message)

    chosen = optimize_and_verify(module, exported.path, report, export_dir / f"{name}.optimized", batches,
                                 num_heads=num_heads, hidden_size=hidden_size, atol=family.atol,
                                 min_cosine=family.min_cosine, output_names=output_names, mask_input=mask_input,
                                 precision=precision, optimize=optimize, log=log)
    record = exported.to_dict()
    # The export happened in a temporary folder: record the names the files have in the repository.
    record["path"] = exported.path.name
    record["data_path"] = exported.data_path.name if exported.data_path else None
    record["optimization"] = chosen.record
    verification = {**chosen.report.to_dict(), "onnx_path": exported.path.name,
                    "precision": chosen.record["precision"], "optimized": chosen.path != exported.path}
    if chosen.path != exported.path:
        verification["unoptimized"] = {"outputs": [check.to_dict() for check in report.outputs]}
    files = {p.name: p for p in chosen.path.parent.iterdir() if p.is_file()}
    return ExportedGraph(name, files, record, verification)


def _export_all(loaded: LoadedModel, tasks: tuple[str, ...], export_dir: Path, request: BuildRequest,
                progress: Progress) -> dict[str, ExportedGraph]:
    family, exporter = loaded.family, request.exporter
    batches = [_encode_batch(loaded, batch) for batch in _sample_batches(loaded)]
    sizes = dict(optimize=request.optimize, num_heads=loaded.description.get("heads"), hidden_size=loaded.hidden_size)
    # Reduced precision applies to the encoder; decoder graphs stay fp32 (greedy decodes are exact).
    graphs = {"encoder": _export_graph("encoder", loaded.encoder, loaded.inputs, loaded.outputs, batches,
                                       export_dir, exporter, family, progress, precision=request.precision,
                                       **sizes)}
    if loaded.seq2seq is not None and {"decodes", "samplings"} & set(tasks):
        specs = seq2seq_graph_specs(loaded.seq2seq, loaded.hidden_size)
        cross_batches, step_batches = decoder_check_batches(loaded, batches)
        for name, module, graph_batches in (("cross_kv", loaded.seq2seq.cross_kv, cross_batches),
                                            ("decoder_step", loaded.seq2seq.decoder_step, step_batches)):
            inputs, outputs = specs[name]
            # Key/value outputs are [layers, batch, ...]: compare them whole, not per position.
            # Decoder graphs are stored as exported: the fused attention of decoder_step passed the
            # export check but failed when served at batch > 1 (its attention_bias broadcast over the
            # batch instead of the heads), so they are not optimized until that is fixed and tested.
            graphs[name] = _export_graph(name, module, inputs, outputs, graph_batches, export_dir, exporter,
                                         family, progress, mask_input="", **{**sizes, "optimize": False})
    return graphs


def build_repository(request: BuildRequest, progress: Progress = lambda message: None) -> BuildResult:
    """Build the repository described by `request`; raises BuildError (or the exporter's
    verification error) and leaves nothing on disk when anything fails."""
    _check_request(request)
    if request.family is not None:
        _check_tasks(get_family(request.family), request.tasks)
    backend = resolve_backend(request.backend, request.tritonserver)
    serving = dataclasses.replace(request.serving, backend=backend)

    progress(f"loading {request.family or 'the'} checkpoint {request.checkpoint}")
    try:
        loaded = load_checkpoint(request.checkpoint, request.family, max_length=request.max_length)
    except (ValueError, OSError) as err:
        raise BuildError(f"cannot load {request.checkpoint}{f' as {request.family}' if request.family else ''}: "
                         f"{err}") from err
    family = loaded.family
    tasks = _check_tasks(family, request.tasks)

    request.out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{request.out.name}.building-", dir=request.out.parent))
    try:
        with tempfile.TemporaryDirectory(prefix="bionemo-export-onnx-") as export_dir:
            try:
                graphs = _export_all(loaded, tasks, Path(export_dir), request, progress)
            except PrecisionError as err:
                raise BuildError(str(err)) from err
            progress(f"writing the repository ({backend} backend)")
            plan = _plan(request, loaded, tasks, serving, graphs)
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
            "precision": request.precision,
            "backend": backend,
            "exporter": request.exporter,
            "export": {name: graph.record for name, graph in graphs.items()},
            "serving": dataclasses.asdict(serving),
            "max_length": loaded.tokenizer.max_length,
            "max_decode_length": request.max_decode_length or (loaded.seq2seq.max_decode_length
                                                               if loaded.seq2seq else None),
            "verification": {"passed": True, "graphs": {name: graph.verification for name, graph in graphs.items()}},
            "accuracy": _accuracy(request.precision, graphs["encoder"]),
            "versions": package_versions(),
        }
        write_manifest(staging, manifest)
        _move_into_place(staging, request.out, request.force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    progress(f"built {request.out}")
    return BuildResult(request.out, manifest, [m.name for m in plan.models])


def _accuracy(precision: str, encoder: ExportedGraph) -> dict:
    """The stored encoder graph against the PyTorch fp32 model: what `precision` costs."""
    return {
        "precision": precision,
        "reference": "PyTorch fp32",
        "graph": "encoder",
        "batch_shapes": encoder.verification["batch_shapes"],
        "outputs": {check["name"]: {"max_abs_error": check["max_abs_error"], "min_cosine": check["min_cosine"],
                                    "tolerance": check.get("tolerance") or {"atol": encoder.verification["atol"],
                                                                            "min_cosine": encoder.verification["min_cosine"]}}
                    for check in encoder.verification["outputs"]},
    }


def _plan(request: BuildRequest, loaded: LoadedModel, tasks: tuple[str, ...], serving: ServingOptions,
          graphs: dict[str, ExportedGraph]):
    common = dict(family=loaded.family.name, hidden_size=loaded.hidden_size, tokenizer=loaded.tokenizer,
                  tasks=tasks, options=serving)
    if loaded.seq2seq is None:
        return plan_encoder_repository(request.name, onnx_files=graphs["encoder"].files, **common)
    return plan_seq2seq_repository(
        request.name, seq2seq=loaded.seq2seq, graph_specs=seq2seq_graph_specs(loaded.seq2seq, loaded.hidden_size),
        onnx_files={name: graph.files for name, graph in graphs.items()},
        max_decode_length=request.max_decode_length, **common)


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
