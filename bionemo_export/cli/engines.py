"""TensorRT engines of a `--backend tensorrt` repository: build them where TensorRT is installed."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.choices import EnginePrecision

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.command("build")
def build(
    repository: Path = typer.Argument(..., help="A repository built with `build repo --backend tensorrt`.",
                                      exists=True, file_okay=False, resolve_path=True),
    precision: EnginePrecision | None = typer.Option(None, help="The engines' precision (default: each "
                                                                "engine.json's, fp16)."),
    force: bool = typer.Option(False, help="Rebuild engines that are up to date for this GPU and TensorRT."),
) -> None:
    """Check the repository, then build each model's model.plan from its model.onnx and engine.json
    profiles (skipping engines already built for this GPU and TensorRT version)."""
    from bionemo_export.runtime.engines import build_engines

    console = Console()
    results = build_engines(repository, precision=precision, force=force, progress=console.log)
    table = Table(title=f"TensorRT engines of {repository}")
    for column in ("model", "status", "seconds", "MB"):
        table.add_column(column)
    for result in results:
        table.add_row(result.model, result.status, f"{result.seconds:.1f}" if result.seconds else "",
                      f"{result.bytes / 1e6:.1f}" if result.bytes else "")
    console.print(table)
