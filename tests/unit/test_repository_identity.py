"""The `source_sha256` stamp every built model's config carries (serving/parameters.py): what
it is derived from (manifest.source_sha256), and the consistency rule that every model of a
repository carries the one its manifest.json gives. The builds that write it:
tests/export/test_build.py and tests/export/test_ensemble_backends.py."""

from __future__ import annotations

from pathlib import Path

from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.manifest import Manifest, source_sha256
from bionemo_export.model_repository.pbtxt import read_config, write_config
from bionemo_export.model_repository.plan import EnsembleStep, ModelPlan, RepositoryPlan
from bionemo_export.serving.parameters import SOURCE_SHA256
from bionemo_export.tensors import DType, TensorSpec

FIRST, SECOND = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def test_the_stamp_is_a_digest_of_the_checkpoints_in_order_and_the_precision():
    stamp = source_sha256([FIRST], "fp32")
    assert stamp == source_sha256([FIRST], "fp32") and len(stamp) == 64 and int(stamp, 16) >= 0
    assert len({stamp, source_sha256([SECOND], "fp32"), source_sha256([FIRST], "int8"),
                source_sha256([FIRST, SECOND], "fp32"), source_sha256([SECOND, FIRST], "fp32")}) == 5


def _manifest(**fields) -> Manifest:
    return Manifest(**{"name": "t", "family": "esm2", "tasks": ["embeddings"],
                       "tool": {"name": "bionemo-export", "version": "0"},
                       "models": {"t_encoder": {}, "t_embeddings": {}},
                       "checkpoint": {"path": "/ckpt", "digest": FIRST}, **fields})


def test_the_manifest_gives_the_stamp_of_its_checkpoint_or_members():
    assert _manifest().source_sha256 == source_sha256([FIRST], "fp32")
    assert _manifest(precision="int8").source_sha256 == source_sha256([FIRST], "int8")
    members = [{"member": "m1", "digest": FIRST}, {"member": "m2", "digest": SECOND}]
    assert _manifest(members=members).source_sha256 == source_sha256([FIRST, SECOND], "fp32")
    # Nothing to derive it from: a hand-written manifest, or a member recorded without its digest.
    assert _manifest(checkpoint={}).source_sha256 is None
    assert _manifest(members=[members[0], {"member": "m2"}]).source_sha256 is None


def _repository(root: Path, manifest: Manifest, stamp: str | None) -> Path:
    """A two-model repository (a Python model and an ensemble calling it), each config stamped with
    `stamp` (None: not at all), with `manifest` at its root."""
    tensors = ([TensorSpec("x", DType.BYTES, (1,))], [TensorSpec("y", DType.FP32, (-1,))])
    parameters = {SOURCE_SHA256: stamp} if stamp else {}
    plan = RepositoryPlan([
        ModelPlan("t_encoder", *tensors, 8, backend="python", parameters=dict(parameters)),
        ModelPlan("t_embeddings", *tensors, 8, platform="ensemble", parameters=dict(parameters),
                  steps=[EnsembleStep("t_encoder", {"x": "x"}, {"y": "y"})])])
    root.mkdir()
    plan.write(root)
    manifest.write(root)
    return root


def _restamp(folder: Path, stamp: str | None) -> None:
    config = read_config(folder)
    if stamp is None:
        del config.parameters[SOURCE_SHA256]
    else:
        config.parameters[SOURCE_SHA256].string_value = stamp
    write_config(folder, config)


def test_every_model_must_carry_the_stamp_its_manifest_gives(tmp_path):
    stamp = source_sha256([FIRST], "fp32")
    root = _repository(tmp_path / "repo", _manifest(), stamp)
    assert check_repository(root) == []
    # A model folder a user added beside the build's is served, not checked.
    (root / "user_model").mkdir()
    write_config(root / "user_model", ModelPlan("user_model", [], [], 0, backend="python").to_config())
    assert check_repository(root) == []

    other = source_sha256([SECOND], "fp32")  # a config copied from a build of another checkpoint
    _restamp(root / "t_encoder", other)
    assert check_repository(root) == [
        f"t_encoder: {SOURCE_SHA256} {other} is not the {stamp} that manifest.json's checkpoint digests and "
        "precision give: its config comes from another build; build the repository again"]
    _restamp(root / "t_encoder", None)
    assert check_repository(root) == [
        f"t_encoder: no {SOURCE_SHA256} parameter, which the repository's other models carry: build the "
        "repository again"]


def test_a_manifest_without_a_digest_cannot_vouch_for_a_stamp(tmp_path):
    root = _repository(tmp_path / "repo", _manifest(checkpoint={"path": "/ckpt"}), source_sha256([FIRST], "fp32"))
    assert check_repository(root) == [
        f"models carry a {SOURCE_SHA256} parameter, but manifest.json records no checkpoint digest to check it "
        "against: build the repository again with `bionemo-export build repo`"]


def test_a_repository_built_before_the_stamp_is_not_checked_for_it(tmp_path):
    root = _repository(tmp_path / "repo", _manifest(), None)
    assert check_repository(root) == []
    assert _manifest().source_sha256 is not None  # the manifest could vouch; no model claims anything
