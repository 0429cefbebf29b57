"""Show what the tool sees in a checkpoint before building anything: form, family, sizes, tokenizer,
parallel layout, keys mapped / skipped / left out, the tasks a build would serve and the command."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def inspect(
    checkpoint: list[Path] = typer.Argument(..., help="A Hugging Face directory, a .nemo archive (model-parallel "
                                            "too), a NeMo 2 directory, an nv_esm directory, a fair-esm .pt file or "
                                            "the project's saved form. Several: the members of one ensemble (`build "
                                            "repo --checkpoint` given once each), each reported, and whether they "
                                            "can be served as one.", exists=True, resolve_path=True),
    model: str | None = typer.Option(None, "--model", "-m", help="Read it as this family (default: what the "
                                        "checkpoint says, or the one family that reads it)."),
    max_length: int | None = typer.Option(None, help="Most tokens per sequence, as `build repo --max-length`."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON (for scripts)."),
) -> None:
    from bionemo_export.checkpoint_report import inspect_checkpoint, inspect_ensemble
    from bionemo_export.errors import worded

    from . import flag

    report = (inspect_checkpoint(checkpoint[0], model, max_length) if len(checkpoint) == 1
              else inspect_ensemble(checkpoint, model, max_length))
    # The report quotes the library's errors, which name settings by field: worded as flags here.
    typer.echo(json.dumps(report.to_dict(), indent=2) if as_json else worded(report.render(), flag))
    if not report.ok:
        raise typer.Exit(1)
