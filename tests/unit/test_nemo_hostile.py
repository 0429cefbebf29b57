""".nemo reading is bounded in time and memory, whatever the archive holds: hostile YAML (billion
laughs, deep nesting, recursive aliases, huge numbers, oversize), hostile tar headers (huge GNU long
names and pax headers, chains of them, sparse maps, negative sizes) and pickled code in the weights
are refused with one-line errors naming the archive, quickly and without the memory they ask for.

The archives that made the reader spend minutes or gigabytes are each read in a subprocess whose
address space is capped (RLIMIT_AS) and whose read has an alarm, so that a regression fails these
tests instead of taking the machine down.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
import torch

from bionemo_export.models.readers import CheckpointError, bounded_tar, bounded_yaml, read_checkpoint
from tests.helpers.nemo_archives import write_nemo

ROOT = Path(__file__).resolve().parents[2]
MOST_SECONDS = 2.0
"""Most a refusal may take (the hostile archives took from 1.5 s to minutes before)."""
MOST_GROWTH_MIB = 32
"""Most the reading process's peak resident memory may grow while refusing an archive."""
WEIGHTS = {"w": torch.zeros(2)}


# ------------------------------------------------------------------------------ archive builders
def tar_bytes(members: dict[str, bytes], *, pax: dict[str, dict[str, str]] | None = None) -> bytes:
    """A plain (pax format) tar with `members`; `pax[name]` adds pax records to that member."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.pax_headers = (pax or {}).get(name, {})
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def header(name: str, kind: bytes, size: int) -> bytes:
    """One raw 512-byte GNU-format header declaring `size` bytes of type `kind`."""
    info = tarfile.TarInfo(name)
    info.type, info.size = kind, size
    return info.tobuf(format=tarfile.GNU_FORMAT)


def pax_record(keyword: str, value: str) -> bytes:
    """One pax record, "<length> <keyword>=<value>\\n", its length counting itself."""
    body = f" {keyword}={value}\n".encode()
    length = len(body) + len(str(len(body)))
    length = len(body) + len(str(length))
    return str(length).encode() + body


def pax_header(records: bytes, kind: bytes = tarfile.XHDTYPE) -> bytes:
    """A pax header block with its records, padded to whole blocks."""
    return header("././@PaxHeader", kind, len(records)) + records + bytes(-len(records) % 512)


def plain_member(name: str, data: bytes) -> bytes:
    return header(name, tarfile.REGTYPE, len(data)) + data + bytes(-len(data) % 512)


def gzip_stream(chunks) -> bytes:
    """`chunks` gzip'd without holding them all in memory."""
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    return b"".join(compressor.compress(chunk) for chunk in chunks) + compressor.flush()


def config_archive(path: Path, config: bytes, *, gzip: bool = False) -> Path:
    """A .nemo holding `config` as model_config.yaml and a valid (tiny) state dict."""
    buffer = io.BytesIO()
    torch.save(WEIGHTS, buffer)
    data = tar_bytes({"model_config.yaml": config, "model_weights.ckpt": buffer.getvalue()})
    path.write_bytes(gzip_stream([data]) if gzip else data)
    return path


def merge_laughs(levels: int = 40) -> bytes:
    """A billion laughs through merge keys: each level merges the one before twice, which
    yaml's constructor copies out, doubling the mapping at every level."""
    lines = ["a0: &a0 {k0: 1, k1: 2}"] + [f"a{i}: &a{i} {{<<: [*a{i - 1}, *a{i - 1}]}}" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def list_laughs(levels: int = 12) -> bytes:
    """The classic billion laughs: nine aliases of the level before at every level."""
    lines = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return ("\n".join(lines) + "\n").encode()


def long_name_gzip(name_bytes: int) -> bytes:
    """A gzip'd tar whose first header is a GNU long name really `name_bytes` long: a few hundred KB
    on disk, which tarfile would read whole into memory (and decode into a second copy)."""
    chunk = b"a" * (1 << 20)
    body = [header("././@LongLink", tarfile.GNUTYPE_LONGNAME, name_bytes)]
    body += [chunk] * (name_bytes >> 20) + [bytes(-name_bytes % 512)]
    return gzip_stream(body + [plain_member("model_config.yaml", b"a: 1\n"), bytes(1024)])


def huge_pax_path_gzip(path_bytes: int) -> bytes:
    """A gzip'd tar whose member's pax `path` record is `path_bytes` long."""
    record = pax_record("path", "p" * path_bytes)
    return gzip_stream([pax_header(record), plain_member("x", b""), bytes(1024)])


def hostile_archives(folder: Path) -> dict[str, Path]:
    """The archives that cost seconds to minutes and hundreds of MB to GB before the reader was bounded."""
    files = {
        "merge_laughs.nemo": tar_bytes({"model_config.yaml": merge_laughs(), "model_weights.ckpt": b"x"}),
        "deep.nemo": tar_bytes({"model_config.yaml": b"a: " + b"[" * 50_000 + b"]" * 50_000 + b"\n",
                                "model_weights.ckpt": b"x"}),
        "base60.nemo": tar_bytes({"model_config.yaml": b"a: 1:" + b":".join([b"5"] * 100_000) + b"\n",
                                  "model_weights.ckpt": b"x"}),
        # declares 100 MB of long name; the file ends after 4 KB
        "long_name_truncated.nemo": header("././@LongLink", tarfile.GNUTYPE_LONGNAME, 100 << 20) + b"a" * 4096,
        "long_name.nemo": long_name_gzip(100 << 20),
        "long_name.tar": long_name_gzip(100 << 20),  # no .nemo suffix: recognizing it reads the first header
        "pax_path.nemo": huge_pax_path_gzip(40 << 20),
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


READ_BOUNDED = r"""
import json, resource, signal, sys, time, types
from pathlib import Path

root, archive = Path(sys.argv[1]), Path(sys.argv[2])
# bionemo_export.models' __init__ imports every family and torch (seconds per process); the readers
# need neither until weights are read, which a refused archive never gets to.
stub = types.ModuleType("bionemo_export.models")
stub.__path__ = [str(root / "bionemo_export" / "models")]
sys.modules["bionemo_export.models"] = stub
sys.path.insert(0, str(root))
from bionemo_export.models.readers import read_checkpoint

size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) << 10
resource.setrlimit(resource.RLIMIT_AS, (size + (512 << 20), resource.RLIM_INFINITY))

def alarm(signum, frame):
    raise TimeoutError("still reading after 15 s")

signal.signal(signal.SIGALRM, alarm)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
signal.alarm(15)
try:
    read_checkpoint(archive)
    error = "read without an error"
except BaseException as err:  # MemoryError, RecursionError, TimeoutError are results too
    error = f"{type(err).__name__}: {err}"
signal.alarm(0)
seconds = time.perf_counter() - start
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
print(json.dumps({"error": error, "seconds": seconds, "growth_mib": growth}))
"""


def read_bounded(archive: Path) -> dict:
    """`archive` read in a subprocess whose address space is capped at 512 MiB over what it has
    after imports: its error, seconds and peak memory growth (or how the process died)."""
    try:
        done = subprocess.run([sys.executable, "-c", READ_BOUNDED, str(ROOT), str(archive)],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": "still reading after 60 s", "seconds": 60.0, "growth_mib": float("nan")}
    if done.returncode != 0 or not done.stdout.strip():
        return {"error": f"the reading process died (exit {done.returncode}): {done.stderr[-300:]}",
                "seconds": float("nan"), "growth_mib": float("nan")}
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def bounded_reads(tmp_path_factory) -> dict[str, dict]:
    """Each hostile archive read by `read_bounded`, by file name."""
    archives = hostile_archives(tmp_path_factory.mktemp("hostile"))
    return {name: read_bounded(path) for name, path in archives.items()}


@pytest.mark.parametrize(("archive", "message"), [
    ("merge_laughs.nemo", r"merge_laughs\.nemo:model_config\.yaml has more than 20000 values with its aliases "
                          r"\(\*name\) expanded, the most a model config may have \(a 'billion laughs' document\); "
                          "refusing it"),
    ("deep.nemo", r"deep\.nemo:model_config\.yaml nests deeper than 64 levels, the most a model config may nest; "
                  "refusing it"),
    ("base60.nemo", r"base60\.nemo:model_config\.yaml has an integer of 200001 characters \(the most is 100\)"),
    ("long_name_truncated.nemo", r"long_name_truncated\.nemo: a GNU long name at byte 0 declares 104857600 bytes "
                                 r"\(the most for member names is 4097\); refusing the archive"),
    ("long_name.nemo", r"long_name\.nemo: a GNU long name at byte 0 declares 104857600 bytes"),
    ("long_name.tar", r"long_name\.tar: a GNU long name at byte 0 declares 104857600 bytes"),
    ("pax_path.nemo", r"pax_path\.nemo: a pax extended header at byte 0 declares 41943\d+ bytes "
                      r"\(the most for pax headers is 65536\); refusing the archive"),
], ids=lambda value: value if value.endswith((".nemo", ".tar")) else "")
def test_hostile_archives_are_refused_quickly_in_bounded_memory(bounded_reads, archive, message):
    result = bounded_reads[archive]
    assert result["error"].startswith("CheckpointError: ") and "\n" not in result["error"], result["error"][:500]
    assert re.search(message, result["error"]), result["error"][:500]
    assert result["seconds"] < MOST_SECONDS, result
    assert result["growth_mib"] < MOST_GROWTH_MIB, result


# ------------------------------------------------------------------------------------ the YAML
def loaders() -> list:
    """Both bounded loaders: on libyaml's parser (used where PyYAML has it) and the pure-Python one."""
    found = [pytest.param("BoundedPythonYaml", id="python")]
    if bounded_yaml.yaml.__with_libyaml__:
        found.append(pytest.param("BoundedLibyaml", id="libyaml"))
    return found


@pytest.mark.parametrize("loader", loaders())
@pytest.mark.parametrize(("config", "message"), [
    (merge_laughs(), r"has more than 20000 values with its aliases \(\*name\) expanded"),
    (list_laughs(), r"has more than 20000 values with its aliases \(\*name\) expanded"),
    (b"a: " + b"{a: " * 200 + b"1" + b"}" * 200, "nests deeper than 64 levels"),
    # deep enough for libyaml's own scanner limit (~1,000 flow levels), which stops it first
    (b"a: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nests deeper than 64 levels"),
    (b"a: &a [1, *a]\n", r"has an alias inside the collection it refers to \(a recursive structure\)"),
    (b"a: " + b"9" * 5000 + b"\n", r"has an integer of 5000 characters \(the most is 100\)"),
    (b"a: 1\n" + b"#" * (1 << 20), r"is over 1048576 bytes, the most a model config may be"),
])
def test_hostile_yaml_is_refused_by_both_loaders(loader, config, message):
    with pytest.raises(CheckpointError, match=r"^x\.nemo:model_config\.yaml " + message + ".*refusing it$"):
        bounded_yaml.parse_yaml_mapping(config, "x.nemo:model_config.yaml", getattr(bounded_yaml, loader))


@pytest.mark.parametrize("loader", loaders())
def test_both_loaders_read_a_real_config_alike_anchors_and_merges_included(loader):
    config = (b"target: x.ESM2nvModel\nnum_layers: 2\nbase: &base {hidden_size: 64, dropout: 0.1}\n"
              b"encoder: {<<: *base, num_layers: 2}\ndecoder: *base\nschedule: [1, 2.5, null, true, '3']\n")
    assert bounded_yaml.parse_yaml_mapping(config, "x.nemo:model_config.yaml", getattr(bounded_yaml, loader)) == {
        "target": "x.ESM2nvModel", "num_layers": 2, "base": {"hidden_size": 64, "dropout": 0.1},
        "encoder": {"hidden_size": 64, "dropout": 0.1, "num_layers": 2},
        "decoder": {"hidden_size": 64, "dropout": 0.1}, "schedule": [1, 2.5, None, True, "3"]}


def test_an_oversize_config_is_refused_before_it_is_read(tmp_path):
    # 1 MiB and a bit of comment lines: a few KB gzip'd
    archive = config_archive(tmp_path / "big.nemo", b"a: 1\n" + b"# padding\n" * 110_000, gzip=True)
    with pytest.raises(CheckpointError, match=r"big\.nemo:model_config\.yaml is over 1048576 bytes, the most a "
                                              r"model config may be \(NeMo's are a few KB\); refusing it$"):
        read_checkpoint(archive)


def test_invalid_yaml_is_named_on_one_line(tmp_path):
    archive = config_archive(tmp_path / "bad.nemo", b"a: [1, 2\nb: 3\n")
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(archive)
    assert str(raised.value).startswith(f"{archive}:model_config.yaml is not valid YAML: ")
    assert "line " in str(raised.value) and "\n" not in str(raised.value)


# ------------------------------------------------------------------------------- the tar headers
def many_headers_in_a_row(count: int) -> bytes:
    """`count` empty pax headers before one member: tarfile follows them by recursion."""
    return pax_header(b"") * count + plain_member("model_config.yaml", b"a: 1\n") + bytes(1024)


def sparse_pax_member() -> bytes:
    """A member marked as a GNU sparse file (pax format 1.0), whose map claims a billion entries."""
    records = b"".join(pax_record(k, v) for k, v in (("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"),
                                                      ("GNU.sparse.name", "model_weights.ckpt"),
                                                      ("GNU.sparse.realsize", "1024")))
    return pax_header(records) + plain_member("GNUSparseFile.0/x", b"1000000000\n0\n") + bytes(1024)


def many_global_records() -> bytes:
    """A global pax header of 2,000 records, which tarfile copies into every member."""
    records = b"".join(pax_record(f"k{i}", "v") for i in range(2000))
    members = b"".join(plain_member(f"f{i}", b"") for i in range(3))
    return pax_header(records, tarfile.XGLTYPE) + members + bytes(1024)


def headers_over_a_mebibyte() -> bytes:
    """30 members each with a 60 KB pax comment (1.8 MB of headers, nothing declared)."""
    comment = {"comment": "c" * (60 << 10)}
    return tar_bytes({f"f{i}": b"" for i in range(30)}, pax={f"f{i}": comment for i in range(30)})


@pytest.mark.parametrize(("data", "gzip", "message"), [
    (header("model_weights.ckpt", tarfile.REGTYPE, -512), False,
     "member 'model_weights.ckpt' declares a negative size"),
    (many_headers_in_a_row(2000), False, "more than 8 extension headers in a row at byte 4096"),
    (header("model_weights.ckpt", tarfile.GNUTYPE_SPARSE, 0) + bytes(1024), False,
     "member 'model_weights.ckpt' is a sparse file"),
    (sparse_pax_member(), True, r"member 'GNUSparseFile\.0/x' is a sparse file \(pax GNU\.sparse records\)"),
    (many_global_records(), False, r"member 'f0' has 2000 pax records \(the most a member may have is 64\)"),
    (headers_over_a_mebibyte(), True, r"its extension headers \(long names, pax records\) hold more than 1048576 "
                                      "bytes in all"),
    (tar_bytes({"model_config.yaml": b"a: 1\n"}, pax={"model_config.yaml": {"path": "d/" * 2500 + "x"}}), False,
     r"a member's name is 5001 bytes long \(the most is 4096\): 'd/d/d/"),
    (pax_header(b"9" * 5000 + b" path=x\n") + plain_member("x", b""), False, "malformed tar header near byte 0"),
])
def test_hostile_tar_headers_are_refused(tmp_path, data, gzip, message):
    archive = tmp_path / "evil.nemo"
    archive.write_bytes(gzip_stream([data]) if gzip else data)
    with pytest.raises(CheckpointError, match=rf"^{tmp_path}/evil\.nemo: {message}.*; refusing the archive$"):
        read_checkpoint(archive)


def test_the_tarfile_hooks_the_reader_overrides_exist():
    """Overrides of hooks this Python's tarfile no longer has would bound nothing, silently."""
    assert all(callable(getattr(tarfile.TarInfo, hook, None)) for hook in bounded_tar.TAR_HOOKS)
    assert bounded_tar.BoundedTarFile.tarinfo is bounded_tar.BoundedTarInfo


@pytest.mark.parametrize("gzip", [False, True])
def test_a_valid_archive_still_reads(tmp_path, gzip):
    tokenizer = {"library": "regex", "model": "nemo:abc_m.model", "vocab_file": "nemo:abc_m.vocab"}
    weights = {"model.embedding.weight": torch.arange(12.0).reshape(3, 4), "model.bias": torch.ones(3)}
    config = {"target": "x.MegaMolBARTModel", "num_layers": 2, "tokenizer": tokenizer}
    archive = write_nemo(tmp_path / "ok.nemo", config, weights,
                         {"abc_m.model": b"regex", "abc_m.vocab": b"<pad>\nC\n"}, gzip=gzip)
    checkpoint = read_checkpoint(archive)
    assert checkpoint.config == config
    assert checkpoint.model_class == "x.MegaMolBARTModel"
    assert set(checkpoint.weights) == set(weights)
    assert all(torch.equal(checkpoint.weights[k], v) for k, v in weights.items())
    assert checkpoint.files == {"abc_m.model": b"regex", "abc_m.vocab": b"<pad>\nC\n"}


# --------------------------------------------------------------------------- pickled code in weights
class System:
    """Pickles as a call of os.system: unpickling it with a full unpickler would run the command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def assert_refused_in_one_line(message: str, source: str, named: str) -> None:
    assert message == (f"cannot read weights {source}: it holds pickled code or objects other than tensors "
                       f"({named}), which will not be run; refusing it")


@pytest.mark.parametrize("form", ["torch.save", "pickle protocol 2"])
def test_pickled_os_system_in_a_nemo_never_runs_and_is_refused(tmp_path, form):
    marker = tmp_path / "pwned"
    payload = {"p": System(f"touch {marker}"), "w": torch.zeros(2)}  # the global comes first
    buffer = io.BytesIO()
    if form == "torch.save":
        torch.save(payload, buffer)
    else:
        pickle.dump(payload, buffer, protocol=2)
    archive = tmp_path / "evil.nemo"
    archive.write_bytes(tar_bytes({"model_config.yaml": b"target: x.ESM2nvModel\n",
                                   "model_weights.ckpt": buffer.getvalue()}))
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(archive)
    if form == "torch.save":
        assert_refused_in_one_line(str(raised.value), f"{archive}:model_weights.ckpt", "posix.system")
    else:  # refused from its first pickle (no torch magic number), before anything is unpickled
        assert str(raised.value).startswith(f"cannot read weights {archive}:model_weights.ckpt: it is a pickle "
                                            "stream, not a torch file (no torch magic number)")
    assert not marker.exists()


def test_pickled_os_system_in_a_hugging_face_folder_never_runs_and_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "esm"}))
    torch.save({"w": torch.zeros(2), "p": System(f"touch {marker}")}, folder / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(folder)
    assert_refused_in_one_line(str(raised.value), str(folder / "pytorch_model.bin"), "posix.system")
    assert not marker.exists()


ADVICE = ("Weights only load failed. In PyTorch 2.6, we changed the default value of the `weights_only` argument in "
          "`torch.load` from `False` to `True`. Re-running `torch.load` with `weights_only` set to `False` will "
          "likely succeed, but it can result in arbitrary code execution.")
DOCS = "\n\nCheck the documentation of torch.load to learn more about types accepted by default with weights_only."


@pytest.mark.parametrize(("message", "refusal"), [
    (f"{ADVICE}\nPlease file an issue: WeightsUnpickler error: Unsupported global: GLOBAL posix.system was not an "
     f"allowed global by default. Please use `torch.serialization.add_safe_globals([posix.system])`.{DOCS}",
     "other than tensors (posix.system), which will not be run"),
    (f"{ADVICE}\n\n\nTrying to load unsupported GLOBAL posix.system whose module posix is blocked.{DOCS}",
     "other than tensors (posix.system), which will not be run"),
    ("weights only load failed: unsupported global: nt.system",
     "other than tensors (nt.system), which will not be run"),
    (f"{ADVICE}\nWeightsUnpickler error: Trying to call reduce for unrecognized function <built-in function system>",
     "other than tensors (<built-in function system>), which will not be run"),
    (f"{ADVICE}\nPlease file an issue: WeightsUnpickler error: \n\nUnsupported operand 149{DOCS}",
     "that will not be run, or is corrupt (Unsupported operand 149)"),
    (ADVICE + DOCS, "that will not be run, or is corrupt (no reason given)"),
])
def test_any_refused_pickle_is_one_line_without_torchs_advice(tmp_path, monkeypatch, message, refusal):
    """Whatever torch's wording (it changed between 2.5 and 2.13), an UnpicklingError under
    weights_only=True is reported as a refusal, naming the global when torch does."""
    archive = config_archive(tmp_path / "x.nemo", b"target: x.ESM2nvModel\n")

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError(message)

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError) as raised:
        read_checkpoint(archive)
    assert str(raised.value) == f"cannot read weights {archive}:model_weights.ckpt: it holds pickled code or " \
                                f"objects {refusal}; refusing it"
