"""`bionemo-export bench` end to end: the real perf_analyzer against the tiny ESM-2 repository on the
embedded tritonserver (inputs, statistics and reports without a server: tests/unit/test_bench_inputs.py)."""

from __future__ import annotations

import csv
import json

from typer.testing import CliRunner

from bionemo_export.cli.main import app

# -- length distributions ----------------------------------------------------------------------


# -- files -------------------------------------------------------------------------------------


# -- perf_analyzer input JSON ------------------------------------------------------------------


# -- targets, statistics, report ---------------------------------------------------------------


# -- end to end --------------------------------------------------------------------------------


def test_bench_cli_measures_a_tiny_esm2_repository(esm2_repository, tmp_path):
    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "bench", str(esm2_repository), "--model", "esm2nv_embeddings", "--concurrency", "1,2",
        "--lengths", "uniform:20-120", "--count", "32", "--duration", "1", "--max-trials", "5", "--out", str(out),
    ])
    assert result.exit_code == 0, result.output
    console = "".join(result.output.split())  # rich wraps a long tmp path at the console's width
    assert "sequences/s" in console and "report.md" in console
    for name in ("report.md", "results.json", "plot.png", "perf_A_c1.csv", "perf_A_c2.csv", "input_data_A.json"):
        assert (out / name).is_file(), name
    with open(out / "perf_A_c2.csv", newline="") as handle:
        row = next(csv.DictReader(handle))
    assert row["Concurrency"] == "2" and float(row["Inferences/Second"]) > 0
    document = json.loads((out / "results.json").read_text())
    (target,) = document["targets"]
    assert target["server_version"] == "2.51.0" and document["environment"]["cores"] >= 1
    assert [r["concurrency"] for r in target["results"]] == [1, 2]
    for r in target["results"]:
        assert r["sequences_per_s"] > 0 and r["tokens_per_s"] > r["sequences_per_s"]
        assert 0 < r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert r["batch_model"] == "esm2nv_encoder" and r["server_batch_size"] >= 1.0
        assert {m["name"] for m in r["models"]} >= {"esm2nv_embeddings", "esm2nv_encoder"}
    report = (out / "report.md").read_text()
    assert "esm2nv_embeddings" in report and "perf_analyzer: 2.51.0" in report and "| 2" in report
    print(json.dumps([{k: r[k] for k in ("concurrency", "sequences_per_s", "p50_ms", "server_batch_size")}
                      for r in target["results"]]))
