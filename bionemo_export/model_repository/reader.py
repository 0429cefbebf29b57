"""Read a model repository's models: which are public (a task's model) and which internal, what each
calls (ensemble steps and BLS callees), how long each lets its queue grow, and the tasks served.

One reader for everything that needs these facts: deploy and tune read a repository on disk
(`RepositoryModels.read`); the supervisor, health and bench ask a running server for the same
configurations (Triton's JSON of ModelConfig) and walk them with the same `callees`/`dependencies`.
A configuration is handled as that JSON (proto field names, as Triton's model-config API answers
and `config_json` turns a config.pbtxt into), so both sources go through one walk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import json_format

from bionemo_export.errors import UserError
from bionemo_export.serving.parameters import BLS_MODELS
from bionemo_export.tasks import public_suffixes, task_of

from .manifest import MANIFEST_NAME, Manifest
from .pbtxt import ModelConfig, read_config

PUBLIC_SUFFIXES = public_suffixes()
"""How public model names end (<name>_<task>, bionemo_export/tasks.py); every other model is internal."""

ConfigOf = Callable[[str], "dict | None"]
"""A model's configuration as Triton's JSON (None where the model is unknown): from disk or a server."""


class RepositoryReadError(UserError, ValueError):
    """A repository whose models cannot be read (a config.pbtxt that does not parse); the message
    names the file."""


def is_public(model: str) -> bool:
    """Whether `model` is a task's public model (named <name>_<task>)."""
    return model.endswith(PUBLIC_SUFFIXES)


def config_json(config: ModelConfig) -> dict:
    """A parsed config.pbtxt as Triton's model-config API answers it (proto field names)."""
    return json_format.MessageToDict(config, preserving_proto_field_name=True)


def parameter(config: dict, key: str) -> str | None:
    """A config's string parameter `key` (None when it has none)."""
    value = (config.get("parameters") or {}).get(key)
    return value.get("string_value") if isinstance(value, dict) else None


def callees(config: dict) -> list[str]:
    """The models a configuration calls directly: its ensemble steps, then the BLS callees its
    `bls_models` parameter names (Triton knows the former only)."""
    found = [step["model_name"] for step in (config.get("ensemble_scheduling") or {}).get("step", ())]
    found += [name.strip() for name in (parameter(config, BLS_MODELS) or "").split(",") if name.strip()]
    return list(dict.fromkeys(found))


def dependencies(model: str, config_of: ConfigOf) -> list[str]:
    """Every model `model` calls, directly or through others, each after the models it calls itself:
    the order to load them in. Unknown models (config_of gives None) call nothing."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        for callee in callees(config_of(name) or {}):
            if callee not in order and callee not in path:  # a cycle is Triton's error to report
                visit(callee, (*path, callee))
                order.append(callee)

    visit(model, (model,))
    return order


def queue_limit(config: dict) -> int | None:
    """The most requests a dynamically batched model queues before turning work away (its default
    queue policy's max_queue_size; None: unbounded or not batched)."""
    policy = (config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    size = int(policy.get("max_queue_size", 0) or 0)
    return size or None


@dataclass(frozen=True)
class RepositoryModels:
    """The models of one repository on disk with their configurations (Triton's JSON)."""

    path: Path
    configs: dict[str, dict]
    """Model -> its config.pbtxt as JSON, every folder with a config.pbtxt, sorted by name."""
    manifest: Manifest | None = None
    """manifest.json where the repository has one (built by bionemo-export)."""
    listed_public: tuple[str, ...] = field(default=())

    @classmethod
    def read(cls, path: Path, manifest: Manifest | None = None) -> RepositoryModels:
        """Read every model folder of `path`; `manifest` when the caller read (and checked) it
        already, else manifest.json when present. RepositoryReadError names a config.pbtxt that
        does not parse."""
        from google.protobuf import text_format

        configs = {}
        for folder in sorted(child for child in path.iterdir() if (child / "config.pbtxt").is_file()):
            try:
                configs[folder.name] = config_json(read_config(folder))
            except (OSError, text_format.ParseError) as err:
                raise RepositoryReadError(f"{folder / 'config.pbtxt'} is not a readable Triton model configuration "
                                          f"({err}); rebuild the repository") from None
        if manifest is None and (path / MANIFEST_NAME).is_file():
            manifest = Manifest.read(path)
        listed = tuple(manifest.public_models) if manifest is not None else ()
        return cls(path, configs, manifest, listed)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.configs)

    @property
    def public(self) -> tuple[str, ...]:
        """The models clients call: the manifest's `public_models`, else those named like a task's."""
        return self.listed_public or tuple(model for model in self.configs if is_public(model))

    @property
    def internal(self) -> tuple[str, ...]:
        """Every other model: what the public ones call."""
        return tuple(model for model in self.configs if model not in self.public)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks served, from the public models' names."""
        return tuple(dict.fromkeys(task.name for model in self.public if (task := task_of(model)) is not None))

    def config(self, model: str) -> dict | None:
        return self.configs.get(model)

    def runs(self, model: str) -> list[str]:
        """`model` and every model of the repository it runs (ensemble steps and BLS callees),
        itself first, then callees before their callers; a callee without a folder is left out."""
        if model not in self.configs:
            return []
        return [model, *(name for name in dependencies(model, self.config) if name in self.configs)]

    def queue_limits(self, models: Iterable[str] | None = None) -> dict[str, int]:
        """max_queue_size of every model (of `models`, default all) whose config bounds its queue."""
        limits = {}
        for model in self.configs if models is None else models:
            limit = queue_limit(self.configs.get(model) or {})
            if limit:
                limits[model] = limit
        return limits
