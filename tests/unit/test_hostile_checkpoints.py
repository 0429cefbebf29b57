"""Every checkpoint form x every torch file its reader opens x every kind of hostile file
(tests/helpers/hostile_files.py): a legacy torch file and a plain pickle stream calling os.system,
a torch zip calling os.system, a TorchScript archive whose loading creates a file, BUILD setting an
attribute on a function and on a class, a storage claiming terabytes (zip and legacy). Each is
refused with a CheckpointError naming the file, no code runs (the marker file never appears),
nothing of torch is changed, and a legitimate checkpoint of the same form reads in the same
process afterwards. NeMo 2's `.metadata` (a plain pickle, read by its own unpickler) has its own
hostile kinds. A few go through `bionemo-export inspect` as a user would run it.
"""

from __future__ import annotations

import argparse
import collections
import io
import json
import pickle
import shutil
import struct
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch._utils
import torch.distributed.checkpoint.metadata as dcp_metadata
import torch.serialization
from typer.testing import CliRunner

from bionemo_export.cli.main import app
from bionemo_export.models.readers import CheckpointError, read_checkpoint
from bionemo_export.models.readers.torch_files import open_torch_file
from tests.helpers import hostile_files as hostile
from tests.helpers.nemo2_checkpoints import write_nemo2


def saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


WEIGHTS = saved({"w": torch.zeros(2)})
ESMC_MARKERS = ("embed.weight", "transformer.blocks.0.attn.layernorm_qkv.1.weight")


# --------------------------------------------------------------------------- the forms
@dataclass(frozen=True)
class Form:
    """A checkpoint form: `write(folder, files)` writes a legitimate checkpoint of it into `folder`
    with `files` ({slot: bytes}) in place of the torch files it would hold, and returns the path a
    user names and where each slot's file is, as the reader names it."""

    name: str
    slots: tuple[str, ...]
    write: Callable[[Path, dict[str, bytes]], tuple[Path, dict[str, str]]]


def fair_esm(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    model = folder / "esm2_t1_tiny.pt"
    regression = folder / "esm2_t1_tiny-contact-regression.pt"
    model.write_bytes(files.get("model file") or saved({
        "model": {"encoder.sentence_encoder.embed_tokens.weight": torch.zeros(33, 8)},
        "cfg": {"model": argparse.Namespace(encoder_layers=1, encoder_embed_dim=8, encoder_attention_heads=2)}}))
    regression.write_bytes(files.get("contact regression") or saved(
        {"model": {"contact_head.regression.weight": torch.zeros(1, 2)}}))
    return model, {"model file": str(model), "contact regression": str(regression)}


def folder_form(config: dict, weights_name: str = "pytorch_model.bin", side: dict[str, str] | None = None,
                weights: bytes = WEIGHTS) -> Callable[[Path, dict[str, bytes]], tuple[Path, dict[str, str]]]:
    """A Hugging Face-style folder: config.json, one torch weights file, side files."""

    def write(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
        (folder / "config.json").write_text(json.dumps(config))
        for name, content in (side or {}).items():
            (folder / name).write_text(content)
        (folder / weights_name).write_bytes(files.get(weights_name) or weights)
        return folder, {weights_name: str(folder / weights_name)}

    return write


def sharded(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    (folder / "config.json").write_text(json.dumps({"model_type": "esm"}))
    shards = {"pytorch_model-1.bin": saved({"a": torch.zeros(2)}), "pytorch_model-2.bin": saved({"b": torch.ones(2)})}
    for name, content in shards.items():
        (folder / name).write_bytes(files.get(name) or content)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"a": "pytorch_model-1.bin", "b": "pytorch_model-2.bin"}}))
    return folder, {name: str(folder / name) for name in shards}


def esmc_pth(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
    path = folder / "esmc_300m_2024_12_v0.pth"
    path.write_bytes(files.get("weights") or saved({key: torch.zeros(2) for key in ESMC_MARKERS}))
    return path, {"weights": str(path)}


def nemo_archive(members: dict[str, bytes], *, gzip: bool = False):
    """A .nemo holding model_config.yaml and `members` (torch files by member name)."""

    def write(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
        path = folder / "model.nemo"
        config = b"target: x.ESM2nvModel\n" + (b"tensor_model_parallel_size: 2\n" if len(members) > 1 else b"")
        contents = {"model_config.yaml": config, **{name: files.get(name) or data for name, data in members.items()}}
        with tarfile.open(path, "w:gz" if gzip else "w") as tar:
            for name, data in contents.items():
                info = tarfile.TarInfo(f"./{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return path, {name: f"{path}:{name}" for name in members}

    return write


NEMO2_RECORD = "__9_0.distcp"


@pytest.fixture(scope="module")
def nemo2_source(tmp_path_factory) -> Path:
    """A legitimate NeMo 2 directory (torch_dist weights with TransformerEngine _extra_state entries)."""
    return write_nemo2(tmp_path_factory.mktemp("nemo2") / "checkpoint", {"config": {"num_layers": 1}},
                       {"module.embedding.word_embeddings.weight": torch.arange(8.0).reshape(4, 2),
                        "module.output_layer.bias": torch.ones(4)}, optimizer=False, chunk_layers=False)


def metadata_of(path: Path):
    """The test's own (trusted) .metadata, unpickled to be edited."""
    return pickle.loads((path / "weights" / ".metadata").read_bytes())


def nemo2_form(source: Path) -> Callable[[Path, dict[str, bytes]], tuple[Path, dict[str, str]]]:
    """NeMo 2: the record of `module.output_layer.bias` moved into a .distcp file of its own,
    which the hostile file replaces."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    def write(folder: Path, files: dict[str, bytes]) -> tuple[Path, dict[str, str]]:
        path = shutil.copytree(source, folder / "nemo2")
        record = path / "weights" / NEMO2_RECORD
        record.write_bytes(files.get("distcp record") or saved(torch.full((4,), 2.0)))
        metadata = metadata_of(path)
        index = next(i for i in metadata.storage_data if i.fqn == "module.output_layer.bias")
        metadata.storage_data[index] = _StorageInfo(record.name, 0, record.stat().st_size)
        (path / "weights" / ".metadata").write_bytes(pickle.dumps(metadata))
        return path, {"distcp record": str(record)}

    return write


FORMS = [
    Form("fair-esm .pt", ("model file", "contact regression"), fair_esm),
    Form("Hugging Face folder", ("pytorch_model.bin",), folder_form({"model_type": "esm"})),
    Form("Hugging Face shards", ("pytorch_model-1.bin", "pytorch_model-2.bin"), sharded),
    Form("SaProt folder", ("pytorch_model.bin",), folder_form({"model_type": "esm", "vocab_size": 446},
                                                              side={"vocab.txt": "<cls>\n<pad>\nA#\nAp\n"})),
    Form("ESM C folder", ("pytorch_model.bin",), folder_form({"model_type": "esmc"})),
    Form("nv_esm folder", ("pytorch_model.bin",), folder_form({"model_type": "nv_esm"})),
    Form("saved form", ("pytorch_model.bin",), folder_form({"model_type": "megamolbart"}, side={"vocab.txt": "C\n"})),
    Form("ESM C .pth", ("weights",), esmc_pth),
    Form(".nemo", ("model_weights.ckpt",), nemo_archive({"model_weights.ckpt": WEIGHTS})),
    Form(".nemo gzip", ("model_weights.ckpt",), nemo_archive({"model_weights.ckpt": WEIGHTS}, gzip=True)),
    Form(".nemo ranks", ("mp_rank_00/model_weights.ckpt", "mp_rank_01/model_weights.ckpt"),
         nemo_archive({"mp_rank_00/model_weights.ckpt": WEIGHTS, "mp_rank_01/model_weights.ckpt": WEIGHTS})),
]
NEMO2 = Form("NeMo 2", ("distcp record",), lambda folder, files: (folder, {}))  # bound to its source in `form_of`


# ----------------------------------------------------------------------- the hostile files
@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    """The file each hostile file's code would create; it must never appear."""
    return tmp_path_factory.mktemp("marker") / "code-ran"


HOSTILE: dict[str, Callable[[Path], bytes]] = {
    "legacy torch file calling os.system": hostile.legacy_call,
    "plain pickle calling os.system": hostile.plain_pickle_call,
    "torch zip calling os.system": hostile.zip_call,
    "TorchScript with code": hostile.torchscript,
    "BUILD on a function": lambda marker: hostile.build_on_function(),
    "BUILD on a class": lambda marker: hostile.build_on_class(),
    "terabytes (zip)": lambda marker: hostile.terabytes_zip(),
    "terabytes (legacy)": lambda marker: hostile.terabytes_legacy(),
}
"""Each kind of hostile torch file, written to create `marker` where it runs code."""


@pytest.fixture(scope="module")
def hostile_files(marker) -> dict[str, bytes]:
    return {kind: write(marker) for kind, write in HOSTILE.items()}


GUARDED = [torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter, collections.OrderedDict,
           torch.serialization._get_layout, dcp_metadata.Metadata,
           dcp_metadata._MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST]
"""What a BUILD would poison: the targets of the hostile files."""


def attributes(target: object) -> set[str]:
    """`target`'s own attributes, but for copyreg's cache of slot names (which pickling adds)."""
    return set(vars(target)) - {"__slotnames__"} if hasattr(target, "__dict__") else set()


UNTOUCHED = {id(target): attributes(target) for target in GUARDED}


@pytest.fixture(autouse=True)
def nothing_changed_and_nothing_ran(marker):
    yield
    assert not marker.exists(), "a hostile file's code ran"
    for target in GUARDED:
        assert not hasattr(target, "poisoned") and attributes(target) == UNTOUCHED[id(target)], target


def form_of(form: Form, nemo2_source: Path) -> Form:
    return Form(form.name, form.slots, nemo2_form(nemo2_source)) if form is NEMO2 else form


CASES = [pytest.param(form, slot, id=f"{form.name}:{slot}") for form in [*FORMS, NEMO2] for slot in form.slots]


@pytest.mark.parametrize("kind", list(HOSTILE))
@pytest.mark.parametrize(("form", "slot"), CASES)
def test_every_hostile_file_in_every_slot_is_refused_by_name(tmp_path, nemo2_source, hostile_files, form, slot, kind):
    form = form_of(form, nemo2_source)
    (tmp_path / "hostile").mkdir()
    path, names = form.write(tmp_path / "hostile", {slot: hostile_files[kind]})
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(path)
    message = str(raised.value)
    assert names[slot] in message and "\n" not in message and "refusing it" in message, message
    (tmp_path / "legitimate").mkdir()
    legitimate, _ = form.write(tmp_path / "legitimate", {})
    assert read_checkpoint(legitimate).weights  # the same process reads a real one afterwards


@pytest.mark.parametrize(("kind", "says"), [
    ("plain pickle calling os.system", r"it is a pickle stream, not a torch file \(no torch magic number\): only a "
                                       "full unpickler reads it, which can run code; load it where you trust it"),
    ("TorchScript with code", r"it is a TorchScript archive, which holds code that loading it runs"),
    ("terabytes (zip)", "its data.pkl says storage 0 holds 4398046511104 bytes but its record holds 8"),
    ("terabytes (legacy)", "its pickle claims 4398046511104 bytes of storages but only 16 bytes follow it"),
    ("legacy torch file calling os.system", r"it holds pickled code or objects other than tensors \(os\.system\), "
                                            "which will not be run"),
    ("torch zip calling os.system", r"it holds pickled code or objects other than tensors \(os\.system\)"),
    ("BUILD on a function", r"it holds pickled code or objects other than tensors \(<class 'function'>\)"),
    ("BUILD on a class", r"it holds pickled code or objects other than tensors \(<class 'type'>\)"),
])
def test_what_each_refusal_says(tmp_path, hostile_files, kind, says):
    path = tmp_path / "pytorch_model.bin"
    path.write_bytes(hostile_files[kind])
    with pytest.raises(CheckpointError, match=rf"^cannot read weights {path}: {says}"):
        open_torch_file(path, str(path))


def test_the_hostile_files_are_armed(tmp_path):
    """Loaded as a full unpickler (or torch.jit.load) would load them, each does what it is built
    to: the refusals above are of real attacks."""
    ran = tmp_path / "ran"
    for load, data in [(lambda b: torch.load(io.BytesIO(b), weights_only=False), hostile.legacy_call(ran)),
                       (pickle.loads, hostile.plain_pickle_call(ran)),
                       (lambda b: torch.load(io.BytesIO(b), weights_only=False), hostile.zip_call(ran)),
                       (lambda b: torch.jit.load(io.BytesIO(b)), hostile.torchscript(ran))]:
        load(data)
        assert ran.exists()
        ran.unlink()
    torch.load(io.BytesIO(hostile.build_on_function(__name__, "armed_target")), weights_only=False)
    torch.load(io.BytesIO(hostile.build_on_class(__name__, "ArmedTarget")), weights_only=False)
    assert getattr(armed_target, "poisoned", None) == 1 and getattr(ArmedTarget, "poisoned", None) == 1
    claimed = torch.load(io.BytesIO(hostile.terabytes_zip()), weights_only=True, map_location="meta")
    assert claimed["w"].untyped_storage().nbytes() == 4 * hostile.TERABYTES
    # their harmless twins are torch files as torch reads them, and as the readers do
    for data in (hostile.legitimate_zip(), hostile.legitimate_legacy()):
        assert torch.equal(torch.load(io.BytesIO(data), weights_only=True)["w"], torch.zeros(2))
        assert torch.equal(open_torch_file(io.BytesIO(data), "twin")["w"], torch.zeros(2))


def tar_polyglot() -> bytes:
    """A file that is torch's legacy run of pickles and, read as a tar, a header (the pickles are
    its member's name): torch.load's legacy path tries its pre-1.0 tar format, which it extracts."""
    proto, stop = hostile.PROTO2, hostile.STOP
    pickles = b"".join(proto + part + stop for part in (hostile.integer(hostile.LEGACY_MAGIC), hostile.integer(1001),
                                                         hostile.EMPTY_DICT, hostile.EMPTY_DICT, b"]"))
    info = tarfile.TarInfo(pickles.decode("latin-1"))
    return info.tobuf(tarfile.GNU_FORMAT, "latin-1", "strict") + bytes(2 * tarfile.BLOCKSIZE)


def central_size(data: bytes, record: str, size: int) -> bytes:
    """`data` (a zip) with the sizes its central directory gives `record` replaced by `size`."""
    name, entry = record.encode(), data.index(b"PK\x01\x02")
    while data[entry + 46:entry + 46 + len(name)] != name:  # the entry's name follows its 46-byte header
        entry = data.index(b"PK\x01\x02", entry + 4)
    return data[:entry + 20] + struct.pack("<II", size, size) + data[entry + 28:]


def rezipped(data: bytes, *, extra: str | None = None, compress: bool = False, drop: str | None = None) -> bytes:
    """A torch zip rewritten: one more record, every record deflated, or one left out."""
    source, buffer = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            if info.filename != drop:
                out.writestr(info.filename, source.read(info))
        if extra:
            out.writestr(extra, "print('hi')\n")
    return buffer.getvalue()


@pytest.mark.parametrize(("data", "says"), [
    (tar_polyglot(), r"it is a tar archive \(torch's pre-1\.0 format\), which is not opened"),
    (rezipped(WEIGHTS, extra="archive/extra/run.py"), "it is a zip file holding 'extra/run.py', which torch.save "
                                                      "does not write"),
    (rezipped(WEIGHTS, compress=True), "its record data.pkl is compressed, which torch.save never does"),
    (rezipped(WEIGHTS, drop="archive/data.pkl"), r"it is a zip file but not one torch.save writes \(no "
                                                 r"<archive>/data\.pkl\)"),
    (central_size(hostile.legitimate_zip(), "archive/data/0", 0xFFFFFFF0),
     "its record data/0 claims 4294967280 bytes, more than the file holds"),
], ids=["tar polyglot", "extra record", "compressed", "no data.pkl", "record size"])
def test_files_torch_save_never_writes_are_refused_before_unpickling(tmp_path, data, says):
    path = tmp_path / "model_weights.ckpt"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"^cannot read weights {path}: {says}; refusing it$"):
        open_torch_file(path, str(path))


def armed_target() -> None:
    """What `test_the_hostile_files_are_armed` poisons instead of torch's own functions."""


class ArmedTarget:
    """What `test_the_hostile_files_are_armed` poisons instead of torch's own classes."""


# --------------------------------------------------------------------------- NeMo 2 .metadata
def metadata_hostile(kind: str, source: Path, marker: Path) -> bytes:
    proto, stop = hostile.PROTO2, hostile.STOP
    if kind == "calling os.system":
        return proto + hostile.system(marker) + stop
    if kind == "TorchScript with code":
        return hostile.torchscript(marker)
    if kind == "BUILD on a function":  # a function the metadata unpickler may name
        return proto + hostile.build("torch.serialization", "_get_layout") + stop
    if kind == "BUILD on a class":
        return proto + hostile.build("torch.distributed.checkpoint.metadata", "Metadata") + stop
    if kind == "BUILD on an enum member":  # made by a call the unpickler allows, shared by the whole process
        member = hostile.call("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", hostile.integer(1))
        return proto + member + hostile.one_key_dict("poisoned", hostile.integer(1)) + hostile.BUILD + stop
    metadata = metadata_of(source)  # "terabytes": one tensor declared 2**40 elements long
    entry = metadata.state_dict_metadata["module.output_layer.bias"]
    entry.size = torch.Size([hostile.TERABYTES])
    entry.chunks[0].sizes = torch.Size([hostile.TERABYTES])
    return pickle.dumps(metadata)


@pytest.mark.parametrize(("kind", "says"), [
    ("calling os.system", r"holds a pickled os\.system, which is not torch\.distributed\.checkpoint metadata"),
    ("TorchScript with code", r"is not readable torch\.distributed\.checkpoint metadata"),
    ("BUILD on a function", "holds a pickled state for the function _get_layout"),
    ("BUILD on a class", "holds a pickled state for the class Metadata"),
    ("BUILD on an enum member", "holds a pickled state for the object _MEM_FORMAT_ENCODING"),
    ("terabytes", r"declares 4398046511\d+ bytes of tensors but its files hold \d+; refusing the checkpoint"),
])
def test_a_hostile_nemo2_metadata_is_refused_by_name(tmp_path, nemo2_source, marker, kind, says):
    path = shutil.copytree(nemo2_source, tmp_path / "nemo2")
    (path / "weights" / ".metadata").write_bytes(metadata_hostile(kind, nemo2_source, marker))
    with pytest.raises(CheckpointError, match=rf"^{path}/weights/\.metadata:? {says}"):
        read_checkpoint(path)
    checkpoint = read_checkpoint(nemo2_source)
    assert torch.equal(checkpoint.weights["module.output_layer.bias"], torch.ones(4))
    assert sum(key.endswith("._extra_state/shard_0.0_1.1") for key in checkpoint.skipped) == 3  # bytes, never read


# ------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize(("form", "slot", "kind"), [
    (FORMS[0], "contact regression", "legacy torch file calling os.system"),
    (FORMS[0], "model file", "TorchScript with code"),
    (FORMS[1], "pytorch_model.bin", "terabytes (zip)"),
    (FORMS[8], "model_weights.ckpt", "BUILD on a function"),
], ids=["fair-esm regression legacy", "fair-esm TorchScript", "huggingface terabytes", "nemo BUILD"])
def test_inspect_reports_the_refusal_in_one_line(tmp_path, hostile_files, form, slot, kind):
    path, names = form.write(tmp_path, {slot: hostile_files[kind]})
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code == 1, result.output
    assert names[slot] in result.output and "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
