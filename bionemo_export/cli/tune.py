"""Find the settings that serve a repository best on this host (instances, ONNX Runtime threads,
token budget, largest sub-batch, queue delay, length bucket) with the real perf_analyzer, and write
them into its configs atomically; --restore puts the previous ones back."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from bionemo_export.bench.inputs import DEFAULT_LENGTHS, LENGTH_DISTRIBUTIONS, InputSpec
from bionemo_export.build_precision import AUTO_INT8_MIN_SPEEDUP, describe_choice
from bionemo_export.choices import BuildPrecision, TuneObjective
from bionemo_export.tune.search import Progress as SearchProgress


class _RichProgress(SearchProgress):
    """The search's progress (tune.search.Progress) on a rich bar filling with the time budget; one
    line per candidate measured."""

    def __init__(self, progress: Progress, console: Console, budget_s: float) -> None:
        self.progress, self.console = progress, console
        self.task = progress.add_task("measuring the repository's own settings", total=budget_s)
        self.started = time.monotonic()
        self.baseline = None

    def tick(self) -> None:
        self.progress.update(self.task, completed=time.monotonic() - self.started)

    def trial_started(self, candidate, role: str, index: int) -> None:
        self.tick()
        what = {"baseline": "the repository's own settings", "candidate": f"candidate {index}"}.get(
            role, "untuned and tuned again, side by side")
        self.progress.update(self.task, description=what)

    def point_measured(self, point) -> None:
        self.tick()

    def trial_finished(self, trial, best) -> None:
        from bionemo_export.tune.report import describe_candidate

        self.tick()
        self.baseline = self.baseline or best
        figures = ", ".join(f"c{p.concurrency} {p.throughput:.1f}/s p99 {p.p99_ms:.0f} ms" for p in trial.points)
        self.console.print(f"  {describe_candidate(trial, self.baseline)}: {figures}"
                           + (" (pruned)" if trial.pruned else ""), highlight=False)


def tune(
    repository: Path = typer.Argument(..., help="The model repository folder (built by `build repo`).",
                                      file_okay=False, exists=True),
    model: str | None = typer.Option(None, "--model", "-m", help="Public model whose requests are measured "
                                        "(default: the repository's N_embeddings, else its first public model: a "
                                        "checkpoint ensemble's N_logits, whose members' models are tuned alike)."),
    objective: TuneObjective = typer.Option(TuneObjective.THROUGHPUT, help="throughput (sequences/s) or "
                                            "latency (p99)."),
    max_p99_ms: float | None = typer.Option(None, help="Latency bound: candidates whose p99 exceeds it at any "
                                               "concurrency are dropped."),
    concurrency: str = typer.Option("8,32", help="Comma-separated concurrencies each candidate is measured at."),
    file: Path | None = typer.Option(None, "--input", help="FASTA file, or one sequence/SMILES per line, "
                                        "instead of generated inputs.", exists=True, dir_okay=False),
    lengths: str | None = typer.Option(None, help=f"Length distribution of generated inputs: "
                                          f"{', '.join(LENGTH_DISTRIBUTIONS)} (default {DEFAULT_LENGTHS})."),
    budget_minutes: float = typer.Option(10.0, help="Time for the search (measurements of the last candidates "
                                         "and the confirmation included)."),
    window: float = typer.Option(2.0, help="perf_analyzer measurement window per run, in seconds."),
    report: Path | None = typer.Option(None, help="Report folder (default: REPOSITORY-tuning beside it)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Report the winner without writing it."),
    restore: bool = typer.Option(False, "--restore", help="Put back the settings the last tune replaced, and "
                                 "exit."),
    tritonserver: str | None = typer.Option(None, help="tritonserver binary (default: search, then the one "
                                               "inside nvidia-pytriton)."),
    precision: BuildPrecision | None = typer.Option(
        None, help="First build the repository again in this precision, from the checkpoint its manifest.json names "
        "(auto: the fastest that meets its accuracy gate on this host, int8 where it runs at least "
        f"{AUTO_INT8_MIN_SPEEDUP:g}x fp32 here, else fp32); then tune its serving settings. Needs torch and the "
        "checkpoint, unchanged since the build."),
) -> None:
    from bionemo_export.model_repository.manifest import Manifest
    from bionemo_export.tune import TuneRequest, precision_mismatch, tune_repository
    from bionemo_export.tune import restore as restore_settings
    from bionemo_export.tune.report import COMPARISON_HEADER, comparison_rows, describe_candidate

    console = Console()
    if precision is not None and (restore or dry_run):
        raise typer.BadParameter("--precision builds the repository again; it does not go with "
                                 f"{'--restore' if restore else '--dry-run'}", param_hint="--precision")
    if precision is not None:
        _rebuild(repository.resolve(), precision, console)
    if restore:
        models = restore_settings(repository.resolve(), log=console.print)
        console.print(f"Restored the settings of {', '.join(models)} from before the last tune.")
        return
    try:
        concurrencies = tuple(int(c) for c in concurrency.split(",") if c.strip())
    except ValueError:
        raise typer.BadParameter(f"{concurrency!r}: positive integers, comma-separated",
                                 param_hint="--concurrency") from None
    request = TuneRequest(repository=repository, model=model, objective=objective, concurrencies=concurrencies,
                          max_p99_ms=max_p99_ms, inputs=InputSpec(lengths=lengths, file=file),
                          budget_minutes=budget_minutes, window_s=window, report_dir=report, write=not dry_run,
                          tritonserver=tritonserver, command=shlex.join(["bionemo-export", *sys.argv[1:]]))
    console.print(f"Tuning {repository} for {objective} within {budget_minutes:g} min; report: {request.out_dir}")
    warning = precision_mismatch(Manifest.read(repository))  # tune changes the serving settings, not the graph
    if warning:
        console.print(f"[yellow]warning: {warning}[/yellow]", highlight=False)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        outcome = tune_repository(request, progress=_RichProgress(progress, console, budget_minutes * 60))
    result = outcome.result
    table = Table(*COMPARISON_HEADER, title="untuned vs tuned, measured side by side")
    for row in comparison_rows(result):
        table.add_row(*row)
    console.print(table)
    if not result.changed:
        console.print("No candidate beat the repository's own settings on this host; nothing changed.")
    elif outcome.written:
        console.print(f"Wrote {describe_candidate(result.winner, result.baseline)} into {repository} "
                      "(`bionemo-export tune --restore` puts the previous settings back).", highlight=False)
    else:
        console.print(f"Best: {describe_candidate(result.winner, result.baseline)} (--dry-run: not written).",
                      highlight=False)
    console.print(f"Report: {outcome.report['markdown']} ({len(result.trials)} candidates, plot "
                  f"{outcome.report['png'].name})", highlight=False)


def _rebuild(repository: Path, precision: str, console: Console) -> None:
    """`--precision`: the repository built again (tune/rebuild.py), the choice said."""
    from bionemo_export.tune.rebuild import rebuild

    console.print(f"Building {repository} again in precision {precision} from its checkpoint")
    manifest = rebuild(repository, precision, progress=console.log)  # a UserError ends the command (cli/main.py)
    chosen = manifest.precision_choice
    console.print(f"Rebuilt in {manifest.precision}" + (f" ({describe_choice(chosen)})" if chosen else ""),
                  highlight=False)
