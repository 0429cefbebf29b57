"""The BioNeMo / NeMo `.nemo` form, read without NeMo or Megatron installed.

A `.nemo` file is a tar archive (plain, or gzip in older files) holding `model_config.yaml` (the
training config's `model:` section), `model_weights.ckpt` (a torch state dict) and tokenizer
artifacts stored as `<uuid>_<name>` and referenced from the YAML as `nemo:<uuid>_<name>`.

Reading is defensive: the archive is never extracted to disk; members with absolute or `..` paths,
links and devices are refused; the declared sizes are bounded (a small archive that would unpack to
an enormous one is refused); the weights are read with `torch.load(weights_only=True)`, so no
pickled code runs; model-parallel archives (`mp_rank_XX/` folders) are refused with what to do.
"""

from __future__ import annotations

import io
import os
import posixpath
import re
import tarfile
from pathlib import Path
from typing import Any

import yaml

from .base import (MAX_SIDE_FILE_BYTES, Checkpoint, CheckpointError, CheckpointReader, register_reader,
                   unreadable_weights)
from .huggingface import check_state_dict

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"
ARTIFACT_PREFIX = "nemo:"
MAX_MEMBERS = 10_000
MAX_UNPACKED_BYTES = int(os.environ.get("BIONEMO_EXPORT_NEMO_MAX_BYTES", 256 << 30))
"""Most bytes a .nemo may declare in all (the largest BioNeMo models are ~12 GB)."""
MAX_EXPANSION = 20
"""Most a gzip'd archive may expand relative to its size (weights compress by ~10%, not 20x)."""


def _member_name(member: tarfile.TarInfo, archive: Path) -> str:
    """The member's normalized relative name; CheckpointError for names that leave the archive."""
    name = member.name
    if name.startswith("/") or name.startswith("\\") or (len(name) > 1 and name[1] == ":"):
        raise CheckpointError(f"{archive}: member {name!r} has an absolute path; refusing the archive")
    normalized = posixpath.normpath(name.replace("\\", "/"))
    if normalized == ".." or normalized.startswith("../"):
        raise CheckpointError(f"{archive}: member {name!r} points outside the archive; refusing it")
    return "" if normalized == "." else normalized


def _safe_members(tar: tarfile.TarFile, archive: Path) -> dict[str, tarfile.TarInfo]:
    """Regular files by normalized name, after the safety checks."""
    files: dict[str, tarfile.TarInfo] = {}
    total = 0
    for count, member in enumerate(tar, start=1):
        if count > MAX_MEMBERS:
            raise CheckpointError(f"{archive} has more than {MAX_MEMBERS} members; not a .nemo checkpoint")
        name = _member_name(member, archive)
        if member.isdir():
            continue
        if not member.isfile():
            kind = "link" if member.issym() or member.islnk() else "special file"
            raise CheckpointError(f"{archive}: member {member.name!r} is a {kind}; refusing the archive")
        total += member.size
        if total > MAX_UNPACKED_BYTES:
            raise CheckpointError(f"{archive} would unpack to more than {MAX_UNPACKED_BYTES >> 30} GiB; refusing it "
                                  "(set BIONEMO_EXPORT_NEMO_MAX_BYTES to raise the limit)")
        files[name] = member
    compressed = archive.stat().st_size
    if total > MAX_EXPANSION * max(compressed, 1 << 20):
        raise CheckpointError(f"{archive} ({compressed} bytes) declares {total} bytes of content: "
                              "a decompression bomb, not a checkpoint; refusing it")
    return files


def _check_single_rank(names: list[str], archive: Path) -> None:
    ranks = sorted({part for name in names for part in name.split("/") if part.startswith("mp_rank_")})
    if ranks:
        raise CheckpointError(
            f"{archive} is a model-parallel checkpoint ({', '.join(ranks)}): merge it into one rank first "
            "(NeMo's megatron_change_num_partitions.py with --target_tensor_model_parallel_size 1)")


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    assert handle is not None  # regular files always have content
    return handle.read()


def _load_weights(tar: tarfile.TarFile, member: tarfile.TarInfo, source: str) -> dict[str, Any]:
    import pickle

    import torch

    handle = tar.extractfile(member)
    assert handle is not None
    try:
        weights = torch.load(handle, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        if found:
            raise CheckpointError(f"{source} holds objects other than tensors ({found.group(1)}), which would need "
                                  "its pickled code to run; refusing it") from None
        raise unreadable_weights(source, err) from None
    except Exception as err:
        raise unreadable_weights(source, err) from None
    return check_state_dict(weights, source)


@register_reader
class NemoReader(CheckpointReader):
    form = "nemo"
    description = "a BioNeMo/NeMo .nemo archive (model_config.yaml + model_weights.ckpt, plain or gzip tar)"

    def recognizes(self, path: Path) -> bool:
        return path.is_file() and (path.suffix == ".nemo" or tarfile.is_tarfile(path))

    def read(self, path: Path) -> Checkpoint:
        try:
            with tarfile.open(path, "r:*") as tar:
                members = _safe_members(tar, path)
                _check_single_rank(list(members), path)
                by_base = {posixpath.basename(name): member for name, member in members.items()}
                for required in (CONFIG_NAME, WEIGHTS_NAME):
                    if required not in by_base:
                        raise CheckpointError(f"{path} has no {required}; a .nemo checkpoint holds "
                                              f"{CONFIG_NAME} and {WEIGHTS_NAME}")
                config = _parse_config(_read(tar, by_base[CONFIG_NAME]), path)
                weights = _load_weights(tar, by_base[WEIGHTS_NAME], f"{path}:{WEIGHTS_NAME}")
                files = {
                    base: _read(tar, member)
                    for base, member in by_base.items()
                    if base not in (CONFIG_NAME, WEIGHTS_NAME) and member.size <= MAX_SIDE_FILE_BYTES
                }
        except (tarfile.TarError, EOFError, OSError) as err:
            reason = str(err).splitlines()[0].rstrip(":")  # tarfile lists every method it tried
            raise CheckpointError(f"{path} is not a readable .nemo archive (plain or gzip tar): {reason}") from None
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=WEIGHTS_NAME,
                          files=files, model_class=config.get("target"))


def _parse_config(data: bytes, archive: Path) -> dict[str, Any]:
    try:
        config = yaml.safe_load(io.BytesIO(data))
    except yaml.YAMLError as err:
        raise CheckpointError(f"{archive}:{CONFIG_NAME} is not valid YAML: {err}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{archive}:{CONFIG_NAME} is not a mapping")
    return config


# ---------------------------------------------------------------- helpers for families
def setting(checkpoint: Checkpoint, key: str, section: str | None = None, default: Any = ...) -> Any:
    """A model_config.yaml setting: from the nested `section` (encoder:/decoder:, newer NeMo
    configs) when it has it, else the flat top level; CheckpointError when absent and no default."""
    config = checkpoint.config
    nested = config.get(section) if section else None
    if isinstance(nested, dict) and key in nested:
        return nested[key]
    if key in config:
        return config[key]
    if default is not ...:
        return default
    where = f"{section}.{key} or {key}" if section else key
    raise CheckpointError(f"{checkpoint.path}:{CONFIG_NAME} has no {where}")


def artifact(checkpoint: Checkpoint, key: str) -> bytes:
    """The tokenizer artifact that `tokenizer.<key>` references (`nemo:<uuid>_<name>`)."""
    reference = (checkpoint.config.get("tokenizer") or {}).get(key)
    if not isinstance(reference, str) or not reference:
        raise CheckpointError(f"{checkpoint.path}:{CONFIG_NAME} has no tokenizer.{key}")
    name = posixpath.basename(reference.removeprefix(ARTIFACT_PREFIX))
    if name not in checkpoint.files:
        raise CheckpointError(f"{checkpoint.path}: tokenizer.{key} refers to {reference!r}, "
                              "which is not in the archive")
    return checkpoint.files[name]


def artifact_text(checkpoint: Checkpoint, key: str) -> str:
    """`artifact` as UTF-8 text."""
    try:
        return artifact(checkpoint, key).decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{checkpoint.path}: the artifact of tokenizer.{key} is not UTF-8 text") from None


def sentencepiece_pieces(checkpoint: Checkpoint, model_name: str) -> list[str]:
    """The piece vocabulary (id order) of the archive's SentencePiece tokenizer artifacts: the
    `tokenizer.model` protobuf and/or the `tokenizer.vocab_file` (`piece<TAB>score` lines); when
    both are there they must agree. `model_name` (ESM-1nv, ProtT5nv) is for messages."""
    from bionemo_export.tokenizers.sentencepiece_vocab import read_pieces

    source = f"{checkpoint.path}:{CONFIG_NAME}"
    tokenizer = checkpoint.config.get("tokenizer") or {}
    if not isinstance(tokenizer, dict):
        raise CheckpointError(f"{source}: tokenizer is not a mapping")
    library = tokenizer.get("library", "sentencepiece")
    if library != "sentencepiece":
        raise CheckpointError(f"{source}: tokenizer.library is {library!r}; {model_name} uses 'sentencepiece'")
    found: dict[str, list[str]] = {}
    for key, kind in (("model", ".model"), ("vocab_file", ".vocab")):
        reference = tokenizer.get(key)
        if not isinstance(reference, str) or not reference:
            continue
        try:
            found[key] = read_pieces(artifact(checkpoint, key), kind)
        except ValueError as err:
            raise CheckpointError(f"{checkpoint.path}: tokenizer.{key} ({reference}): {err}") from None
    if not found:
        raise CheckpointError(f"{source} names no tokenizer artifact (tokenizer.model or tokenizer.vocab_file); "
                              f"a {model_name} archive carries its SentencePiece vocabulary")
    if len(found) == 2 and found["model"] != found["vocab_file"]:
        raise CheckpointError(f"{checkpoint.path}: the pieces of tokenizer.model and tokenizer.vocab_file differ "
                              f"({len(found['model'])} vs {len(found['vocab_file'])} pieces)")
    return next(iter(found.values()))
