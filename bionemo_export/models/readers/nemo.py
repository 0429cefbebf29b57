"""The BioNeMo / NeMo `.nemo` form, read without NeMo or Megatron installed.

A `.nemo` file is a tar archive (plain, or gzip in older files) holding `model_config.yaml` (the
training config's `model:` section), `model_weights.ckpt` (a torch state dict) and tokenizer
artifacts stored as `<uuid>_<name>` and referenced from the YAML as `nemo:<uuid>_<name>`.

Reading is defensive, bounded in time and memory whatever the archive holds:
- the archive is never extracted to disk; members with absolute or `..` paths, links, devices and
  sparse files are refused; the declared sizes are bounded, and so is what a gzip'd archive
  expands to (headers included), checked member by member before tarfile skips to the next one;
- tar extension headers (GNU long names, pax records) are bounded before tarfile reads them
  (`_BoundedTarInfo`): tarfile itself reads a header's whole declared payload into memory;
- `model_config.yaml` is bounded in size, nesting and size with its aliases expanded, checked
  while it is composed, before anything is built (`_BoundedYaml`);
- the weights are read with `torch.load(weights_only=True)`, so no pickled code runs, and a file
  that holds some is refused as such.

What Megatron varies in the stored weights is undone here (megatron_ranks.py), so every family
reads one layout: model-parallel archives (`mp_rank_XX/`, `tp_rank_XX_pp_rank_XXX/`) are merged into
one rank, megatron_amp_O2's `.module.` infix is dropped, megatron_legacy's fused QKV is regrouped
per head and TransformerEngine `_extra_state` entries are skipped (`Checkpoint.skipped`).
"""

from __future__ import annotations

import io
import os
import posixpath
import tarfile
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from .base import (
    MAX_SIDE_FILE_BYTES,
    Checkpoint,
    CheckpointError,
    CheckpointReader,
    load_torch_weights,
    register_reader,
)
from .megatron_ranks import Rank, check_grid, find_ranks, merge_ranks, regroup_legacy_qkv, strip_module_infix

CONFIG_NAME = "model_config.yaml"
WEIGHTS_NAME = "model_weights.ckpt"
ARTIFACT_PREFIX = "nemo:"
MAX_MEMBERS = 10_000
MAX_UNPACKED_BYTES = int(os.environ.get("BIONEMO_EXPORT_NEMO_MAX_BYTES", 256 << 30))
"""Most bytes a .nemo may declare in all (the largest BioNeMo models are ~12 GB)."""
MAX_EXPANSION = 20
"""Most a gzip'd archive may expand relative to its size (weights compress by ~10%, not 20x)."""
MAX_NAME_BYTES = 4096
"""Longest member name (or link target) in bytes: PATH_MAX; NeMo's are `<uuid>_<file>`."""
MAX_PAX_HEADER_BYTES = 64 << 10
"""Largest pax extended header ('x'/'g'); Python's tarfile writes a few hundred bytes per member."""
MAX_HEADER_BYTES_IN_ALL = 1 << 20
"""Most bytes of extension headers (long names, pax records) in a whole archive."""
MAX_HEADERS_IN_A_ROW = 8
"""Most extension headers before one member (tarfile writes at most two: a long name and a long link)."""
MAX_PAX_RECORDS = 64
"""Most pax records that apply to one member (tarfile copies global ones into every member)."""
MAX_CONFIG_BYTES = 1 << 20
"""Largest model_config.yaml; NeMo's are a few KB."""
MAX_CONFIG_DEPTH = 64
"""Deepest nesting of model_config.yaml's mappings and lists; NeMo's nest about 5 deep."""
MAX_CONFIG_VALUES = 20_000
"""Most values (scalars, mappings, lists) in model_config.yaml with every alias expanded; NeMo's have
a few hundred. Bounds "billion laughs" documents, whose aliases multiply a few lines into billions."""
MAX_NUMBER_CHARS = 100
"""Longest integer in model_config.yaml, in characters (YAML 1.1's base-60 integers cost quadratic time)."""


# ------------------------------------------------------------------------------- the tar archive
class _RefusedArchive(Exception):
    """A header that the bounded tar reader refuses; `NemoReader.read` names the archive. Not a
    TarError (tarfile.open would try the next compression and hide it) nor an OSError (gzopen
    would turn it into "not a gzip file")."""


def _shown_name(name: str) -> str:
    """A member name for a message: quoted on one line, at most 80 characters."""
    return repr(name if len(name) <= 80 else name[:80] + "...")


def _name_bytes(name: str) -> int:
    return len(name.encode("utf-8", "surrogateescape"))


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's TarInfo with every header bounded before tarfile reads what it declares.

    TarFile reads a GNU long name ('L'/'K') or a pax header ('x'/'g') whole into memory and
    follows chains of them recursively; sparse members make it read maps of any length. These
    private hooks of tarfile (checked to exist by `_open_archive`) refuse them first."""

    def _proc_member(self, archive: _BoundedTarFile) -> tarfile.TarInfo:
        if self.size < 0:
            raise _RefusedArchive(f"member {_shown_name(self.name)} declares a negative size")
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise _RefusedArchive(f"member {_shown_name(self.name)} is a sparse file")
        if self.type in _EXTENSION_TYPES:
            _count_extension_header(self, archive)
        else:
            archive.headers_in_a_row = 0
        try:
            member = super()._proc_member(archive)  # pyright: ignore[reportAttributeAccessIssue] - tarfile's private hook
        except (ValueError, IndexError) as err:  # tarfile's parsers assume well-formed numbers and maps
            reason = " ".join(str(err).split())[:200]
            raise _RefusedArchive(f"malformed tar header near byte {self.offset} ({reason})") from None
        _check_member(member)
        return member

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str, errors: str) -> None:
        if len(pax_headers) > MAX_PAX_RECORDS:
            raise _RefusedArchive(f"member {_shown_name(self.name)} has {len(pax_headers)} pax records "
                                  f"(the most a member may have is {MAX_PAX_RECORDS})")
        super()._apply_pax_info(pax_headers, encoding, errors)  # pyright: ignore[reportAttributeAccessIssue] - private

    def _refuse_sparse(self, next_member: tarfile.TarInfo, *args: Any) -> None:
        raise _RefusedArchive(f"member {_shown_name(next_member.name)} is a sparse file (pax GNU.sparse records)")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _refuse_sparse


_EXTENSION_TYPES = {tarfile.GNUTYPE_LONGNAME: "GNU long name", tarfile.GNUTYPE_LONGLINK: "GNU long link name",
                    tarfile.XHDTYPE: "pax extended header", tarfile.XGLTYPE: "pax global header",
                    tarfile.SOLARIS_XHDTYPE: "Solaris extended header"}
_TAR_HOOKS = ("_proc_member", "_apply_pax_info", "_proc_gnusparse_00", "_proc_gnusparse_01", "_proc_gnusparse_10")
"""The private TarInfo methods that `_BoundedTarInfo` overrides; without them it bounds nothing."""


def _count_extension_header(header: tarfile.TarInfo, archive: _BoundedTarFile) -> None:
    """Refuse an extension header whose payload, or the archive's in all, is over the limits,
    before tarfile reads the payload."""
    kind = _EXTENSION_TYPES[header.type]
    is_name = header.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK)
    limit = MAX_NAME_BYTES + 1 if is_name else MAX_PAX_HEADER_BYTES  # a long name ends with a NUL
    if header.size > limit:
        what = "member names" if is_name else "pax headers"
        raise _RefusedArchive(f"a {kind} at byte {header.offset} declares {header.size} bytes "
                              f"(the most for {what} is {limit})")
    archive.headers_in_a_row += 1
    if archive.headers_in_a_row > MAX_HEADERS_IN_A_ROW:
        raise _RefusedArchive(f"more than {MAX_HEADERS_IN_A_ROW} extension headers in a row at byte {header.offset}")
    archive.header_bytes += header.size
    if archive.header_bytes > MAX_HEADER_BYTES_IN_ALL:
        raise _RefusedArchive(f"its extension headers (long names, pax records) hold more than "
                              f"{MAX_HEADER_BYTES_IN_ALL} bytes in all")


def _check_member(member: tarfile.TarInfo) -> None:
    """Refuse a member (as extension headers left it) with an over-long name or a negative size."""
    for what, name in (("name", member.name), ("link target", member.linkname)):
        if _name_bytes(name) > MAX_NAME_BYTES:
            raise _RefusedArchive(f"a member's {what} is {_name_bytes(name)} bytes long "
                                  f"(the most is {MAX_NAME_BYTES}): {_shown_name(name)}")
    if member.size < 0:
        raise _RefusedArchive(f"member {_shown_name(member.name)} declares a negative size")


class _BoundedTarFile(tarfile.TarFile):
    """A TarFile that reads members as `_BoundedTarInfo` and keeps the counts they check."""

    tarinfo = _BoundedTarInfo
    headers_in_a_row = 0
    """Extension headers read since the last member."""
    header_bytes = 0
    """Bytes of extension headers read so far."""


def _open_archive(path: Path) -> tarfile.TarFile:
    """`path` opened for reading (plain or compressed) with every header bounded."""
    if missing := [hook for hook in _TAR_HOOKS if not hasattr(tarfile.TarInfo, hook)]:
        raise CheckpointError(f"cannot read {path} safely: this Python's tarfile has no {', '.join(missing)}, which "
                              "the .nemo reader overrides to bound tar headers; use Python 3.10 to 3.13")
    return _BoundedTarFile.open(path, "r:*")


def _looks_like_tar(path: Path) -> bool:
    """tarfile.is_tarfile, bounded: whether `path` opens as a (possibly compressed) tar archive."""
    try:
        with _open_archive(path):
            return True
    except _RefusedArchive:
        return True  # a tar archive all the same; `read` refuses it with the reason
    except (tarfile.TarError, EOFError, zlib.error):  # what tarfile.is_tarfile answers False to
        return False


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
    compressed = archive.stat().st_size
    most_unpacked = MAX_EXPANSION * max(compressed, 1 << 20)
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
        # Checked before tarfile moves on: reaching the next header decompresses everything up to
        # tar.offset, which counts the headers as well as the declared content.
        unpacked = max(total, tar.offset)
        if unpacked > most_unpacked:
            raise CheckpointError(f"{archive} ({compressed} bytes) declares {unpacked} bytes of content: "
                                  "a decompression bomb, not a checkpoint; refusing it")
        files[name] = member
    return files


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo, most: int = -1) -> bytes:
    """The member's content, or its first `most` bytes."""
    handle = tar.extractfile(member)
    assert handle is not None  # regular files always have content
    return handle.read(most)


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

    def recognizes(self, path: Path) -> bool:
        return path.is_file() and (path.suffix == ".nemo" or _looks_like_tar(path))

    def read(self, path: Path) -> Checkpoint:
        try:
            with _open_archive(path) as tar:
                members = _safe_members(tar, path)
                config_member = next((m for name, m in members.items() if posixpath.basename(name) == CONFIG_NAME),
                                     None)
                if config_member is None:
                    raise CheckpointError(f"{path} has no {CONFIG_NAME}; a .nemo checkpoint holds "
                                          f"{CONFIG_NAME} and {WEIGHTS_NAME}")
                # One byte over the limit is enough to refuse it, whatever the header declares.
                config = _parse_config(_read(tar, config_member, MAX_CONFIG_BYTES + 1), path)
                weights, skipped, parallel = _read_weights(tar, members, config, path)
                files = {
                    posixpath.basename(name): _read(tar, member)
                    for name, member in members.items()
                    if posixpath.basename(name) not in (CONFIG_NAME, WEIGHTS_NAME)
                    and member.size <= MAX_SIDE_FILE_BYTES
                }
        except _RefusedArchive as err:
            raise CheckpointError(f"{path}: {err}; refusing the archive") from None
        except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
            reason = str(err).splitlines()[0].rstrip(":")  # tarfile lists every method it tried
            raise CheckpointError(f"{path} is not a readable .nemo archive (plain or gzip tar): {reason}") from None
        return Checkpoint(path=path, form=self.form, config=config, weights=weights, weights_name=WEIGHTS_NAME,
                          files=files, model_class=config.get("target"), skipped=skipped, parallel=parallel)


# ---------------------------------------------------------------------------- model_config.yaml
class _RefusedConfig(Exception):
    """A model_config.yaml over one of the limits; `_parse_config` names the archive."""


class _BoundedComposer(Composer):
    """yaml's Composer, counting while it composes (before anything is constructed): the nesting
    depth, and the number of values with every alias expanded. yaml shares an aliased node, so
    loading a "billion laughs" is cheap, but merge keys (`<<: [*a, *a]`) are copied out when
    constructed and anything that walks the result (a manifest, a printout) walks the expansion."""

    def __init__(self) -> None:
        super().__init__()
        self.open_sizes: list[int] = []
        """Expanded sizes so far of the collections being composed, outermost first."""
        self.anchored_sizes: dict[int, int] = {}
        """Expanded size of each composed node that has an anchor, by id."""
        self.values = 0
        """Values composed so far with aliases expanded."""

    if TYPE_CHECKING:  # what the Parser (or CParser) this composer is mixed with provides

        def check_event(self, *choices: type[yaml.Event]) -> bool: ...

        def peek_event(self) -> Any: ...  # a yaml.NodeEvent where compose_node peeks

    def _count(self, size: int) -> None:
        self.values += size
        if self.open_sizes:
            self.open_sizes[-1] += size
        if self.values > MAX_CONFIG_VALUES:
            raise _RefusedConfig(f"has more than {MAX_CONFIG_VALUES} values with its aliases (*name) expanded, "
                                 "the most a model config may have (a 'billion laughs' document)")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self.anchored_sizes:  # its anchor's collection is still being composed
                raise _RefusedConfig("has an alias inside the collection it refers to (a recursive structure)")
            self._count(self.anchored_sizes[id(node)])
            return node
        if len(self.open_sizes) >= MAX_CONFIG_DEPTH:
            raise _RefusedConfig(f"nests deeper than {MAX_CONFIG_DEPTH} levels, the most a model config may nest")
        anchor = self.peek_event().anchor
        self._count(1)
        self.open_sizes.append(0)
        try:
            node = super().compose_node(parent, index)
        finally:
            children = self.open_sizes.pop()
        if self.open_sizes:
            self.open_sizes[-1] += children
        if anchor is not None:
            self.anchored_sizes[id(node)] = 1 + children
        return node


def _construct_bounded_int(constructor: SafeConstructor, node: yaml.ScalarNode) -> int:
    if len(node.value) > MAX_NUMBER_CHARS:
        raise _RefusedConfig(f"has an integer of {len(node.value)} characters (the most is {MAX_NUMBER_CHARS})")
    return SafeConstructor.construct_yaml_int(constructor, node)


class _BoundedPythonYaml(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):
    """yaml.SafeLoader with `_BoundedComposer`."""

    def __init__(self, stream: Any) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


# typeshed's add_constructor takes constructors of yaml's own Loader classes only.
_BoundedPythonYaml.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)  # pyright: ignore[reportArgumentType]
_BoundedYaml: type = _BoundedPythonYaml
"""The loader `_parse_config` uses: libyaml's parser where PyYAML has it (yaml.CSafeLoader's own
composer is C code that no hook reaches, so only its parser is used), the pure-Python one otherwise."""

if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class _BoundedLibyaml(_BoundedComposer, CParser, SafeConstructor, Resolver):
        """libyaml's parser (about 50 times faster at scanning) under `_BoundedComposer`, which
        comes first so that its get_single_node and compose_node replace CParser's C ones."""

        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    _BoundedLibyaml.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)  # pyright: ignore[reportArgumentType]
    _BoundedYaml = _BoundedLibyaml


def _parse_config(data: bytes, archive: Path, loader: type | None = None) -> dict[str, Any]:
    """model_config.yaml's mapping, read with `loader` (default `_BoundedYaml`); CheckpointError
    naming `<archive>:model_config.yaml` for YAML that is invalid, over a limit or not a mapping."""
    source = f"{archive}:{CONFIG_NAME}"
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{source} is over {MAX_CONFIG_BYTES} bytes, the most a model config may be "
                              "(NeMo's are a few KB); refusing it")
    try:
        config = yaml.load(io.BytesIO(data), Loader=loader or _BoundedYaml)
    except _RefusedConfig as err:
        raise CheckpointError(f"{source} {err}; refusing it") from None
    except yaml.MarkedYAMLError as err:  # its str() spans lines, with a snippet of the document
        if "maximum nesting depth" in (err.problem or ""):
            # libyaml (PyYAML >= 6.0.2's wheels) stops at ~1,000 levels in its scanner, before the
            # composer's own depth check sees the document: the same refusal, in the same words.
            raise CheckpointError(f"{source} nests deeper than {MAX_CONFIG_DEPTH} levels, the most a model "
                                  "config may nest; refusing it") from None
        mark = err.problem_mark or err.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = ", ".join(part for part in (err.context, err.problem) if part)
        raise CheckpointError(f"{source} is not valid YAML: {problem}{where}") from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: numbers over Python's int-from-string limit
        raise CheckpointError(f"{source} is not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{source} is not a mapping")
    return config


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
