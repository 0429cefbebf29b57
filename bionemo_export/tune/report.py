"""The tuning report: report.md (tables), report.json (every measurement), frontier.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .search import Objective, SearchResult, Trial, frontier
from .space import shown


def describe_candidate(trial: Trial, baseline: Trial) -> str:
    """What `trial` changes from the baseline's settings ("as built" when nothing)."""
    parts = []
    for model, settings in trial.candidate.items():
        ours, theirs = settings.values(), baseline.candidate[model].values()
        changed = [f"{k} {shown(k, v)}" for k, v in ours.items() if theirs.get(k) != v]
        if changed:
            parts.append(f"{model}: " + ", ".join(changed) if len(trial.candidate) > 1 else ", ".join(changed))
    return "; ".join(parts) or "as built"


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows)]


def comparison_rows(result: SearchResult) -> list[list[str]]:
    """Per concurrency: untuned vs tuned (the confirmation runs; the search's when none)."""
    base, won = result.confirmation or (result.baseline, result.winner)
    rows = []
    for point in sorted(base.points, key=lambda p: p.concurrency):
        other = won.point(point.concurrency)
        if other is None:
            continue
        rows.append([str(point.concurrency), f"{point.throughput:.1f}", f"{other.throughput:.1f}",
                     f"{other.throughput / max(point.throughput, 1e-9):.2f}x", f"{point.p50_ms:.1f}",
                     f"{other.p50_ms:.1f}", f"{point.p99_ms:.1f}", f"{other.p99_ms:.1f}"])
    return rows


COMPARISON_HEADER = ["concurrency", "untuned seq/s", "tuned seq/s", "ratio", "untuned p50 ms", "tuned p50 ms",
                     "untuned p99 ms", "tuned p99 ms"]


def markdown(result: SearchResult, record: dict[str, Any]) -> str:
    objective = Objective(record["objective"])
    concurrencies = sorted(record["concurrencies"])
    host = record["host"]
    lines = [f"# Tuning {record['model']}", "",
             f"Repository: `{record['repository']}`  ",
             f"Command: `{record['command']}`  ",
             f"Host: {host.get('cpu_model') or '?'}, {host['cores']} usable cores; {host.get('platform')}  ",
             f"Precision: {record.get('precision', '?')}"
             + (" (chosen by `build --precision auto`)" if record.get("precision_auto") else
                " (asked for by name: `build --precision auto` chooses for a host)") + "  ",
             *([f"**Warning**: {record['precision_warning']}  "] if record.get("precision_warning") else []),
             f"Objective: {objective}" + (f", p99 <= {record['max_p99_ms']:g} ms" if record.get("max_p99_ms") else "")
             + f"; concurrencies {', '.join(map(str, concurrencies))}; inputs: {record['inputs']}  ",
             f"Search: {len(result.trials)} candidates in {record['seconds']:.0f} s "
             f"(budget {record['budget_s']:.0f} s, stopped: {result.stopped_by}); "
             f"tuned models: {', '.join(record['models'])}",
             *(f"`{unit}` sets {', '.join(models)} alike (a checkpoint ensemble's members, run side by side)  "
               for unit, models in (record.get("tuned_together") or {}).items()),
             "", "## Result", ""]
    if result.changed:
        lines.append(f"Written: {describe_candidate(result.winner, result.baseline)}." if record.get("written")
                     else f"Best: {describe_candidate(result.winner, result.baseline)} (not written: --dry-run).")
    else:
        lines.append("No candidate beat the repository's own settings on this host; nothing changed.")
    lines += ["", *_md(COMPARISON_HEADER, comparison_rows(result)), "",
              "Untuned and tuned measured again side by side (interleaved by concurrency) after the search."
              if result.confirmation else "", "", "## Every candidate", ""]
    header = ["#", "changes from the repository's settings", *(f"c{c} seq/s" for c in concurrencies),
              *(f"c{c} p99 ms" for c in concurrencies), "batch", "score", ""]
    rows = []
    for index, trial in enumerate(result.trials, 1):
        status = "baseline" if trial is result.baseline else ("pruned" if trial.pruned else "")
        if trial is result.winner and result.changed:
            status = "**winner**"
        if not trial.feasible(record.get("max_p99_ms")):
            status = (status + " over p99 bound").strip()
        cells = [str(index), describe_candidate(trial, result.baseline)]
        for c in concurrencies:
            point = trial.point(c)
            cells.append(f"{point.throughput:.1f}" if point else "")
        for c in concurrencies:
            point = trial.point(c)
            cells.append(f"{point.p99_ms:.0f}" if point else "")
        batches = [p.server_batch for p in trial.points if p.server_batch]
        cells += [f"{max(batches):.1f}" if batches else "", f"{trial.score(objective):.2f}", status]
        rows.append(cells)
    lines += _md(header, rows)
    lines += ["", "score: geometric mean over the concurrencies of "
              + ("sequences/s" if objective == Objective.THROUGHPUT else "1000 / p99 ms")
              + "; batch: rows per execution of the first tuned model at the highest concurrency measured.",
              "", "![throughput / latency frontier](frontier.png)", ""]
    return "\n".join(lines)


def plot(result: SearchResult, path: Path) -> Path:
    """Throughput against p99 latency of every measured candidate, one panel per concurrency, the
    frontier drawn, the baseline and the winner marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    concurrencies = sorted({p.concurrency for t in result.trials for p in t.points})
    fig, axes = plt.subplots(1, len(concurrencies), figsize=(5.2 * len(concurrencies), 4.2), squeeze=False)
    for ax, concurrency in zip(axes[0], concurrencies):
        measured = [(t, t.point(concurrency)) for t in result.trials]
        pairs = [(p.p99_ms, p.throughput) for _, p in measured if p is not None]
        ax.scatter([x for x, _ in pairs], [y for _, y in pairs], s=18, color="C0", alpha=0.6, label="candidates")
        edge = frontier(pairs)
        ax.plot([x for x, _ in edge], [y for _, y in edge], "-", color="C0", alpha=0.8, label="frontier")
        for trial, marker, color, label in ((result.baseline, "s", "C3", "untuned"),
                                            (result.winner, "*", "C2", "tuned")):
            point = trial.point(concurrency)
            if point is not None:
                ax.scatter([point.p99_ms], [point.throughput], marker=marker, s=140, color=color, label=label,
                           zorder=3)
        ax.set_title(f"concurrency {concurrency}")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("sequences / s")
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(result: SearchResult, record: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """report.md, report.json and frontier.png in `out_dir`."""
    objective, bound = Objective(record["objective"]), record.get("max_p99_ms")
    data = {**record, "trials": [t.to_dict(objective, bound) for t in result.trials],
            "confirmation": [t.to_dict(objective, bound) for t in result.confirmation] if result.confirmation else None}
    paths = {"json": out_dir / "report.json", "markdown": out_dir / "report.md", "png": out_dir / "frontier.png"}
    paths["json"].write_text(json.dumps(data, indent=2) + "\n")
    paths["markdown"].write_text(markdown(result, record))
    plot(result, paths["png"])
    return paths
