"""Export through Triton Model Navigator (`nav.torch.optimize` with the ONNX target on CPU).

Navigator exports with torch.onnx, optimizes the graph (Polygraphy constant folding), checks it
in ONNX Runtime against the PyTorch outputs and benchmarks it, each step in a spawned worker
process. It is optional: `navigator_available()` says whether it imports here.

Navigator changes process-wide state when imported and while it runs: it points the root
`logging` logger at loguru, captures warnings, sets multiprocessing's start method to "spawn",
and prints progress tables and tool output on the console. Everything here runs inside
`_contained()`, which sends all of that console output to a log file and restores the process
state afterwards, so that library code, the CLI and pytest keep their own logging and output.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import multiprocessing
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TextIO

from bionemo_export.errors import UserError

if TYPE_CHECKING:  # annotations only: importing the models package imports every family, and torch
    import torch

    from bionemo_export.tensors import TensorSpec

ONNX_MODEL_KEY = "onnx"
"""Navigator's key (and workspace folder) for the ONNX format."""
ONNX_RUNNER = "OnnxCPU"
CONSOLE_LOG = "console.log"
INSTALL_HINT = (
    "install it with scripts/setup.sh (triton-model-navigator 0.14.0 with --no-deps plus its "
    "requirements, see requirements/runtime.txt), or use exporter='torch'"
)


class NavigatorUnavailableError(UserError, RuntimeError):
    """Model Navigator was asked for but does not import here."""


class NavigatorExportError(UserError, RuntimeError):
    """Model Navigator ran but produced no valid ONNX model; the message names its log."""


def navigator_available() -> bool:
    """Whether Model Navigator imports here (checked once per process)."""
    return isinstance(_import_result(), ModuleType)


def navigator_problem() -> str | None:
    """Why Model Navigator cannot be used here (its import failed), or None when it can."""
    result = _import_result()
    return None if isinstance(result, ModuleType) else result


def navigator_version() -> str:
    """The installed Model Navigator version (raises NavigatorUnavailableError if none)."""
    return str(_navigator().__version__)


@contextlib.contextmanager
def navigator_export(
    module: torch.nn.Module,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    arguments: tuple[torch.Tensor, ...],
    *,
    opset: int,
    workspace: Path | None = None,
) -> Iterator[Path]:
    """Run Navigator's ONNX export of `module` on the sample `arguments` (positional tensors in
    the order of `inputs`) and yield the path of the ONNX model it produced.

    `workspace` (empty or absent) receives Navigator's workspace (`navigator/`, with its
    navigator.log and reproduction scripts) and everything printed on the console
    (`console.log`). By default a temporary folder, removed when the `with` block succeeds and
    kept, for its logs, when anything fails.
    """
    nav = _navigator()  # before creating anything: a missing Navigator leaves no folder behind
    folder = Path(tempfile.mkdtemp(prefix="bionemo-navigator-")) if workspace is None else Path(workspace)
    if folder.exists() and any(folder.iterdir()):
        raise ValueError(f"the Model Navigator workspace {folder} is not empty; give an empty or new folder")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with open(folder / CONSOLE_LOG, "a", encoding="utf-8", buffering=1) as console, _contained(console):
            package = _optimize(nav, module, inputs, outputs, arguments, folder / "navigator", opset)
    except Exception as err:  # Navigator wraps its failures in many types; all need its logs
        raise _failure(folder, f"it stopped with {type(err).__name__}: {err}") from err
    yield _produced_model(nav, package, folder)
    if workspace is None:  # reached only on success: a failure keeps the logs
        shutil.rmtree(folder, ignore_errors=True)


def _optimize(
    nav: ModuleType,
    module: torch.nn.Module,
    inputs: Sequence[TensorSpec],
    outputs: Sequence[TensorSpec],
    arguments: tuple[torch.Tensor, ...],
    workspace: Path,
    opset: int,
) -> Any:
    """`nav.torch.optimize` with the ONNX target on CPU, our names and dynamic axes: a Package."""
    # Not at import: signature imports torch and onnx, and doctor asks whether Navigator is usable
    # (navigator_problem) on hosts without them.
    from bionemo_export.exporters.signature import dynamic_axes

    _forget_earlier_workspaces()
    return nav.torch.optimize(
        model=module,
        dataloader=[arguments],
        input_names=tuple(spec.name for spec in inputs),
        output_names=tuple(spec.name for spec in outputs),
        target_formats=(nav.Format.ONNX,),
        target_device=nav.DeviceKind.CPU,
        # Only ONNX Runtime: Navigator's TorchCPU profiling calls into CUDA and fails on a
        # CPU-only torch, and torch.compile validation costs minutes; the PyTorch reference
        # outputs it compares against are collected either way.
        runners=(ONNX_RUNNER,),
        workspace=workspace,
        custom_configs=[
            nav.OnnxConfig(
                opset=opset,
                dynamic_axes=dynamic_axes([*inputs, *outputs]),
                # The torch.export-based exporter, as export_onnx's "torch" uses (torch's
                # default since 2.9; explicit so an older torch does not fall back to tracing).
                custom_args={"dynamo": True},
            )
        ],
        # We need the export and its ONNX Runtime check, not a benchmark: one short window.
        optimization_profile=nav.OptimizationProfile(
            batch_sizes=[1], window_size=1, stabilization_windows=1, min_trials=1, max_trials=1
        ),
    )


def _forget_earlier_workspaces() -> None:
    """Navigator 0.14's process-wide optimize report remembers every workspace of the process and
    writes its report into all of them after each run: the second export in one process fails
    when the first one's (temporary) workspace is gone. Its own "registry cleared" event resets
    that list."""
    from model_navigator.reporting.optimize.events import OptimizeEvent, default_event_emitter

    default_event_emitter().emit(OptimizeEvent.MODULE_REGISTRY_CLEARED)


def _produced_model(nav: ModuleType, package: Any, folder: Path) -> Path:
    """The ONNX model of a finished optimize run, if its export steps and its ONNX Runtime
    correctness run succeeded (the benchmark may fail: it does not change the model)."""
    status = package.status.models_status.get(ONNX_MODEL_KEY)
    if status is None:
        raise _failure(folder, "it produced no ONNX model")
    runner = status.runners_status.get(ONNX_RUNNER)
    steps = {**status.status, "Correctness": runner.status.get("Correctness") if runner else None}
    failed = {step: getattr(result, "value", "not run") for step, result in steps.items()
              if result != nav.CommandStatus.OK}
    if failed:
        raise _failure(folder, f"these steps did not succeed: {failed}")
    return package.get_model_path(ONNX_MODEL_KEY)


def _failure(folder: Path, reason: str) -> NavigatorExportError:
    """The error for a failed run: why, where its logs are, and the usual causes."""
    return NavigatorExportError(
        f"Model Navigator did not produce a working ONNX model: {reason}. Its logs are in "
        f"{folder / 'navigator' / 'navigator.log'} and {folder / CONSOLE_LOG}. If a script "
        "called it, the script's top-level code must sit under `if __name__ == \"__main__\":` "
        "(Navigator spawns worker processes, which re-import the script); exporter='torch' "
        "runs the same torch.onnx export directly and reports its error."
    )


def _navigator() -> ModuleType:
    """The model_navigator module, or NavigatorUnavailableError saying how to get it."""
    result = _import_result()
    if isinstance(result, ModuleType):
        return result
    raise NavigatorUnavailableError(f"Triton Model Navigator is not usable here ({result}); {INSTALL_HINT}")


@functools.cache
def _import_result() -> ModuleType | str:
    """Import model_navigator once, quietly: the module, or why it failed."""
    with tempfile.TemporaryFile("w+", encoding="utf-8") as console, _contained(console):
        try:
            import model_navigator
        except Exception as err:  # a --no-deps install can miss any dependency
            return f"import model_navigator failed: {type(err).__name__}: {err}"
    return model_navigator


@contextlib.contextmanager
def _contained(console: TextIO) -> Iterator[None]:
    """Run Navigator with stdout/stderr (Python's and the file descriptors its worker processes
    inherit) going to `console`, and restore what it changes in this process afterwards: the
    root logger, warnings capture, loguru's sinks and multiprocessing's start method."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    showwarning = warnings.showwarning
    start_method = multiprocessing.get_start_method(allow_none=True)
    # Navigator's workers must be spawned: a forked child would inherit torch's thread pools.
    multiprocessing.set_start_method("spawn", force=True)
    try:
        with _console_to(console):
            yield
    finally:
        multiprocessing.set_start_method(start_method, force=True)
        if warnings.showwarning is not showwarning:
            logging.captureWarnings(False)  # undoes Navigator's logging.captureWarnings(True)
            warnings.showwarning = showwarning
        root.handlers[:] = handlers
        root.setLevel(level)
        _remove_loguru_sinks()


@contextlib.contextmanager
def _console_to(console: TextIO) -> Iterator[None]:
    """Send sys.stdout/sys.stderr and file descriptors 1 and 2 to `console`."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        os.dup2(console.fileno(), 1)
        os.dup2(console.fileno(), 2)
        with contextlib.redirect_stdout(console), contextlib.redirect_stderr(console):
            yield
    finally:
        console.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for descriptor in saved:
            os.close(descriptor)


def _remove_loguru_sinks() -> None:
    """Drop the sinks Navigator gave loguru (stderr, files in its workspace, each with a writer
    thread): after the run they would point at a redirected stream or a deleted folder."""
    try:
        from loguru import logger
    except ImportError:  # Navigator did not import, so it added no sinks
        return
    logger.remove()
