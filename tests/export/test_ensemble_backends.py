"""Checkpoint ensembles for the backends that cannot load here (native: Triton's onnxruntime
backend; tensorrt): built from two tiny random ESM-2 members, checked by the consistency rules a
build applies (model_repository/consistency.py) and read back from config.pbtxt: one tokenizer
shared by the members, each member's graphs on the backend's platform, the mean in Python. And an
int8 ensemble, whose manifest records each member's accuracy cost and whose configs name every
member's checkpoint."""

from __future__ import annotations

import pytest

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.choices import Precision
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.manifest import checkpoint_digest, source_sha256
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.serving.parameters import SOURCE_SHA256
from bionemo_export.testing.checkpoints import save_random_checkpoint

PLATFORMS = {"native": "onnxruntime_onnx", "tensorrt": "tensorrt_plan"}


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    folder = tmp_path_factory.mktemp("members")
    # the run's seed-0 ESM-2 and test_e2e_ensemble's second member: graphs the run exports anyway
    return [save_random_checkpoint("esm2", folder / f"m{seed}", seed=seed) for seed in (0, 41)]


@pytest.mark.parametrize("backend", ["native", "tensorrt"])
def test_an_ensemble_for_tritons_own_platforms_is_consistent(members, tmp_path, backend):
    out = tmp_path / "repo"
    result = build_repository(BuildRequest(family="esm2", checkpoint=members[0], members=(members[1],), name="ens",
                                           out=out, backend=backend, optimize=False))
    assert check_repository(out) == []
    assert result.models == ["ens_tokenizer", "ens_m1_encoder", "ens_m1_lm_head", "ens_m2_encoder", "ens_m2_lm_head",
                             "ens_member_mean", "ens_logits", "ens_scores"]
    for member in ("m1", "m2"):
        for graph in ("encoder", "lm_head"):
            assert read_config(out / f"ens_{member}_{graph}").platform == PLATFORMS[backend]
    assert read_config(out / "ens_member_mean").backend == "python"
    logits = read_config(out / "ens_logits")
    steps = [step.model_name for step in logits.ensemble_scheduling.step]
    assert steps == ["ens_tokenizer", "ens_m1_encoder", "ens_m1_lm_head", "ens_m2_encoder", "ens_m2_lm_head",
                     "ens_member_mean"]
    assert [list(output.dims) for output in logits.output] == [[-1, 25], [-1], [2, -1, 25]]


def test_an_int8_ensemble_records_each_members_accuracy_cost(members, tmp_path):
    result = build_repository(BuildRequest(family="esm2", checkpoint=members[0], members=(members[1],), name="ens",
                                           out=tmp_path / "repo", backend="python", precision=Precision.INT8,
                                           optimize=False))
    records = result.manifest.members or []
    assert [record["member"] for record in records] == ["m1", "m2"]
    assert all(record["accuracy"]["precision"] == "int8" for record in records)
    assert records[0]["accuracy"] == result.manifest.accuracy  # the top level is member 1's
    assert records[0]["accuracy"] != records[1]["accuracy"]  # each measured on its own graphs
    # Every model, members' and ensembles' alike, names both checkpoints in order and the precision.
    stamp = source_sha256([checkpoint_digest(member) for member in members], "int8")
    assert {read_config(result.repository / name).parameters[SOURCE_SHA256].string_value
            for name in result.models} == {stamp} == {result.manifest.source_sha256}
