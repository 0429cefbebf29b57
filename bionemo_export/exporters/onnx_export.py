"""Export a PyTorch module to one ONNX file with exactly the declared inputs and outputs.

Two exporters:

- `"torch"`: torch.onnx's torch.export-based ("dynamo") exporter. Chosen over the legacy
  TorchScript exporter (`dynamo=False`) because the tracer silently bakes shapes into graphs:
  `nn.MultiheadAttention` traced at length 12 failed in ONNX Runtime at any other length, while
  the dynamo exporter reasons about the symbolic batch and length and either produces a graph
  valid for all of them or fails loudly. It also needed ~2.5x less memory than the tracer (ESM-2
  150M: 1.1 GB vs 2.8 GB peak), which decides whether the largest checkpoints fit on the host.
  Both matched PyTorch to ~1e-6 on Hugging Face ESM-2 (rotary) and BERT; the tracer was ~3x faster.
- `"navigator"`: Triton Model Navigator (see navigator.py), when it is installed.

The written graph is checked with `onnx.checker` and against the TensorSpecs; numerical
agreement with PyTorch at several batch sizes and lengths is `verification.verify_onnx`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from bionemo_export.choices import Exporter
from bionemo_export.errors import InvalidInputError, UserError
from bionemo_export.exporters import navigator
from bionemo_export.exporters.graph_cache import GraphCache
from bionemo_export.exporters.signature import (
    check_graph_signature,
    dynamic_axes,
    sample_arguments,
)
from bionemo_export.memory_plan import EXTERNAL_DATA_THRESHOLD_BYTES
from bionemo_export.models.readers.mapped import page_out, return_freed_memory
from bionemo_export.tensors import TensorSpec

PROTOBUF_LIMIT_BYTES = 2**31
DEFAULT_OPSET = 18
"""The lowest opset the dynamo exporter implements natively (ONNX Runtime runs it since 1.14); a
lower one (17 worked for ESM-2 and BERT) goes through onnx's version converter, which may fail."""
class ExportError(UserError, RuntimeError):
    """An export that did not produce a valid graph; the message says what to try next."""


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote and how, for the build log and manifest.json."""

    path: Path
    exporter: Exporter
    torch_exporter: str
    """The torch.onnx path underneath: "dynamo" (torch.export-based)."""
    opset: int
    external_data: bool
    data_path: Path | None
    """The single external weights file next to the .onnx, when external_data."""
    onnx_bytes: int
    data_bytes: int
    parameters: int
    weight_bytes: int
    seconds: float
    versions: dict[str, str]
    warnings: tuple[str, ...] = ()
    """Distinct warnings the exporter raised (kept here instead of on the console)."""
    graph_cache_key: str | None = None
    """The graph cache's key of this export, when a cache was used (graph_cache.py)."""
    from_graph_cache: bool = False
    """Copied from the graph cache: `seconds`, `warnings` and `versions` are those of the export
    that stored it."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (paths as strings). The cache's fields only when the graph came from it:
        a build without a cache records what builds always recorded."""
        result = dataclasses.asdict(self)
        result["path"] = str(self.path)
        result["data_path"] = str(self.data_path) if self.data_path else None
        result["warnings"] = list(self.warnings)
        if not self.from_graph_cache:
            del result["graph_cache_key"], result["from_graph_cache"]
        return result


def available_exporters() -> tuple[str, ...]:
    """The exporters usable here: ("navigator", "torch") when Model Navigator imports, else
    ("torch",)."""
    return ("navigator", "torch") if navigator.navigator_available() else ("torch",)


def tensorrt_available() -> bool:
    """Whether TensorRT engines can be built here: the `tensorrt` package imports and an NVIDIA
    GPU is visible. (The PyPI `tensorrt` stubs without their downloaded libraries fail to import.)"""
    try:
        import tensorrt  # noqa: F401  # pyright: ignore[reportMissingImports]  (optional, GPU hosts only)
    except Exception:  # ImportError, or OSError/RuntimeError from a stub without its libraries
        return False
    return torch.cuda.is_available()


def export_onnx(
    module: torch.nn.Module,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    sample_inputs: Mapping[str, np.ndarray],
    out_path: Path,
    *,
    exporter: Exporter | str = Exporter.TORCH,
    opset: int = DEFAULT_OPSET,
    external_data: bool | None = None,
    workspace: Path | None = None,
    cache: GraphCache | None = None,
) -> ExportResult:
    """Export `module` (forward takes the `inputs` positionally, in order, and returns the
    `outputs` as a tuple) to `out_path`.

    `sample_inputs` is one representative batch (batch >= 2, a typical length): the graph is
    traced with it, and every str axis of the specs stays dynamic. `external_data`: None decides
    by the weights' size (see EXTERNAL_DATA_THRESHOLD_BYTES); True/False force it. `workspace`
    (navigator only) keeps Model Navigator's files and logs; by default a temporary folder that
    is removed on success and kept (and named in the error) on failure. `cache`: copy the graph
    from there when it holds this export, and store it there otherwise (graph_cache.py); the
    caller still checks the graph against PyTorch, and evicts it when that fails.
    """
    exporter = Exporter.parse(exporter, "exporter")  # a library caller's string; an Exporter as it is
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    external = _decide_external_data(external_data, _weights(module)[1])
    arguments = sample_arguments(inputs, sample_inputs)
    if cache is None:
        return _export(module, inputs, outputs, arguments, out_path, exporter, opset, external, workspace)
    key = cache.key(module, inputs, outputs, arguments, file_name=out_path.name, exporter=exporter, opset=opset,
                    external=external)
    with cache.entry(key) as entry:
        stored = entry.restore(out_path)
        if stored is not None:
            try:
                check_written(out_path, inputs, outputs)
            except ExportError:  # a damaged entry: export afresh below
                _remove_written(out_path)
            else:
                return ExportResult(**{
                    **stored, "exporter": Exporter(stored["exporter"]),
                    "path": out_path, "data_path": _data_path(out_path) if external else None,
                    "warnings": tuple(stored["warnings"]), "graph_cache_key": key, "from_graph_cache": True})
        result = _export(module, inputs, outputs, arguments, out_path, exporter, opset, external, workspace)
        entry.store([out_path, *([result.data_path] if result.data_path else [])], result.to_dict())
    return dataclasses.replace(result, graph_cache_key=key)


def _export(module: torch.nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
            arguments: tuple[torch.Tensor, ...], out_path: Path, exporter: Exporter, opset: int, external: bool,
            workspace: Path | None) -> ExportResult:
    """Export with `exporter` and check the written file."""
    parameters, weight_bytes = _weights(module)
    start = time.perf_counter()
    with eval_mode(module), collected_warnings() as caught:
        if exporter == Exporter.TORCH:
            _export_with_torch(module, inputs, outputs, arguments, out_path, opset, external)
        else:
            _export_with_navigator(
                module, inputs, outputs, arguments, out_path, opset, external, workspace
            )
    seconds = time.perf_counter() - start
    check_written(out_path, inputs, outputs)
    data_path = _data_path(out_path) if external else None
    versions = {"torch": torch.__version__, "onnx": onnx.__version__}
    if exporter == Exporter.NAVIGATOR:
        versions["model_navigator"] = navigator.navigator_version()
    return ExportResult(
        path=out_path,
        exporter=exporter,
        torch_exporter="dynamo",
        opset=opset,
        external_data=external,
        data_path=data_path,
        onnx_bytes=out_path.stat().st_size,
        data_bytes=data_path.stat().st_size if data_path else 0,
        parameters=parameters,
        weight_bytes=weight_bytes,
        seconds=round(seconds, 3),
        versions=versions,
        warnings=tuple(caught),
    )


def torch_program(module: torch.nn.Module, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                  arguments: tuple[torch.Tensor, ...], opset: int, *, fold: bool = True) -> Any:
    """torch.onnx's dynamo export of `module` (an ONNXProgram), dynamic axes from the specs, without
    the per-node debugging metadata. `fold`: the exporter's optimizer, whose constant folding makes
    each linear weight's transpose a new array (a copy of the weights); without it the graph keeps
    `MatMul(x, Transpose(W))` and every initializer is the module's own tensor, read only when the
    program is saved (exporters/streamed.py)."""
    try:
        program = torch.onnx.export(
            module,
            arguments,
            dynamo=True,
            input_names=[spec.name for spec in inputs],
            output_names=[spec.name for spec in outputs],
            dynamic_shapes=_dynamic_shapes(inputs),
            opset_version=opset,
            optimize=fold,
            verbose=False,  # otherwise it prints its progress on stdout
        )
    except Exception as err:  # torch.export raises many types; all mean the same to the user
        raise ExportError(
            f"torch.onnx could not export {type(module).__name__}: {err}\n"
            "If the error names a shape constraint or specialization, the model's code fixes a "
            "size the specs declare dynamic: trace with a sample batch of batch >= 2 and a "
            "typical length, or make that code independent of the size. Otherwise the forward "
            "does something torch.export cannot capture (data-dependent Python control flow)."
        ) from err
    assert program is not None, "torch.onnx.export(dynamo=True) returns the exported program"
    # Drop the per-node debugging metadata (source stack traces with this machine's paths): it
    # serves nothing at run time and makes the file depend on where the code was installed.
    for node in program.model.graph.all_nodes():
        node.metadata_props.clear()
    return program


def _export_with_torch(
    module: torch.nn.Module,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    arguments: tuple[torch.Tensor, ...],
    out_path: Path,
    opset: int,
    external: bool,
) -> None:
    """torch.onnx's dynamo exporter (`torch_program`), saved straight to out_path."""
    program = torch_program(module, inputs, outputs, arguments, opset)
    # The exporter's constant folding made each linear weight's transpose a new array: the program
    # holds a copy of the weights. The module's mapped pages, which it read to make them, are not
    # needed while the copy is written (models/readers/mapped.py).
    page_out([*module.parameters(), *module.buffers()])
    _remove_written(out_path)
    program.save(str(out_path), external_data=external)
    del program
    return_freed_memory(_weights(module)[1])  # the program's copy of the weights, before the graph is checked


def _dynamic_shapes(inputs: Sequence[TensorSpec]) -> tuple[dict[int, Any], ...]:
    """torch.export's dynamic_shapes, positional like the sample arguments. One Dim object per
    axis name, so that inputs sharing "batch"/"length" are known to be equal."""
    dims: dict[str, Any] = {}
    return tuple(
        {
            axis_index: dims.setdefault(name, torch.export.Dim(name))
            for axis_index, name in dynamic_axes([spec])[spec.name].items()
        }
        for spec in inputs
    )


def _export_with_navigator(
    module: torch.nn.Module,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    arguments: tuple[torch.Tensor, ...],
    out_path: Path,
    opset: int,
    external: bool,
    workspace: Path | None,
) -> None:
    """Model Navigator's export, re-saved from its workspace to out_path in our weights layout."""
    with navigator.navigator_export(
        module, inputs, outputs, arguments, opset=opset, workspace=workspace
    ) as produced:
        model = onnx.load(str(produced))  # with its external data, if Navigator wrote any
        _remove_written(out_path)
        onnx.save_model(
            model,
            str(out_path),
            save_as_external_data=external,
            all_tensors_to_one_file=True,
            location=_data_path(out_path).name,
        )
    if external:
        # onnx creates the weights file owner-only (0600); a Triton running as another user
        # could then load the graph but not its weights. Give it the graph file's permissions.
        _data_path(out_path).chmod(out_path.stat().st_mode & 0o777)


def check_written(out_path: Path, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> None:
    """onnx.checker (by path, so external data and >2 GiB models work) plus the signature."""
    try:
        onnx.checker.check_model(str(out_path))
    except onnx.checker.ValidationError as err:
        raise ExportError(f"the exported graph {out_path} is not valid ONNX: {err}") from err
    check_graph_signature(out_path, inputs, outputs)


def _weights(module: torch.nn.Module) -> tuple[int, int]:
    """(number of parameters, bytes of parameters and buffers): what the graph will carry."""
    parameters = sum(p.numel() for p in module.parameters())
    tensors = [*module.parameters(), *module.buffers()]
    return parameters, sum(t.numel() * t.element_size() for t in tensors)


def _decide_external_data(requested: bool | None, weight_bytes: int) -> bool:
    """External data when asked, or automatically when the weights approach protobuf's limit."""
    if requested is None:
        return weight_bytes > EXTERNAL_DATA_THRESHOLD_BYTES
    if not requested and weight_bytes >= PROTOBUF_LIMIT_BYTES:
        raise InvalidInputError(
            f"the model has {weight_bytes / 2**30:.1f} GiB of weights, more than one ONNX file can "
            "hold (2 GiB); use external_data=True or leave it None"
        )
    return requested


def _data_path(out_path: Path) -> Path:
    """The external weights file: `<name>.onnx.data` next to the graph (torch's convention;
    ONNX Runtime resolves it relative to the .onnx)."""
    return out_path.with_name(out_path.name + ".data")


def _remove_written(out_path: Path) -> None:
    """Remove a previous export at out_path, so a stale weights file cannot outlive its graph."""
    out_path.unlink(missing_ok=True)
    _data_path(out_path).unlink(missing_ok=True)


@contextlib.contextmanager
def eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Export in eval mode (no dropout), restoring the caller's mode afterwards."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


@contextlib.contextmanager
def collected_warnings() -> Iterator[list[str]]:
    """Collect warnings and torch.onnx's logged warnings into a list of distinct messages, so
    that an export keeps the console quiet but its result still records them."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _add_distinct(messages, record.getMessage())

    # torch._logging gives "torch.onnx" its own stderr handler: swap it out for the export.
    torch_onnx_logger = logging.getLogger("torch.onnx")
    handlers, propagate = torch_onnx_logger.handlers[:], torch_onnx_logger.propagate
    torch_onnx_logger.handlers[:] = [Collect(logging.WARNING)]
    torch_onnx_logger.propagate = False
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield messages
        for warning in caught:
            _add_distinct(messages, f"{warning.category.__name__}: {warning.message}")
    finally:
        torch_onnx_logger.handlers[:] = handlers
        torch_onnx_logger.propagate = propagate


def _add_distinct(messages: list[str], message: str) -> None:
    """Append the first line of `message` (shortened) unless it is already there."""
    line = message.strip().splitlines()[0][:300] if message.strip() else ""
    if line and line not in messages:
        messages.append(line)
