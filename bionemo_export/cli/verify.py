"""Check a served repository's outputs against the PyTorch reference of the checkpoint it came from,
or, without the checkpoint, its stored golden answers on this host."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from . import NO_CHECK_HELP, check_files, debugging, reason


def verify(
    ctx: typer.Context,
    repository: Path = typer.Argument(..., help="Repository built by `bionemo-export build repo`.",
                                      exists=True, file_okay=False, resolve_path=True),
    checkpoint: list[Path] | None = typer.Option(
        None, help="The checkpoint the repository was built from (an ensemble's: once per member, in the build's "
        "order; its answers are checked against the mean of the members' PyTorch answers). Without it, every "
        "graph's golden answers (the build's verified inputs and PyTorch outputs, stored in the repository) run "
        "here, as each served model runs them when it loads.", exists=True, resolve_path=True, metavar="PATH"),
    url: str | None = typer.Option(None, help="A running server (grpc://host:8001 or http://host:8000); "
                                      "default: start the repository on the embedded tritonserver."),
    tritonserver: str | None = typer.Option(None, help="tritonserver binary to start (default: search)."),
    no_check: bool = typer.Option(False, "--no-check", help=NO_CHECK_HELP),
) -> None:
    from bionemo_export.verify import verify_golden, verify_repository

    console = Console()
    checkpoint = checkpoint or None  # Typer gives an empty list for an option never given
    if checkpoint is None and url is not None:
        console.print("[red]verify: --url needs --checkpoint[/red] (without one, verify runs the repository's golden "
                      "answers on this host; a remote server's models ran them on theirs when they loaded)")
        raise typer.Exit(2)
    check_files(repository, skip=no_check)  # before the (slow) checkpoint load
    try:
        if checkpoint is None:
            checks = verify_golden(repository, check_files=False)
        else:
            checks = verify_repository(repository, checkpoint, url=url, tritonserver=tritonserver, check_files=False)
    except (OSError, ValueError, RuntimeError) as err:  # OSError: unreadable files, an unreachable --url
        if debugging(ctx):
            raise
        console.print(f"[red]verify failed:[/red] {reason(err)}", highlight=False)
        raise typer.Exit(2) from None
    against = "PyTorch" if checkpoint is not None else "its golden answers, on this host"
    table = Table(title=f"served {repository.name} vs {against}")
    for column in ("model", "batch", "max abs error", "min cosine", "mask exact", "ok", "note"):
        table.add_column(column)
    for check in checks:
        mask = "" if check.mask_exact is None else ("yes" if check.mask_exact else "NO")
        error = "" if check.max_abs_error is None else f"{check.max_abs_error:.2e}"
        cosine = "" if check.min_cosine is None else f"{check.min_cosine:.6f}"
        table.add_row(check.model, check.batch, error, cosine, mask, "yes" if check.passed else "[red]NO[/red]",
                      check.note)
    console.print(table)
    for check in checks:
        if check.problem:
            console.print(f"[red]{check.model} ({check.batch}): {check.problem}[/red]", highlight=False)
    if not all(check.passed for check in checks):
        console.print("[red]served outputs differ from PyTorch beyond the family's tolerance[/red]")
        raise typer.Exit(1)
    console.print("all checks passed")
