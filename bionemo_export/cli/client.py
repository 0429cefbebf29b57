"""Query served models (compatible with BioNeMo's client_encode)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import numpy as np
import typer
from rich.console import Console

from . import debugging

app = typer.Typer(help=__doc__, no_args_is_help=True)


@app.command("encode")
def encode(
    ctx: typer.Context,
    model: str = typer.Option(..., "--model", "-m", help="Public model, e.g. esm2nv_embeddings or esm2nv_hiddens."),
    sequences: List[str] = typer.Option(..., "--sequences", "-s", help="A sequence; repeat for a batch."),
    triton_url: str = typer.Option("http://localhost:8000", help="http://host:port or grpc://host:port."),
    in_name: str = typer.Option("sequences", help="Name of the model's string input."),
    output: Optional[Path] = typer.Option(None, help="Write {output_name: nested lists} JSON here."),
) -> None:
    """Send sequences to a model and print (or save) every output."""
    from bionemo_export.client import InferenceError, TritonClient, strings_to_tensor
    from bionemo_export.errors import reason

    console = Console()
    if output is not None and (problem := _unwritable(output)):
        console.print(f"[red]--output {output}: {problem}[/red]", highlight=False)
        raise typer.Exit(2)
    try:
        with TritonClient(triton_url) as client:
            outputs = client.infer(model, {in_name: strings_to_tensor(sequences)})
    except (InferenceError, ValueError, ConnectionError) as err:
        if debugging(ctx):
            raise
        console.print(f"[red]{reason(err)}[/red]", highlight=False)
        raise typer.Exit(1)
    serializable = {name: _to_json(value) for name, value in outputs.items()}
    if output:
        output.write_text(json.dumps(serializable))
        console.print(f"wrote {', '.join(serializable)} to {output}")
        return
    for name, value in outputs.items():
        console.print(f"{name}: shape {list(value.shape)} {value.dtype}")
        console.print(np.array2string(value, threshold=20, precision=4) if value.dtype != object
                      else str(serializable[name]))


def _unwritable(path: Path) -> str | None:
    """Why a JSON file cannot be written at `path` (checked before the request is sent), or None."""
    if path.is_dir():
        return "is a folder; give a file name"
    if not path.parent.is_dir():
        return f"{path.parent} is not an existing folder"
    return None


def _to_json(value: np.ndarray) -> list:
    if value.dtype == object:
        return [[item.decode("utf-8") if isinstance(item, bytes) else item for item in np.atleast_1d(row)]
                for row in value]
    return value.tolist()
