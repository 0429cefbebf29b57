"""A YAML loader bounded in size, nesting and alias expansion, for the model configs checkpoints carry
(`.nemo` archives' model_config.yaml, NeMo 2's context/model.yaml).

Each limit is checked while the document is composed, before anything is built
(`_BoundedComposer`): "billion laughs" aliases, deep nesting, huge integers and oversized files
are refused with a CheckpointError naming the file. On libyaml's parser where PyYAML has it.

Importable without torch: PyYAML and the readers' CheckpointError.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.parser import Parser
from yaml.reader import Reader
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from .base import CheckpointError

MAX_CONFIG_BYTES = 1 << 20
"""Largest model config; NeMo's are a few KB."""
MAX_CONFIG_DEPTH = 64
"""Deepest nesting of a model config's mappings and lists; NeMo's nest about 5 deep."""
MAX_CONFIG_VALUES = 20_000
"""Most values (scalars, mappings, lists) in a model config with every alias expanded; NeMo's have
a few hundred. Bounds "billion laughs" documents, whose aliases multiply a few lines into billions."""
MAX_NUMBER_CHARS = 100
"""Longest integer in a model config, in characters (YAML 1.1's base-60 integers cost quadratic time)."""


class RefusedConfig(Exception):
    """A document over one of the limits; `parse_yaml_mapping` names the file."""


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
            raise RefusedConfig(f"has more than {MAX_CONFIG_VALUES} values with its aliases (*name) expanded, "
                                 "the most a model config may have (a 'billion laughs' document)")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            node = super().compose_node(parent, index)
            if id(node) not in self.anchored_sizes:  # its anchor's collection is still being composed
                raise RefusedConfig("has an alias inside the collection it refers to (a recursive structure)")
            self._count(self.anchored_sizes[id(node)])
            return node
        if len(self.open_sizes) >= MAX_CONFIG_DEPTH:
            raise RefusedConfig(f"nests deeper than {MAX_CONFIG_DEPTH} levels, the most a model config may nest")
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
        raise RefusedConfig(f"has an integer of {len(node.value)} characters (the most is {MAX_NUMBER_CHARS})")
    return SafeConstructor.construct_yaml_int(constructor, node)


class BoundedPythonYaml(Reader, Scanner, Parser, _BoundedComposer, SafeConstructor, Resolver):
    """yaml.SafeLoader with `_BoundedComposer`."""

    def __init__(self, stream: Any) -> None:
        Reader.__init__(self, stream)
        Scanner.__init__(self)
        Parser.__init__(self)
        _BoundedComposer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


# typeshed's add_constructor takes constructors of yaml's own Loader classes only.
BoundedPythonYaml.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)  # pyright: ignore[reportArgumentType]
BOUNDED_LOADER: type = BoundedPythonYaml
"""The loader `parse_yaml_mapping` uses: libyaml's parser where PyYAML has it (yaml.CSafeLoader's own
composer is C code that no hook reaches, so only its parser is used), the pure-Python one otherwise."""

if yaml.__with_libyaml__:
    from yaml._yaml import CParser

    class BoundedLibyaml(_BoundedComposer, CParser, SafeConstructor, Resolver):
        """libyaml's parser (about 50 times faster at scanning) under `_BoundedComposer`, which
        comes first so that its get_single_node and compose_node replace CParser's C ones."""

        def __init__(self, stream: Any) -> None:
            CParser.__init__(self, stream)
            _BoundedComposer.__init__(self)
            SafeConstructor.__init__(self)
            Resolver.__init__(self)

    BoundedLibyaml.add_constructor("tag:yaml.org,2002:int", _construct_bounded_int)  # pyright: ignore[reportArgumentType]
    BOUNDED_LOADER = BoundedLibyaml


def parse_yaml_mapping(data: bytes, source: str, loader: type | None = None) -> dict[str, Any]:
    """A model config's YAML mapping, read with `loader` (default `BOUNDED_LOADER`); CheckpointError
    naming `source` (e.g. `<archive>:model_config.yaml`) for YAML that is invalid, over a limit or
    not a mapping."""
    if len(data) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{source} is over {MAX_CONFIG_BYTES} bytes, the most a model config may be "
                              "(NeMo's are a few KB); refusing it")
    try:
        config = yaml.load(io.BytesIO(data), Loader=loader or BOUNDED_LOADER)
    except RefusedConfig as err:
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
