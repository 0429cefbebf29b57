"""The BioNeMo / NeMo `.nemo` form, read without NeMo or Megatron installed.

A `.nemo` file is a tar archive (plain, or gzip in older files) holding `model_config.yaml` (the
training config's `model:` section), `model_weights.ckpt` (a torch state dict) and tokenizer
artifacts stored as `<uuid>_<name>` and referenced from the YAML as `nemo:<uuid>_<name>`.

Reading is defensive, bounded in time and memory whatever the archive holds:
- the archive is read through bounded_tar.py (never extracted; headers, names, sizes and the
  expansion of gzip'd archives bounded);
- `model_config.yaml` through bounded_yaml.py (size, nesting and aliases bounded while composed);
- the weights are opened as every torch file here (torch_files.py): torch's zip format only,
  `torch.load(weights_only=True)`, so no pickled code runs, and a member that holds some (or is a
  legacy pickle or a TorchScript archive) is refused as such.

What Megatron varies in the stored weights is undone here (megatron_ranks.py), so every family
reads one layout: model-parallel archives (`mp_rank_XX/`, `tp_rank_XX_pp_rank_XXX/`) are merged into
one rank, megatron_amp_O2's `.module.` infix is dropped, megatron_legacy's fused QKV is regrouped
per head and TransformerEngine `_extra_state` entries are skipped (`Checkpoint.skipped`).
"""

from __future__ import annotations

import posixpath
import tarfile
import zlib
from pathlib import Path
from typing import Any

from .base import (
    MAX_SIDE_FILE_BYTES,
    Checkpoint,
    CheckpointError,
    CheckpointPath,
    CheckpointReader,
    register_reader,
)
from .bounded_tar import RefusedArchive, looks_like_tar, open_archive, read_member, safe_members
from .bounded_yaml import MAX_CONFIG_BYTES, parse_yaml_mapping
from .megatron_ranks import Rank, check_grid, find_ranks, merge_ranks, regroup_legacy_qkv, strip_module_infix
from .torch_files import load_torch_weights

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"
ARTIFACT_PREFIX = "nemo:"


def _load_weights(tar: tarfile.TarFile, member: tarfile.TarInfo, source: str) -> tuple[dict[str, Any], dict[str, str]]:
    handle = tar.extractfile(member)
    assert handle is not None
    return load_torch_weights(handle, source)


def _canonical(weights: dict[str, Any], config: dict[str, Any], tensor_size: int, source: str, archive: Path
               ) -> dict[str, Any]:
    """One rank's weights in the layout families read: no `.module.` infix, fused QKV per head
    (`megatron_legacy` archives store [all q; all k; all v]: regrouped over this rank's heads)."""
    weights = strip_module_infix(weights)
    sections = ("encoder", "decoder")
    if any(bool(config_setting(config, "megatron_legacy", section, False)) for section in (None, *sections)):
        def heads_of(key: str) -> int:
            section = next((name for name in sections if f".{name}." in f".{key}"), None)
            heads = config_setting(config, "num_attention_heads", section, None)
            if not isinstance(heads, int) or heads < 1:
                raise CheckpointError(f"{archive}:{CONFIG_NAME}: num_attention_heads is {heads!r}; megatron_legacy's "
                                      "fused QKV is regrouped per head, so the number of heads is needed")
            if heads % tensor_size:
                raise CheckpointError(f"{source}: {heads} attention heads do not divide among {tensor_size} "
                                      "tensor-parallel ranks")
            return heads // tensor_size

        regroup_legacy_qkv(weights, heads_of, source)
    return weights


def _read_weights(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], config: dict[str, Any], path: Path
                  ) -> tuple[dict[str, Any], dict[str, str], dict[str, int]]:
    """(weights, entries skipped, parallel layout) of the archive: one `model_weights.ckpt`, or
    one per rank folder, merged."""
    ranks = find_ranks(members, WEIGHTS_NAME)
    if not ranks:
        weights_member = next((name for name in members if posixpath.basename(name) == WEIGHTS_NAME), None)
        if weights_member is None:
            raise CheckpointError(f"{path} has no {WEIGHTS_NAME}; a .nemo checkpoint holds {CONFIG_NAME} and "
                                  f"{WEIGHTS_NAME} (or one per rank folder, mp_rank_XX/{WEIGHTS_NAME})")
        source = f"{path}:{WEIGHTS_NAME}"
        weights, skipped = _load_weights(tar, members[weights_member], source)
        return _canonical(weights, config, 1, source, path), skipped, {}
    tensor, pipeline = check_grid(ranks, config, str(path))
    skipped: dict[str, str] = {}

    def load(rank: Rank, name: str) -> dict[str, Any]:
        source = f"{path}:{name}"
        weights, rank_skipped = _load_weights(tar, members[name], source)
        skipped.update({f"{rank.folder}/{key}": why for key, why in rank_skipped.items()})
        return _canonical(weights, config, tensor, source, path)

    weights, duplicates = merge_ranks(ranks, load, str(path))
    return weights, {**skipped, **duplicates}, {"tensor": tensor, "pipeline": pipeline}


@register_reader
class NemoReader(CheckpointReader):
    form = "nemo"
    description = "a BioNeMo/NeMo .nemo archive (model_config.yaml + model_weights.ckpt, plain or gzip tar)"

    def describe(self, checkpoint: Checkpoint) -> str:
        ranks = " x ".join(f"{size} {kind}" for kind, size in checkpoint.parallel.items())
        merged = f", merged from {ranks} parallel ranks" if ranks else ""
        return f".nemo archive ({checkpoint.model_class or 'no target'}{merged})"

    def recognizes(self, found: CheckpointPath) -> bool:
        path = found.path
        return path.is_file() and (path.suffix == ".nemo" or looks_like_tar(path))

    def read(self, found: CheckpointPath) -> Checkpoint:
        path = found.path
        try:
            with open_archive(path) as tar:
                members = safe_members(tar, path)
                config_member = next((m for name, m in members.items() if posixpath.basename(name) == CONFIG_NAME),
                                     None)
                if config_member is None:
                    raise CheckpointError(f"{path} has no {CONFIG_NAME}; a .nemo checkpoint holds "
                                          f"{CONFIG_NAME} and {WEIGHTS_NAME}")
                # One byte over the limit is enough to refuse it, whatever the header declares.
                config = parse_yaml_mapping(read_member(tar, config_member, MAX_CONFIG_BYTES + 1),
                                            f"{path}:{CONFIG_NAME}")
                weights, skipped, parallel = _read_weights(tar, members, config, path)
                files = {
                    posixpath.basename(name): read_member(tar, member)
                    for name, member in members.items()
                    if posixpath.basename(name) not in (CONFIG_NAME, WEIGHTS_NAME)
                    and member.size <= MAX_SIDE_FILE_BYTES
                }
        except RefusedArchive as err:
            raise CheckpointError(f"{path}: {err}; refusing the archive") from None
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            reason = str(err).splitlines()[0].rstrip(":")  # tarfile lists every method it tried
            raise CheckpointError(f"{path} is not a readable .nemo archive (plain or gzip tar): {reason}") from None
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=WEIGHTS_NAME,
                          files=files, model_class=config.get("target"), skipped=skipped, parallel=parallel)


# ---------------------------------------------------------------- helpers for families
def config_setting(config: dict[str, Any], key: str, section: str | None = None, default: Any = ...) -> Any:
    """A model_config.yaml setting: from the nested `section` (encoder:/decoder:, newer NeMo
    configs) when it has it, else the flat top level; KeyError when absent and no default."""
    nested = config.get(section) if section else None
    if isinstance(nested, dict) and key in nested:
        return nested[key]
    if key in config:
        return config[key]
    if default is not ...:
        return default
    raise KeyError(f"{section}.{key} or {key}" if section else key)


def setting(checkpoint: Checkpoint, key: str, section: str | None = None, default: Any = ...) -> Any:
    """`config_setting` of a checkpoint's model_config.yaml; CheckpointError naming the file when
    the setting is absent and there is no default."""
    try:
        return config_setting(checkpoint.config, key, section, default)
    except KeyError as err:
        raise CheckpointError(f"{checkpoint.path}:{CONFIG_NAME} has no {err.args[0]}") from None


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
    from bionemo_export.serving.tokenizers.sentencepiece_vocab import read_pieces

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
