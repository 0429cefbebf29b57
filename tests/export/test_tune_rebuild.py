"""`tune --precision` (tune/rebuild.py): the repository built again from the checkpoint its manifest
names, in another precision or the one `auto` chooses here, keeping its tasks and serving options;
refused, leaving the repository as it was, when the checkpoint changed or is gone. One real tiny
ESM-2; the command line runs the rebuild and then a short real tune on the embedded tritonserver."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.options import GenerationLimits, RoleOptions, ServingOptions
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.tune.rebuild import RebuildError, rebuild, rebuild_request, serving_options


def test_serving_options_come_back_from_the_manifest_as_built(tmp_path):
    options = ServingOptions(max_batch_size=8, length_bucket=32, token_budget=4096, queue_timeout_s=0.0,
                             encoder_instances=2, limits=GenerationLimits(max_num_samples=4))
    recorded = json.loads(json.dumps(dataclasses.asdict(options)))  # as manifest.json holds it
    assert serving_options(recorded, tmp_path / "manifest.json") == options
    with_roles = dataclasses.asdict(dataclasses.replace(options, roles={"encoder": RoleOptions(instances=3)}))
    with pytest.raises(RebuildError, match=r"per-role serving options \(encoder\)"):
        serving_options(with_roles, tmp_path / "manifest.json")


def test_tune_precision_builds_the_repository_again_and_then_tunes_it(tmp_path):
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint")
    repo = tmp_path / "repo"
    build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm", out=repo, backend="python",
                                  tasks=("embeddings",), serving=ServingOptions(length_bucket=32)))
    request = rebuild_request(repo, "int8")
    assert (request.family, request.name, request.tasks, request.backend, request.precision, request.force) == (
        "esm2", "esm", ("embeddings",), "python", "int8", True)
    assert request.serving.length_bucket == 32 and request.checkpoint == checkpoint.resolve()

    manifest = rebuild(repo, "int8")
    assert manifest.precision == "int8" and manifest.serving["length_bucket"] == 32
    assert manifest.tasks == ["embeddings"] and check_repository(repo) == []

    refused = CliRunner().invoke(app, ["tune", str(repo), "--precision", "fp32", "--dry-run"])
    assert refused.exit_code != 0 and "does not go with --dry-run" in refused.output

    result = CliRunner().invoke(app, ["tune", str(repo), "--precision", "auto", "--budget-minutes", "0.3",
                                      "--window", "0.3", "--concurrency", "2", "--report", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    rebuilt = Manifest.read(repo)
    assert rebuilt.precision_choice is not None and rebuilt.precision in ("int8", "fp32")
    assert f"Rebuilt in {rebuilt.precision} (" in result.output
    report = (tmp_path / "report" / "report.md").read_text()
    assert f"Precision: {rebuilt.precision} (chosen by `build --precision auto`)" in report

    before = {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()}
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b" ")  # another checkpoint under the same path
    with pytest.raises(RebuildError, match="changed since .* was built from it"):
        rebuild(repo, "fp32")
    shutil.rmtree(checkpoint)
    with pytest.raises(RebuildError, match="is not on this host"):
        rebuild(repo, "fp32")
    assert {p: p.read_bytes() for p in repo.rglob("*") if p.is_file()} == before
