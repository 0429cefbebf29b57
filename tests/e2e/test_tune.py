"""`bionemo-export tune` against a built repository: the settings in its configs, the atomic write
and restore, the serve warning, and one end-to-end tune of a tiny ESM-2 repository with the real
tritonserver and perf_analyzer (the settings space and the search: tests/unit/test_tune_search.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.cli.serve import warn_if_tuned_elsewhere
from bionemo_export.model_repository.integrity import check_files
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.serving.host import cpu_description
from bionemo_export.tune import RestoreError, restore, tunable_models
from bionemo_export.tune.apply import publish
from bionemo_export.tune.record import host_mismatch, precision_mismatch
from bionemo_export.tune.space import Settings, read_settings, write_settings


def copy_of(repo: Path, tmp_path: Path) -> Path:
    target = tmp_path / "repo"
    shutil.copytree(repo, target)
    return target


# ------------------------------------------------------------------------------------------ space
def test_settings_round_trip_through_the_encoder_config(esm2_repository):
    config = read_config(esm2_repository / "esm2nv_encoder")
    settings = read_settings(config)
    assert settings == Settings(instances=1, queue_delay_us=0, threads=0, token_budget=8192, max_sub_batch=0,
                                length_bucket=16, memory_arena=1)  # memory_arena "run"
    changed = Settings(instances=2, queue_delay_us=500, threads=1, token_budget=4096, max_sub_batch=4,
                       length_bucket=32, memory_arena=0)
    written = write_settings(config, changed)
    assert read_settings(written) == changed
    assert written.parameters["intra_op_threads"].string_value == "1"
    assert written.parameters["memory_arena"].string_value == "false"
    assert read_settings(write_settings(config, settings)) == settings
    assert write_settings(config, settings).parameters["intra_op_threads"].string_value == "auto"
    assert read_settings(config) == settings  # the original is not modified


def test_tunable_models_are_the_batched_graph_models_behind_a_public_model(esm2_repository):
    assert tunable_models(esm2_repository, "esm2nv_embeddings") == ["esm2nv_encoder"]
    # scores calls N_logits through BLS: its graph models are tuned, the BLS caller is not
    assert tunable_models(esm2_repository, "esm2nv_scores") == ["esm2nv_encoder", "esm2nv_lm_head"]


# ---------------------------------------------------------------------------------- write, restore
def test_publish_is_all_or_nothing(esm2_repository, tmp_path):
    repo = copy_of(esm2_repository, tmp_path)
    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    with pytest.raises(OSError):  # a model folder the repository lacks: the write fails in the stage
        publish(repo, {"esm2nv_encoder": "max_batch_size: 3\n", "no_such_model": "x"}, {"host": {"cores": 2}})
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["repo"]  # no staging folder left behind
    with pytest.raises(RestoreError, match="records no tuning"):
        restore(repo)


def test_serve_warns_when_the_repository_was_tuned_on_another_core_count(esm2_repository, tmp_path):
    repo = copy_of(esm2_repository, tmp_path)
    manifest = Manifest.read(repo)
    assert host_mismatch(manifest) is None  # never tuned
    tuned = Manifest.from_dict({**manifest.to_dict(), "tuning": {"host": {"cores": 64}, "tuned": "2026-11-01"}})
    assert host_mismatch(tuned, cores=64) is None
    assert "tuned on a host with 64 cores" in (host_mismatch(tuned, cores=2) or "")
    tuned.write(repo)
    console = Console(record=True, width=200)
    warn_if_tuned_elsewhere(repo, console)
    assert "tuned on a host with 64 cores" in console.export_text()



def test_serve_and_tune_warn_when_auto_chose_the_precision_on_another_kind_of_cpu(esm2_repository, tmp_path):
    """manifest.json's `precision_choice` (build --precision auto) names the CPU that chose; a host
    with other instruction-set features or int8 dot products is told to choose again."""
    repo = copy_of(esm2_repository, tmp_path)
    manifest = Manifest.read(repo)
    assert precision_mismatch(manifest) is None  # precision asked for by name
    zen = {"model": "AMD EPYC", "features": ["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"], "vnni": True}
    chosen = Manifest.from_dict({**manifest.to_dict(), "precision": "int8",
                                 "precision_choice": {"asked": "auto", "chosen": "int8", "host": zen}})
    assert precision_mismatch(chosen, cpu={**zen, "model": "another EPYC"}) is None  # same features
    haswell = {"model": "Intel Haswell", "features": ["avx2", "fma"], "vnni": False}
    warning = precision_mismatch(chosen, cpu=haswell) or ""
    assert "chose int8 for this repository on AMD EPYC [avx2 fma avx512f avx512bw avx512_vnni" in warning
    assert "this host is Intel Haswell [avx2 fma; int8 dot products: no VNNI" in warning
    assert warning.endswith("with --precision auto to choose for this host")
    here = cpu_description()
    elsewhere = haswell if here["vnni"] else zen
    Manifest.from_dict({**chosen.to_dict(), "precision_choice": {"host": elsewhere}}).write(repo)
    console = Console(record=True, width=400)
    warn_if_tuned_elsewhere(repo, console)
    assert "`build --precision auto` chose int8" in console.export_text()


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_tune_writes_the_winner_reports_it_and_restores_the_previous_settings(esm2_repository, tmp_path):
    repo = copy_of(esm2_repository, tmp_path)
    original = (repo / "esm2nv_encoder" / "config.pbtxt").read_bytes()
    report = tmp_path / "report"
    result = CliRunner().invoke(app, ["tune", str(repo), "--budget-minutes", "0.8", "--window", "0.5",
                                      "--concurrency", "2,8", "--lengths", "uniform:20-60", "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert "untuned vs tuned" in result.output
    data = json.loads((report / "report.json").read_text())
    assert (report / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Every candidate" in (report / "report.md").read_text()
    assert data["trials"][0]["role"] == "baseline"
    if len(data["trials"]) == 1:
        # A loaded host (the suite runs on two workers) can make the baseline alone so slow that no
        # candidate plus the two confirmation runs fits the budget (three times the baseline's time
        # left after it, give or take the seconds before it began): then tune must say so.
        baseline_s = data["trials"][0]["seconds"]
        assert data["stopped_by"] == "budget" and 4 * baseline_s + 5 > data["budget_s"], data
    assert all(t["points"] for t in data["trials"])
    manifest = Manifest.read(repo)
    assert not check_files(repo).problems  # digests of the rewritten configs recorded
    # Whether a winner is written depends on this host's figures; that tune writes exactly when its
    # confirmation says the winner still wins (and writes that winner) does not.
    if data["confirmation"] is None:  # no candidate beat the baseline during the search
        assert not data["written"] and data["settings"] == data["untuned_settings"]
    else:
        confirmed_baseline, confirmed_winner = data["confirmation"]
        assert [t["role"] for t in data["confirmation"]] == ["confirm-baseline", "confirm-winner"]
        assert data["written"] == (confirmed_winner["score"] >= confirmed_baseline["score"])
        assert data["settings"] == (confirmed_winner if data["written"] else confirmed_baseline)["settings"]
    if data["written"]:
        assert manifest.tuning is not None and manifest.tuning["host"]["cores"] >= 1
        served = read_settings(read_config(repo / "esm2nv_encoder"))
        assert served.values() == manifest.tuning["settings"]["esm2nv_encoder"]
        assert manifest.tuning["previous"]["esm2nv_encoder"].encode() == original
        assert not (tmp_path / "report" / "work").exists()
        result = CliRunner().invoke(app, ["tune", str(repo), "--restore"])
        assert result.exit_code == 0, result.output
        assert (repo / "esm2nv_encoder" / "config.pbtxt").read_bytes() == original
        assert Manifest.read(repo).tuning is None and not check_files(repo).problems
    else:  # nothing beat the built settings on this (noisy) host: nothing may have changed
        assert manifest.tuning is None
        assert (repo / "esm2nv_encoder" / "config.pbtxt").read_bytes() == original
