"""Show what this host provides for exporting, serving and benchmarking, and how to fix what is missing."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.runtime.doctor import run_checks


def doctor(
    tritonserver: str | None = typer.Option(None, help="Check this tritonserver binary instead of searching."),
    probe: bool = typer.Option(True, help="Start tritonserver once on an empty repository to read its version."),
) -> None:
    checks = run_checks(tritonserver, probe=probe)
    table = Table(title="bionemo-export doctor", show_lines=True)
    table.add_column("component", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("found", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for check in checks:
        if check.ok:
            status = "[green]ok[/green]"
        elif check.required:
            status = "[red]missing[/red]"
        else:
            status = "[yellow]not available[/yellow]"
        table.add_row(check.name, status, check.found, check.fix)
    console = Console()
    console.print(table)
    missing = [c.name for c in checks if c.required and not c.ok]
    if missing:
        console.print(f"[red]Missing required components:[/red] {', '.join(missing)}")
        raise typer.Exit(1)
