"""The benchmark report: rich tables for the terminal, report.md, results.json and a PNG plot."""

from __future__ import annotations

import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from rich.table import Table

from .run import BenchResult, ConcurrencyResult

COLUMNS = ("concurrency", "sequences/s", "tokens/s", "p50 ms", "p95 ms", "p99 ms", "server batch")


def _f(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def _row(r: ConcurrencyResult) -> list[str]:
    batch = _f(r.server_batch_size, 2) if r.server_batch_size is not None else "n/a"
    return [str(r.concurrency) + ("" if r.stable else " *"), _f(r.sequences_per_s), _f(r.tokens_per_s, 0),
            _f(r.p50_ms), _f(r.p95_ms), _f(r.p99_ms), batch]


def results_table(result: BenchResult) -> Table:
    """One row per concurrency."""
    table = Table(title=f"{result.label}: {result.model} on {result.target}", title_justify="left")
    for i, name in enumerate(COLUMNS):
        table.add_column(name, justify="right" if i else "left")
    for r in result.results:
        table.add_row(*_row(r))
    batch_models = sorted({r.batch_model for r in result.results if r.batch_model})
    table.caption = ("server batch: inference_count / execution_count of " + ", ".join(batch_models)
                     if batch_models else "server batch: statistics endpoint not readable")
    if any(not r.stable for r in result.results):
        table.caption += "; * no stable window: a fixed request count was measured"
    return table


def comparison(a: BenchResult, b: BenchResult) -> list[dict[str, Any]]:
    """Per concurrency both targets' figures and the ratios B/A."""
    rows = []
    for ra in a.results:
        rb = b.at(ra.concurrency)
        if rb is None:
            continue
        rows.append({
            "concurrency": ra.concurrency,
            "throughput_a": ra.sequences_per_s, "throughput_b": rb.sequences_per_s,
            "throughput_ratio": rb.sequences_per_s / ra.sequences_per_s if ra.sequences_per_s else math.nan,
            "p50_a_ms": ra.p50_ms, "p50_b_ms": rb.p50_ms,
            "p50_ratio": rb.p50_ms / ra.p50_ms if ra.p50_ms else math.nan,
            "p99_ratio": rb.p99_ms / ra.p99_ms if ra.p99_ms else math.nan,
        })
    return rows


def comparison_table(a: BenchResult, b: BenchResult) -> Table:
    table = Table(title=f"B / A  (A: {a.model} on {a.target}; B: {b.model} on {b.target})", title_justify="left")
    for i, name in enumerate(("conc", "A seq/s", "B seq/s", "throughput B/A", "A p50 ms", "B p50 ms",
                              "p50 B/A", "p99 B/A")):
        table.add_column(name, justify="right" if i else "left")
    for row in comparison(a, b):
        table.add_row(str(row["concurrency"]), _f(row["throughput_a"]), _f(row["throughput_b"]),
                      _f(row["throughput_ratio"], 2) + "x", _f(row["p50_a_ms"]), _f(row["p50_b_ms"]),
                      _f(row["p50_ratio"], 2) + "x", _f(row["p99_ratio"], 2) + "x")
    return table


def plot(results: list[BenchResult], path: str | Path) -> Path:
    """Throughput (left) and p50/p99 latency (right) against concurrency, one colour per target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, result in enumerate(results):
        color = f"C{i}"
        xs = [r.concurrency for r in result.results]
        name = f"{result.label}: {result.model}"
        left.plot(xs, [r.sequences_per_s for r in result.results], "o-", color=color, label=name)
        right.plot(xs, [r.p50_ms for r in result.results], "o-", color=color, label=f"{name} p50")
        right.plot(xs, [r.p99_ms for r in result.results], "s--", color=color, label=f"{name} p99")
    for ax, ylabel in ((left, "sequences / s"), (right, "latency (ms)")):
        ax.set_xscale("log", base=2)
        ticks = sorted({r.concurrency for res in results for r in res.results})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    left.set_title("throughput")
    right.set_title("latency")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def markdown(results: list[BenchResult], *, command: str, env: dict[str, Any], files: list[str]) -> str:
    first = results[0]
    out = [
        "# bionemo-export bench",
        "",
        f"Command: `{command}`",
        "",
        f"Date: {_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        "## Machine and versions",
        "",
        f"- platform: {env.get('platform')} ({env.get('machine')}), {env.get('cores')} cores, {env.get('processor')}",
        "- tritonserver: " + ", ".join(f"{r.label} {r.server_version}" for r in results),
        f"- perf_analyzer: {first.perf_analyzer_version}",
        f"- onnxruntime: {env.get('onnxruntime')} (this environment; the embedded server's Python backend runs it)",
        f"- tritonclient: {env.get('tritonclient')}, Python {env.get('python')}",
        "",
        "## Method",
        "",
        f"perf_analyzer over {first.protocol}, one run per concurrency and target"
        + (", targets interleaved per concurrency" if len(results) > 1 else "")
        + f"; measurement window {first.window_s:g} s, each run until three windows in a row agree "
        "(runs marked * had no stable window and measured a fixed request count instead). "
        "perf_analyzer runs on the same host as the server and shares its cores. sequences/s is "
        "perf_analyzer's throughput (one sequence per request); tokens/s is that times the mean length "
        "of the inputs perf_analyzer cycles through; latencies are client-side. Server batch is "
        "inference_count / execution_count from the server's statistics, read before and after each run.",
        "",
    ]
    for result in results:
        out += [
            f"## {result.label}: `{result.model}` on `{result.target}`",
            "",
            f"Inputs: {result.inputs}; mean length {result.mean_length:.1f}.",
        ]
        out += [f"Note: {note}." for note in result.input_notes]
        out += ["", _md_table(list(COLUMNS), [_row(r) for r in result.results]), ""]
        model_rows = [
            [str(r.concurrency), m.name, str(m.inferences), str(m.executions), _f(m.batch_size, 2),
             _f(m.queue_us, 0), _f(m.compute_us, 0), str(m.failures)]
            for r in result.results for m in r.models
        ]
        if model_rows:
            out += ["Server statistics per model (whole run, warm-up windows included):", "",
                    _md_table(["concurrency", "model", "inferences", "executions", "batch size",
                               "queue us/request", "compute us/request", "failures"], model_rows), ""]
    if len(results) == 2:
        rows = comparison(*results)
        out += ["## Comparison B / A", "",
                _md_table(["concurrency", "A seq/s", "B seq/s", "throughput B/A", "A p50 ms", "B p50 ms",
                           "p50 B/A", "p99 B/A"],
                          [[str(r["concurrency"]), _f(r["throughput_a"]), _f(r["throughput_b"]),
                            _f(r["throughput_ratio"], 2) + "x", _f(r["p50_a_ms"]), _f(r["p50_b_ms"]),
                            _f(r["p50_ratio"], 2) + "x", _f(r["p99_ratio"], 2) + "x"] for r in rows]), ""]
    out += ["## Files", "", "![throughput and latency](plot.png)", ""] + [f"- `{name}`" for name in files] + [""]
    return "\n".join(out)


def write_report(results: list[BenchResult], out_dir: str | Path, *, command: str,
                 env: dict[str, Any] | None = None) -> dict[str, Path]:
    """report.md, results.json and plot.png in `out_dir` (where the run left its CSVs)."""
    from .run import environment

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = env or environment()
    paths = {"json": out / "results.json", "plot": out / "plot.png", "report": out / "report.md"}
    document: dict[str, Any] = {"command": command, "environment": env,
                                "targets": [r.to_dict() for r in results]}
    if len(results) == 2:
        document["comparison"] = comparison(*results)
    paths["json"].write_text(json.dumps(document, indent=2, default=str) + "\n")
    plot(results, paths["plot"])
    files = sorted(p.name for p in out.iterdir() if p.is_file() and p.name not in ("report.md",))
    paths["report"].write_text(markdown(results, command=command, env=env, files=files))
    return paths
