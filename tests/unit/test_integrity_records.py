"""A repository's recorded digests without a build or a server: manifests with and without them,
`engines build`'s records, corrupt tokenizer files and config parameters named (a built repository
whose files changed, refused by serve, verify and repo push: tests/e2e/test_integrity.py)."""


from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bionemo_export.model_repository.backends import ENGINE_FILE
from bionemo_export.model_repository.integrity import (
    check_repository_files,
    record_files,
)
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.serving.tokenizers import SmilesTokenizer
from bionemo_export.serving.tokenizers.sentencepiece_vocab import SentencePieceTokenizer


def _without_digests(repository: Path) -> None:
    """Rewrite manifest.json as builds before digests wrote it: no `files`."""
    replace(Manifest.read(repository), files={}).write(repository)


def test_a_manifest_without_digests_writes_no_files_key_and_one_with_them_reads_back(tmp_path):
    manifest = Manifest(name="m", family="esm2", tasks=["embeddings"])
    assert "files" not in manifest.write(tmp_path).to_dict()
    assert Manifest.read(tmp_path).files == {}
    recorded = {"m_encoder/1/model.onnx": {"sha256": "ab" * 32, "bytes": 3}}
    replace(manifest, files=recorded).write(tmp_path)
    assert Manifest.read(tmp_path).files == recorded


def _engine_repository(root: Path) -> tuple[Path, dict[str, Path]]:
    """A --backend tensorrt repository as `engines build` leaves it: model.onnx and engine.json from
    the build (recorded), then model.plan, a rewritten engine.json and the timing cache."""
    version = root / "m_encoder" / "1"
    version.mkdir(parents=True)
    (root / "m_encoder" / "config.pbtxt").write_text('name: "m_encoder"\nplatform: "tensorrt_plan"\n')
    (version / "model.onnx").write_bytes(b"onnx graph")
    (version / ENGINE_FILE).write_text(json.dumps({"onnx": "model.onnx", "plan": "model.plan"}))
    Manifest(tool={"name": "bionemo-export"}, name="m", family="esm2", tasks=["embeddings"],
             files=record_files(root)).write(root)
    (version / "model.plan").write_bytes(b"serialized engine")
    (version / ENGINE_FILE).write_text(json.dumps({"onnx": "model.onnx", "plan": "model.plan",
                                                   "built": {"tensorrt": "10.3", "bytes": 17}}))
    (root / "engines.timing_cache").write_bytes(b"tactics")
    return root, {"m_encoder": version}


def test_engines_build_records_the_plans_and_engine_records_it_wrote(tmp_path):
    from bionemo_export.runtime.engines import recorded_engines

    repository, recipes = _engine_repository(tmp_path / "repo")
    recorded = Manifest.read(repository).files[f"m_encoder/1/{ENGINE_FILE}"]["bytes"]
    assert sorted(check_repository_files(repository)) == [  # what the engine build changed, unrecorded
        f"{repository}/m_encoder/1/{ENGINE_FILE} changed since the build "
        f"({(recipes['m_encoder'] / ENGINE_FILE).stat().st_size} bytes, recorded {recorded})",
        f"{repository}/m_encoder/1/model.plan was not written by the build (Triton loads what is in a model's folder)",
    ]
    recorded_engines(Manifest.read(repository), repository, "10.3", "H100", recipes).write(repository)
    manifest = Manifest.read(repository)
    assert manifest.engines == {"tensorrt": "10.3", "gpu": "H100", "models": {"m_encoder": {"tensorrt": "10.3",
                                                                                            "bytes": 17}}}
    assert sorted(manifest.files) == ["m_encoder/1/engine.json", "m_encoder/1/model.onnx", "m_encoder/1/model.plan",
                                      "m_encoder/config.pbtxt"]  # not the timing cache: generated state
    assert manifest.files["m_encoder/1/model.plan"]["sha256"] == hashlib.sha256(b"serialized engine").hexdigest()
    assert check_repository_files(repository) == []


def test_engines_build_keeps_the_build_s_other_digests_and_adds_none_where_none_were(tmp_path):
    from bionemo_export.runtime.engines import recorded_engines

    repository, recipes = _engine_repository(tmp_path / "repo")
    (recipes["m_encoder"] / "model.onnx").write_bytes(b"changed graph")  # before the engine build
    recorded_engines(Manifest.read(repository), repository, "10.3", "H100", recipes).write(repository)
    assert check_repository_files(repository) == [
        f"{repository}/m_encoder/1/model.onnx changed since the build (13 bytes, recorded 10)"]
    _without_digests(repository)
    recorded_engines(Manifest.read(repository), repository, "10.3", "H100", recipes).write(repository)
    assert Manifest.read(repository).files == {}


def _smiles(folder: Path) -> Path:
    SmilesTokenizer(["<PAD>", "?", "^", "&", "<MASK>", "<SEP>", "C", "O"], max_length=16).save_json(
        folder / "tokenizer.json")
    return folder / "tokenizer.json"


def _sentencepiece(folder: Path) -> Path:
    SentencePieceTokenizer(["<pad>", "</s>", "<unk>", "A", "C"], residues="AC", pad_token="<pad>", bos_token=None,
                           eos_token="</s>", unk_token="<unk>", max_length=16).save_json(folder / "tokenizer.json")
    return folder / "tokenizer.json"


@pytest.mark.parametrize("write, cls", [(_smiles, SmilesTokenizer), (_sentencepiece, SentencePieceTokenizer)])
def test_the_other_tokenizers_name_a_corrupt_file_too(tmp_path, write, cls):
    path = write(tmp_path)
    assert cls.from_json(path).to_dict() == json.loads(path.read_text())
    settings = json.loads(path.read_text())
    settings["max_length"] = "many"
    path.write_text(json.dumps(settings))
    with pytest.raises(ValueError, match=f"^{path} is not a valid tokenizer file \\("):
        cls.from_json(path)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(ValueError, match=f"^{path} is not a valid tokenizer file \\(.*char"):
        cls.from_json(path)


def test_config_parameters_that_are_not_numbers_are_named_with_their_config_file():
    """The generated model's parameter reader (serving/parameters.py, copied beside model.py)."""
    from bionemo_export.serving.parameters import model_parameters, number_parameter

    args = {"model_name": "m_encoder", "model_repository": "/models/m_encoder",
            "model_config": json.dumps({"parameters": {"length_bucket": {"string_value": "16x"},
                                                       "max_hidden_magnitude": {"string_value": "1e4"}}})}
    parameters = model_parameters(args)
    assert number_parameter(args, parameters, "max_hidden_magnitude", kind=float) == 1e4
    assert number_parameter(args, parameters, "token_budget", "0") == 0
    with pytest.raises(ValueError, match="^/models/m_encoder/config.pbtxt: parameter length_bucket is '16x', "
                                         "not an integer; correct it, or rebuild the repository$"):
        number_parameter(args, parameters, "length_bucket", "0")
