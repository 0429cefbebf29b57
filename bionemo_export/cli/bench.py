"""Benchmark a served model with the real perf_analyzer and write a report (table, CSV, JSON, PNG)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from bionemo_export.bench import (
    BenchError,
    InputError,
    InputSpec,
    ProgressHook,
    Target,
    comparison_table,
    results_table,
    run_benchmarks,
    write_report,
)
from bionemo_export.bench.inputs import DEFAULT_LENGTHS, LENGTH_DISTRIBUTIONS
from bionemo_export.choices import Protocol
from bionemo_export.errors import worded
from bionemo_export.runtime import PerfAnalyzerNotFoundError, TritonNotFoundError, TritonStartError

from . import flag


class _RichProgress(ProgressHook):
    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.overall = progress.add_task("starting", total=None)
        self.current: TaskID | None = None

    def status(self, message: str) -> None:
        self.progress.update(self.overall, description=message)

    def run_started(self, label: str, model: str, concurrency: int, index: int, total: int) -> None:
        self.progress.update(self.overall, total=total, description=f"runs ({model})")
        self.current = self.progress.add_task(f"{label}: concurrency {concurrency}", total=None)

    def run_finished(self, label: str, result) -> None:
        if self.current is not None:
            self.progress.update(self.current, total=1, completed=1,
                                 description=f"{label}: concurrency {result.concurrency}: "
                                             f"{result.sequences_per_s:.1f} seq/s, p50 {result.p50_ms:.1f} ms")
        self.progress.advance(self.overall)


def _default_model(repository: Path) -> str | None:
    """The model to bench when none is named: the repository's embeddings model, else its first."""
    from bionemo_export.model_repository.manifest import Manifest  # not at import: protobuf

    try:
        public = Manifest.read(repository).public_models
    except (OSError, ValueError):  # no manifest, or not one
        return None
    return next((m for m in public if m.endswith("_embeddings")), public[0] if public else None)


def bench(
    target: Path | None = typer.Argument(None, help="Model repository folder to serve on the embedded "
                                            "tritonserver (or give --url).", file_okay=False),
    url: str | None = typer.Option(None, help="A running server instead: grpc://host:port, http://host:port "
                                      "or host:port (--protocol)."),
    model: str | None = typer.Option(None, "--model", "-m", help="Model to measure, e.g. esm2nv_embeddings "
                                        "(default for a folder: its N_embeddings)."),
    concurrency: str = typer.Option("1,8,32", help="Comma-separated concurrencies (requests in flight)."),
    lengths: str | None = typer.Option(None, help=f"Length distribution of generated inputs: "
                                          f"{', '.join(LENGTH_DISTRIBUTIONS)} (default {DEFAULT_LENGTHS}; "
                                          "smiles for hidden states), uniform:MIN-MAX, fixed:N, "
                                          "lognormal:MEDIAN,SIGMA[,MIN-MAX]."),
    # Named as InputSpec's field, so that an error naming `file` reads --input (cli.option_flags).
    file: Path | None = typer.Option(None, "--input", help="FASTA file, or one sequence/SMILES per "
                                        "line, instead of random proteins.", exists=True, dir_okay=False),
    count: int = typer.Option(256, help="Generated inputs perf_analyzer cycles through."),
    seed: int = typer.Option(0, help="Seed of the generated inputs."),
    variants: int = typer.Option(32, min=0, help="Scores models: random single substitutions per request (0: "
                                 "none: the model then scores the PLL)."),
    layers: str | None = typer.Option(None, help="Layers models (N_layers): the layers every request asks for, "
                                      "comma-separated (ESM's numbering, e.g. -1 or 0,12,-1; default: left out, "
                                      "the last); attentions models (N_attentions): the blocks (1..N, -1 the last)."),
    heads: str | None = typer.Option(None, help="Attentions models (N_attentions): the heads every request asks "
                                     "for, comma-separated (default: left out, every head)."),
    include: str | None = typer.Option(None, help="Layers models (N_layers): what every request asks for, "
                                       "comma-separated: mean, bos, max, per_tok (default: left out, mean)."),
    max_length: int | None = typer.Option(None, help="Clip generated lengths to this (default: the "
                                             "repository tokenizer's limit when found)."),
    duration: float = typer.Option(5.0, help="perf_analyzer measurement window in seconds; each concurrency "
                                   "runs until three windows agree."),
    stability: float = typer.Option(10.0, help="perf_analyzer --stability-percentage."),
    max_trials: int = typer.Option(10, help="perf_analyzer --max-trials (windows before giving up on "
                                   "stability; then a fixed request count is measured)."),
    out: Path = typer.Option(Path("bench_report"), help="Report folder: report.md, results.json, plot.png, CSVs."),
    compare: str | None = typer.Option(None, help="Second target (folder or URL) measured in the same run, "
                                          "interleaved; ratios B/A are reported."),
    compare_model: str | None = typer.Option(None, help="Model name on the --compare target (default: --model)."),
    protocol: Protocol = typer.Option(Protocol.GRPC, help="grpc or http (for folders and bare host:port URLs)."),
    tritonserver: str | None = typer.Option(None, help="tritonserver binary for folders (default: search, "
                                               "then the one inside nvidia-pytriton)."),
) -> None:
    console = Console()

    def fail(message: str, code: int = 2) -> NoReturn:
        console.print(f"[red]{message}[/red]", highlight=False)
        raise typer.Exit(code)

    if (target is None) == (url is None):
        fail("give either a repository folder or --url")
    if target is not None and not target.is_dir():
        fail(f"not a folder: {target}")
    model = model or (_default_model(target) if target is not None else None)
    if not model:
        fail("give --model (e.g. esm2nv_embeddings)")
    try:
        concurrencies = [int(c) for c in concurrency.split(",") if c.strip()]
        targets = [Target.parse(str(target) if target is not None else str(url), model, protocol, "A")]
        if compare:
            targets.append(Target.parse(compare, compare_model or model, protocol, "B"))
        if not concurrencies or min(concurrencies) < 1:
            raise ValueError(f"bad --concurrency {concurrency!r}: positive integers, comma-separated")
    except ValueError as err:
        fail(str(err))
    numbers = {}
    for option, text in (("--layers", layers), ("--heads", heads)):
        try:
            numbers[option] = tuple(int(v) for v in (text or "").split(",") if v.strip())
        except ValueError:
            fail(f"bad {option} {text!r}: integers, comma-separated")
    spec = InputSpec(lengths=lengths, file=file, count=count, seed=seed, max_length=max_length,
                     variants=variants, layers=numbers["--layers"], heads=numbers["--heads"],
                     include=tuple(v.strip() for v in (include or "").split(",") if v.strip()))
    command = _command_line(target, url, model, concurrency, lengths, file, count, seed, max_length, duration,
                            out, compare, compare_model, protocol)

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=False) as progress:
        try:
            results = run_benchmarks(targets, concurrencies, spec, duration, out_dir=out,
                                     stability_percentage=stability, max_trials=max_trials,
                                     tritonserver=tritonserver, progress=_RichProgress(progress))
        except (InputError, ValueError) as err:
            progress.stop()
            fail(worded(str(err), flag))
        except (BenchError, TritonStartError, TritonNotFoundError, PerfAnalyzerNotFoundError) as err:
            progress.stop()
            fail(worded(str(err), flag), 1)
    for result in results:
        console.print(results_table(result))
        console.print(f"inputs: {result.inputs}; mean length {result.mean_length:.1f}", highlight=False)
    if len(results) == 2:
        console.print(comparison_table(*results))
    paths = write_report(results, out, command=command)
    console.print(f"report: {paths['report']}  (results.json, plot.png and the raw CSVs beside it)", highlight=False)


def _command_line(target, url, model, concurrency, lengths, input_file, count, seed, max_length, duration, out,
                  compare, compare_model, protocol) -> str:
    args = ["bionemo-export", "bench"]
    args += [str(target)] if target is not None else ["--url", str(url)]
    args += ["--model", model, "--concurrency", concurrency]
    if input_file is not None:
        args += ["--input", str(input_file)]
    else:
        args += ["--lengths", lengths or "default", "--count", str(count), "--seed", str(seed)]
    if max_length is not None:
        args += ["--max-length", str(max_length)]
    args += ["--duration", f"{duration:g}", "--protocol", protocol, "--out", str(out)]
    if compare:
        args += ["--compare", compare] + (["--compare-model", compare_model] if compare_model else [])
    return shlex.join(args)
