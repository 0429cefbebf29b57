"""The checkpoint readers' own pieces, without a model: each reader describes its own form
(manifest.json's `checkpoint_form`), the bounded tar reader (readers/bounded_tar.py) and the bounded
YAML loader (readers/bounded_yaml.py) on what the .nemo tests (test_nemo_hostile.py,
test_nemo_import.py) do not reach."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from bionemo_export.models.readers import (
    READERS,
    Checkpoint,
    CheckpointError,
    CheckpointReader,
    bounded_tar,
    bounded_yaml,
)
from bionemo_export.models.readers.base import describe_checkpoint


# ------------------------------------------------------------------------- each form described
def test_every_reader_describes_its_own_form_and_they_are_tried_in_order():
    assert list(READERS) == ["nemo", "nemo2", "esm_weights", "fair_esm", "huggingface", "nv_esm", "saved"]
    for form, reader in READERS.items():
        assert type(reader).describe is not CheckpointReader.describe, form


def checkpoint(form: str, weights_name: str, model_class: str | None = None, **parallel: int) -> Checkpoint:
    return Checkpoint(path=Path("x"), form=form, config={}, weights={}, weights_name=weights_name,
                      model_class=model_class, parallel=dict(parallel))


@pytest.mark.parametrize(("made", "described"), [
    (checkpoint("huggingface", "model.safetensors", "esm"), "huggingface directory (model.safetensors)"),
    (checkpoint("nemo", "model_weights.ckpt", "x.ESM2nvModel"), ".nemo archive (x.ESM2nvModel)"),
    (checkpoint("nemo", "model_weights.ckpt"), ".nemo archive (no target)"),
    (checkpoint("nemo", "model_weights.ckpt", "x.MegaMolBARTModel", tensor=2, pipeline=1),
     ".nemo archive (x.MegaMolBARTModel, merged from 2 tensor x 1 pipeline parallel ranks)"),
    (checkpoint("nemo2", "weights/", "x.ESM2Config"), "NeMo 2 directory (x.ESM2Config, weights/)"),
    (checkpoint("nemo2", "weights/"), "NeMo 2 directory (no config class, weights/)"),
    (checkpoint("nv_esm", "model.safetensors", "nv_esm"),
     "NVIDIA TransformerEngine ESM-2 directory (nv_esm, model.safetensors)"),
    (checkpoint("saved", "model.safetensors", "megamolbart"), "megamolbart directory (model.safetensors)"),
    (checkpoint("fair_esm", "model", "ESM-1v"), "fair-esm ESM-1v file x"),
    (checkpoint("esm_weights", "x", "ESM C"), "esm package ESM C weights x"),
], ids=lambda value: value.form if isinstance(value, Checkpoint) else "")
def test_a_checkpoint_is_described_by_its_reader(made, described):
    assert describe_checkpoint(made) == described == READERS[made.form].describe(made)


def test_a_directory_is_recognized_and_read_with_its_config_json_parsed_once(tmp_path, monkeypatch):
    """Three readers look at a directory's config.json (saved, nv_esm and Hugging Face forms
    differ by its model_type) and one reads it: `read_checkpoint` parses it once for them all
    (readers/base.CheckpointPath), and the side files once, into `Checkpoint.files`, which the
    families read instead of the folder."""
    import json

    import torch
    from safetensors.torch import save_file

    from bionemo_export.models.readers import base, read_checkpoint

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "esm", "hidden_size": 8}))
    (tmp_path / "vocab.txt").write_text("<cls>\nA\n")
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    parsed: list[str] = []
    original = base.json.loads

    def counting(text, *args, **kwargs):
        parsed.append(text)
        return original(text, *args, **kwargs)

    monkeypatch.setattr(base.json, "loads", counting)
    made = read_checkpoint(tmp_path)
    assert made.form == "huggingface" and made.config["hidden_size"] == 8
    assert len([text for text in parsed if "model_type" in str(text)]) == 1
    assert made.lines("vocab.txt") == ["<cls>", "A"] and made.lines("spiece.model") is None


# ---------------------------------------------------------------------------------- bounded tar
def write_tar(path: Path, members: list[tarfile.TarInfo], contents: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for member in members:
            data = contents.get(member.name)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    return path


def regular(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    member = tarfile.TarInfo(name)
    member.size = len(data)
    return member, data


def test_safe_members_are_regular_files_by_normalized_name(tmp_path):
    folder = tarfile.TarInfo("d")
    folder.type = tarfile.DIRTYPE
    files = dict(regular(name, data) for name, data in (("./d/a.txt", b"alpha"), ("d//b.txt", b"beta")))
    archive = write_tar(tmp_path / "ok.tar", [folder, *files], {m.name: d for m, d in files.items()})
    with bounded_tar.open_archive(archive) as tar:
        members = bounded_tar.safe_members(tar, archive)
        assert sorted(members) == ["d/a.txt", "d/b.txt"]
        assert bounded_tar.read_member(tar, members["d/a.txt"]) == b"alpha"
        assert bounded_tar.read_member(tar, members["d/b.txt"], 2) == b"be"


def test_special_files_and_too_many_members_are_refused(tmp_path, monkeypatch):
    fifo = tarfile.TarInfo("pipe")
    fifo.type = tarfile.FIFOTYPE
    archive = write_tar(tmp_path / "fifo.tar", [fifo], {})
    with bounded_tar.open_archive(archive) as tar, \
            pytest.raises(CheckpointError, match=r"fifo\.tar: member 'pipe' is a special file; refusing the archive$"):
        bounded_tar.safe_members(tar, archive)

    monkeypatch.setattr(bounded_tar, "MAX_MEMBERS", 3)
    files = dict(regular(f"f{i}", b"x") for i in range(4))
    archive = write_tar(tmp_path / "many.tar", list(files), {m.name: d for m, d in files.items()})
    with bounded_tar.open_archive(archive) as tar, \
            pytest.raises(CheckpointError, match=r"many\.tar has more than 3 members; not a \.nemo checkpoint$"):
        bounded_tar.safe_members(tar, archive)


def test_looks_like_tar_answers_for_tar_archives_refused_ones_included(tmp_path):
    member, data = regular("a", b"a")
    assert bounded_tar.looks_like_tar(write_tar(tmp_path / "plain.bin", [member], {"a": data}))
    negative = tarfile.TarInfo("x").tobuf()  # a valid header, then its size field made negative below
    negative = negative[:124] + b"\xff" * 12 + negative[136:]
    checksum = 256 + sum(negative[:148]) + sum(negative[156:])
    (tmp_path / "refused.bin").write_bytes(negative[:148] + b"%06o\0 " % checksum + negative[156:] + bytes(1024))
    with pytest.raises(bounded_tar.RefusedArchive, match="declares a negative size"):
        bounded_tar.open_archive(tmp_path / "refused.bin")
    assert bounded_tar.looks_like_tar(tmp_path / "refused.bin")  # a tar archive all the same
    (tmp_path / "random.bin").write_bytes(b"\x00not a tar" * 100)
    assert not bounded_tar.looks_like_tar(tmp_path / "random.bin")


# --------------------------------------------------------------------------------- bounded YAML
def test_a_config_is_named_as_the_caller_names_it():
    source = "ckpt/context/model.yaml"
    assert bounded_yaml.parse_yaml_mapping(b"config: {num_layers: 2}\n", source) == {"config": {"num_layers": 2}}
    with pytest.raises(CheckpointError, match=r"^ckpt/context/model\.yaml is not a mapping$"):
        bounded_yaml.parse_yaml_mapping(b"- 1\n- 2\n", source)
    with pytest.raises(CheckpointError, match=r"^ckpt/context/model\.yaml is not valid YAML: .*\(line 2, column \d+\)$"
                       ):
        bounded_yaml.parse_yaml_mapping(b"a: [1\nb: 2\n", source)


def test_the_size_limit_is_exactly_max_config_bytes():
    at_limit = b"a: 1\n" + b"#" * (bounded_yaml.MAX_CONFIG_BYTES - 6) + b"\n"
    assert len(at_limit) == bounded_yaml.MAX_CONFIG_BYTES
    assert bounded_yaml.parse_yaml_mapping(at_limit, "x.yaml") == {"a": 1}
    with pytest.raises(CheckpointError, match=r"^x\.yaml is over 1048576 bytes"):
        bounded_yaml.parse_yaml_mapping(at_limit + b"#", "x.yaml")
