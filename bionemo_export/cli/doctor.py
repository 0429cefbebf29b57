"""Show what this host provides for exporting, serving and benchmarking, and how to fix what is missing."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.table import Table

from bionemo_export.doctor import Job, missing_for, run_checks
from bionemo_export.memory_plan import HostCapacity, host_capacity
from bionemo_export.procfs import available_memory_bytes


def doctor(
    tritonserver: str | None = typer.Option(None, help="Check this tritonserver binary instead of searching."),
    probe: bool = typer.Option(True, help="Start tritonserver once on an empty repository to read its version."),
    job: Job | None = typer.Option(None, help="Judge the host for this job only (default: every job): e.g. serve "
                                              "on a host that only serves, such as NVIDIA's Triton container "
                                              "with the base install. Exit code 1 when something it needs is "
                                              "missing."),
) -> None:
    """List each component with the jobs that need it (build, serve, bench), then whether each job can
    run here; exit code 1 when a job asked for (every job by default) lacks something."""
    checks = run_checks(tritonserver, probe=probe)
    jobs = [job] if job is not None else list(Job)
    table = Table(title="bionemo-export doctor", show_lines=True)
    table.add_column("component", no_wrap=True)
    table.add_column("status", no_wrap=True)
    table.add_column("needed for", no_wrap=True)
    table.add_column("found", overflow="fold", ratio=3)
    table.add_column("fix", overflow="fold", ratio=2)
    for check in checks:
        if check.ok:
            status = "[green]ok[/green]"
        elif any(wanted in check.needed_for for wanted in jobs):
            status = "[red]missing[/red]"
        else:  # optional, or needed only by jobs not asked about
            status = "[yellow]not available[/yellow]"
        table.add_row(check.name, status, ", ".join(check.needed_for) or "optional", check.found, check.fix)
    console = Console()
    console.print(table)
    console.print(_capacity_table(host_capacity(available_memory_bytes())))
    missing: list[str] = []
    for wanted in jobs:
        lacking = missing_for(checks, wanted)
        verdict = f"[red]missing[/red] {', '.join(lacking)}" if lacking else "[green]ready[/green]"
        console.print(f"{wanted}: {verdict}", highlight=False)
        missing += [name for name in lacking if name not in missing]
    if missing:
        names = [check.name for check in checks if check.name in missing]  # the table's order
        console.print(f"[red]Missing required components:[/red] {', '.join(names)}")
        raise typer.Exit(1)


def _capacity_table(rows: list[HostCapacity]) -> Table:
    """The released models against this host's memory: what a default (fp32) and an int4 build
    need at their peak, and what serving each needs with one encoder instance (memory_plan.py)."""
    available = rows[0].available if rows else None
    here = f"{available / 2**30:.1f} GiB available" if available is not None else "memory available unknown"
    table = Table(title=f"What this host builds and serves ({here}; estimates: inspect CHECKPOINT for yours)")
    table.add_column("model", no_wrap=True)
    table.add_column("fp32 weights", justify="right")
    for column in ("build fp32", "build int4", "serve fp32", "serve int4"):
        table.add_column(column, justify="right", no_wrap=True)

    def cell(row: HostCapacity, needed: int) -> str:
        return f"{needed / 2**30:.1f} GiB " + ("[green]yes[/green]" if row.fits(needed) else "[red]no[/red]")

    for row in rows:
        table.add_row(row.model.name, f"{row.model.fp32_bytes / 1e9:.2f} GB",
                      *(cell(row, row.builds[p].needed) for p in ("fp32", "int4")),
                      *(cell(row, row.serves[p].needed) for p in ("fp32", "int4")))
    table.caption = ("A build that does not fit is refused before it loads anything; models whose weights do not fit "
                     "need a build that streams them block by block (not built yet).")
    return table
