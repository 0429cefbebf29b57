"""`build repo`: what lands on disk, atomicity, --force, --backend, and the CLI around it."""

from __future__ import annotations

import json
import logging
import multiprocessing

import onnx
import pytest
from typer.testing import CliRunner

from bionemo_export.build import BuildError, BuildRequest, build_repository, resolve_backend
from bionemo_export.cli.main import app
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.model_repository.hosted_graphs import SHARED_WEIGHTS
from bionemo_export.model_repository.manifest import Manifest, checkpoint_digest, source_sha256
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.serving.parameters import SOURCE_SHA256
from bionemo_export.testing.checkpoints import save_random_checkpoint

runner = CliRunner()


def _request(checkpoint, out, **kwargs) -> BuildRequest:
    """The tiny ESM-2's build without graph optimization (what is tested here is not optimization:
    tests/export/test_optimize.py)."""
    return BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2nv", out=out, **{"optimize": False, **kwargs})


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_native_build_writes_onnxruntime_configs_that_reference_the_graph(esm2_checkpoint, tmp_path):
    out = tmp_path / "repo"
    result = build_repository(_request(esm2_checkpoint, out, backend="native",
                                       serving=ServingOptions(max_batch_size=16)))
    assert _leftovers(tmp_path) == ["repo"]
    # A random ESM-2 is an EsmForMaskedLM: its head is served too (N_lm_head, N_logits, N_scores).
    assert sorted(p.name for p in out.iterdir()) == [
        "esm2nv_embeddings", "esm2nv_encoder", "esm2nv_hiddens", "esm2nv_lm_head", "esm2nv_logits", "esm2nv_scores",
        "esm2nv_tokenizer", "manifest.json"]
    assert read_config(out / "esm2nv_lm_head").platform == "onnxruntime_onnx"
    encoder = read_config(out / "esm2nv_encoder")
    assert encoder.platform == "onnxruntime_onnx"
    graph = onnx.load(out / "esm2nv_encoder" / "1" / encoder.default_model_filename)
    assert [i.name for i in graph.graph.input] == [i.name for i in encoder.input]
    assert [o.name for o in graph.graph.output] == [o.name for o in encoder.output]
    for model in ("esm2nv_tokenizer", "esm2nv_embeddings", "esm2nv_hiddens"):
        assert read_config(out / model).max_batch_size == 16
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "native"
    assert manifest["checkpoint"]["digest"].startswith("sha256:")
    assert manifest["verification"]["passed"]
    assert manifest["versions"]["onnxruntime"]
    assert result.models[-1] == "esm2nv_scores"


def _configs(repository) -> dict[str, bytes]:
    return {folder.name: (folder / "config.pbtxt").read_bytes()
            for folder in sorted(repository.iterdir()) if (folder / "config.pbtxt").is_file()}


def _stamps(repository) -> set[str]:
    return {read_config(repository / name).parameters[SOURCE_SHA256].string_value for name in _configs(repository)}


def test_every_config_names_the_checkpoint_and_a_rebuild_writes_the_same_bytes(esm2_checkpoint, esm2_repository,
                                                                                 tmp_path):
    """The configs are what a client sees of a repository (a bulk job's fingerprint hashes them):
    they carry the checkpoint's digest, the same for the same checkpoint, another for another one."""
    stamp = source_sha256([checkpoint_digest(esm2_checkpoint)], "fp32")
    assert _stamps(esm2_repository) == {stamp} == {Manifest.read(esm2_repository).source_sha256}
    # esm2_repository's own request again (graphs from the run's cache): every config byte for byte
    again = build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm2nv",
                                          out=tmp_path / "again", backend="python", optimize=False))
    assert _configs(again.repository) == _configs(esm2_repository)

    # Another checkpoint of the same architecture (test_ensemble_backends' second member: cached
    # graphs in a full run) under the same name: nothing in the encoder's config but the stamp and
    # the digest of the weights file its graphs share (other weights) differs.
    other = save_random_checkpoint("esm2", tmp_path / "other", seed=41)
    rebuilt = build_repository(_request(other, tmp_path / "rebuilt", backend="python"))
    assert _stamps(rebuilt.repository) == {source_sha256([checkpoint_digest(other)], "fp32")} != {stamp}
    encoders = [read_config(repository / "esm2nv_encoder") for repository in (esm2_repository, rebuilt.repository)]
    assert encoders[0].parameters[SHARED_WEIGHTS] != encoders[1].parameters[SHARED_WEIGHTS]
    for config in encoders:
        del config.parameters[SOURCE_SHA256]
        del config.parameters[SHARED_WEIGHTS]
    assert encoders[0] == encoders[1]


def test_an_existing_repository_needs_force_and_is_replaced_whole(esm2_checkpoint, tmp_path):
    out = tmp_path / "repo"
    out.mkdir()
    (out / "user-file.txt").write_text("keep me")
    with pytest.raises(BuildError, match="already exists; pass `force`"):
        build_repository(_request(esm2_checkpoint, out))
    assert (out / "user-file.txt").read_text() == "keep me"
    build_repository(_request(esm2_checkpoint, out, force=True, tasks=("embeddings",)))
    assert not (out / "user-file.txt").exists()
    assert not (out / "esm2nv_hiddens").exists() and (out / "esm2nv_embeddings").is_dir()
    assert _leftovers(tmp_path) == ["repo"]


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    broken = tmp_path / "broken-checkpoint"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(BuildError, match="cannot load"):
        build_repository(_request(broken, tmp_path / "repo"))
    assert _leftovers(tmp_path) == ["broken-checkpoint"]


def test_a_failed_export_check_leaves_nothing_behind(esm2_checkpoint, tmp_path, monkeypatch):
    from bionemo_export.models.esm2 import Esm2Family

    # An impossible tolerance: the real verification must fail the build.
    monkeypatch.setattr(Esm2Family, "atol", 0.0)
    monkeypatch.setattr(Esm2Family, "min_cosine", 1.01)
    from bionemo_export.exporters import ExportVerificationError

    with pytest.raises(ExportVerificationError):  # without the run's graph cache: a graph failing its check is
        # evicted from the cache (tests/export/test_graph_cache.py), and every later build would export it again
        build_repository(_request(esm2_checkpoint, tmp_path / "repo", graph_cache=None))
    assert _leftovers(tmp_path) == []


def test_unknown_tasks_and_families_are_named(esm2_checkpoint, tmp_path):
    with pytest.raises(BuildError, match="not decodes"):
        build_repository(_request(esm2_checkpoint, tmp_path / "repo", tasks=("decodes",)))
    with pytest.raises(ValueError, match="known families: .*esm2"):
        build_repository(BuildRequest(family="nope", checkpoint=esm2_checkpoint, name="x", out=tmp_path / "r"))


def test_auto_backend_follows_the_servers_backends():
    # The embedded server has only the python backend.
    assert resolve_backend("auto") == "python"
    assert resolve_backend("native") == "native"


def test_cli_build_through_model_navigator_reports_the_export_check(esm2_checkpoint, tmp_path, capfd, monkeypatch):
    """The suite's one Model Navigator export (about 40 s of CPU each): `--exporter navigator` end to
    end, with its graph re-saved in our weights layout (external data forced), Navigator's console
    and logging kept out of the user's, and the graph checked against PyTorch like any other."""
    from bionemo_export.exporters import onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)  # the re-save's external-data path
    root_handlers = logging.getLogger().handlers[:]
    start_method = multiprocessing.get_start_method(allow_none=True)
    out = tmp_path / "repo"
    capfd.readouterr()
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(esm2_checkpoint),
                                 "--name", "esm2nv", "--out", str(out), "--max-batch-size", "4",
                                 "--tasks", "embeddings",  # one graph
                                 "--exporter", "navigator", "--no-optimize", "--graph-cache", str(tmp_path / "graphs")],
                           env={"COLUMNS": "200"})
    console = capfd.readouterr()  # what reached the process's own stdout/stderr, beside the CLI's output
    assert result.exit_code == 0, result.output
    assert console.out == "" and console.err == "", console
    assert logging.getLogger().handlers == root_handlers
    assert multiprocessing.get_start_method(allow_none=True) == start_method
    assert "navigator exporter" in result.output and "encoder" in result.output
    assert "max abs error" in result.output and "esm2nv_embeddings" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["exporter"] == "navigator"
    export = manifest["export"]["encoder"]
    assert export["exporter"] == "navigator" and "model_navigator" in export["versions"] and export["external_data"]
    graph = out / "esm2nv_encoder" / "1" / "model.onnx"
    assert sorted(p.name for p in graph.parent.iterdir() if p.name.startswith("model.onnx")) == [
        "model.onnx", "model.onnx.data"]
    assert (graph.parent / "model.onnx.data").stat().st_mode == graph.stat().st_mode
    check = manifest["verification"]["graphs"]["encoder"]
    assert check["passed"] and max(output["max_abs_error"] for output in check["outputs"]) <= 1e-5, check
    # --graph-cache: every graph stored in the folder given, as Model Navigator exported it
    stored = [json.loads(p.read_text())["export"] for p in (tmp_path / "graphs").glob("??/*/export.json")]
    assert len(stored) == len(manifest["export"]) and {e["exporter"] for e in stored} == {"navigator"}
    again = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(esm2_checkpoint),
                                "--name", "esm2nv", "--out", str(out)], env={"COLUMNS": "200"})
    assert again.exit_code == 1 and "--force" in again.output
