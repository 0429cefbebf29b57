"""manifest.json through `Manifest`: the file round-trips unchanged, older repositories still read,
and a broken or foreign file is refused with a message naming it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bionemo_export.model_repository.manifest import MANIFEST_NAME, Manifest, ManifestError

# A manifest as the first builds wrote it: no device, exporter, max_decode_length, accuracy, engines.
OLDER = {
    "created": "2026-01-02T03:04:05+00:00",
    "tool": {"name": "bionemo-export", "version": "0.1.0"},
    "name": "esm2nv",
    "family": "esm2",
    "tasks": ["embeddings", "hiddens"],
    "public_models": ["esm2nv_embeddings", "esm2nv_hiddens"],
    "models": {"esm2nv_encoder": {"kind": "onnx"}},
    "checkpoint": {"path": "/ckpt", "digest": "sha256:00"},
    "precision": "fp32",
    "backend": "python",
    "export": {"encoder": {"opset": 17}},
    "serving": {"max_batch_size": 8},
    "max_length": 64,
    "verification": {"passed": True, "graphs": {}},
    "versions": {"python": "3.11.7"},
}


def _built() -> Manifest:
    return Manifest(tool={"name": "bionemo-export", "version": "0.2.0"}, name="m", family="prott5",
                    tasks=["embeddings", "decodes"], public_models=["m_embeddings", "m_decodes"],
                    models={"m_encoder": {"kind": "onnx"}}, checkpoint={"digest": "sha256:ab"}, precision="int8",
                    backend="native", device="gpu", exporter="navigator", export={"encoder": {}},
                    serving={"max_batch_size": 4}, max_length=32, max_decode_length=16,
                    verification={"passed": True}, accuracy={"outputs": {}}, versions={"numpy": "1.26.4"})


def test_write_then_read_gives_the_same_manifest_and_stamps_created_once(tmp_path):
    written = _built().write(tmp_path)
    assert written.created and written == replace(_built(), created=written.created)
    assert Manifest.read(tmp_path) == written
    again = replace(Manifest.read(tmp_path), engines={"tensorrt": "10.3"}).write(tmp_path)
    assert again.created == written.created and Manifest.read(tmp_path).engines == {"tensorrt": "10.3"}


def test_the_file_keeps_the_build_s_keys_and_order(tmp_path):
    _built().write(tmp_path)
    data = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert list(data) == ["created", "tool", "name", "family", "tasks", "public_models", "models", "checkpoint",
                          "precision", "backend", "device", "exporter", "export", "serving", "max_length",
                          "max_decode_length", "verification", "accuracy", "versions"]  # no engines: none built
    assert data["serving"] == {"max_batch_size": 4} and data["max_decode_length"] == 16


def test_an_older_manifest_reads_with_defaults_and_rewrites_unchanged(tmp_path):
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({**OLDER, "later_key": {"x": 1}}))
    manifest = Manifest.read(tmp_path)
    assert manifest.device == "cpu" and manifest.engines is None and manifest.exporter == "torch"
    assert manifest.max_decode_length is None and manifest.accuracy == {}
    assert manifest.built_by_bionemo_export and manifest.created == OLDER["created"]
    manifest.write(tmp_path)  # an unknown key (a newer build's) survives a rewrite
    assert json.loads((tmp_path / MANIFEST_NAME).read_text())["later_key"] == {"x": 1}


def test_a_missing_manifest_says_how_to_make_one(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no manifest.json: was it built by"):
        Manifest.read(tmp_path)


@pytest.mark.parametrize("text, message", [
    ("{\"name\": ", "is not valid JSON"),
    ("[1, 2]", "is not a JSON object"),
    ("{\"apiVersion\": \"v1\", \"name\": \"x\"}", "has no family, tasks: not written by `bionemo-export build repo`"),
])
def test_a_broken_or_foreign_file_is_refused_naming_it(tmp_path, text, message):
    (tmp_path / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError) as raised:
        Manifest.read(tmp_path)
    assert str(raised.value).startswith(f"{tmp_path / MANIFEST_NAME} {message}")
