"""What `tune` may change in a served model, read from and written to its config.pbtxt.

A tunable model is a batched model that runs a graph: the encoder of the fused layout (instances,
ONNX Runtime threads, token budget, largest sub-batch, queue delay, length bucket, memory arena:
everything its config's `parameters` carry), or any other dynamically batched model (instances, queue delay, and
its thread count when it has one). `Settings` is one point of that space; `axes` the values each
setting may take on this host, in order, so that the search can step to a neighbour.

Nothing here measures: the search (search.py) asks for figures; the session (session.py) serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from bionemo_export.model_repository.pbtxt import ModelConfig

AXES = ("max_sub_batch", "instances", "threads", "token_budget", "queue_delay_us", "length_bucket", "memory_arena")
"""Every setting, in the order the search tries them: the largest sub-batch first (what closes the
gap to in-process ONNX Runtime on a CPU), then how the cores are split, then the rest."""
PARAMETER_OF = {"threads": "intra_op_threads", "token_budget": "token_budget", "max_sub_batch": "max_sub_batch",
                "length_bucket": "length_bucket", "memory_arena": "memory_arena"}
"""Settings kept in the config's `parameters` (the Python-backend models read them at load)."""
TOKEN_BUDGETS = (2048, 4096, 8192, 16384, 32768)
SUB_BATCHES = (1, 2, 4, 8, 0)
"""Most rows per graph call; 0 (no row limit) is the widest, last. Powers of two: the search looks
two steps each way, so from "no limit" it reaches 8 and 4 (a CPU's best is often 2-4 rows, where
the batcher hands over ~11 under load)."""
QUEUE_DELAYS_US = (0, 500, 2000, 10000)
LENGTH_BUCKETS = (8, 16, 32, 64)
MEMORY_ARENAS = ("false", "run", "true")
"""The config parameter `memory_arena`'s values (choices.MemoryArena) by the memory each keeps
after a run, none to the largest run's peak: a setting holds the index (0, 1, 2), so that the
search steps between neighbours as along the other axes."""


@dataclass(frozen=True)
class Settings:
    """One served model's settings (None: the model has no such setting)."""

    instances: int
    queue_delay_us: int
    threads: int | None = None
    """ONNX Runtime intra-op threads per instance (0: "auto", resolved by the server)."""
    token_budget: int | None = None
    max_sub_batch: int | None = None
    length_bucket: int | None = None
    memory_arena: int | None = None
    """Index into MEMORY_ARENAS: 0 no arena, 1 an arena per run, 2 an arena kept."""

    def values(self) -> dict[str, int]:
        """The settings the model has, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def describe(self) -> str:
        """A short form for tables: 'instances 1, threads 2, max_sub_batch 4, ...'."""
        return ", ".join(f"{name} {shown(name, value)}" for name, value in self.values().items())


def shown(name: str, value: int) -> str:
    """A setting's value as tables show it (threads 0: auto; max_sub_batch 0: any)."""
    if name == "threads" and value == 0:
        return "auto"
    if name == "max_sub_batch" and value == 0:
        return "any"
    if name == "memory_arena":
        return MEMORY_ARENAS[value]
    return str(value)


def is_tunable(config: ModelConfig) -> bool:
    """A model the tuner can help: dynamically batched, with instances to split the host among."""
    return config.HasField("dynamic_batching") and config.backend != "" and len(config.instance_group) > 0


def read_settings(config: ModelConfig) -> Settings:
    """The settings `config` holds now."""
    parameters = {key: value.string_value for key, value in config.parameters.items()}
    found: dict[str, Any] = {}
    for name, parameter in PARAMETER_OF.items():
        if parameter in parameters:
            text = parameters[parameter]
            if name == "memory_arena":
                found[name] = MEMORY_ARENAS.index(text) if text in MEMORY_ARENAS else None
            else:
                found[name] = 0 if text in ("auto", "") else int(text)
    return Settings(instances=int(config.instance_group[0].count) or 1,
                    queue_delay_us=int(config.dynamic_batching.max_queue_delay_microseconds), **found)


def write_settings(config: ModelConfig, settings: Settings) -> ModelConfig:
    """A copy of `config` holding `settings` (the fields it does not have stay as they were)."""
    changed = ModelConfig()
    changed.CopyFrom(config)
    changed.instance_group[0].count = settings.instances
    changed.dynamic_batching.max_queue_delay_microseconds = settings.queue_delay_us
    for name, parameter in PARAMETER_OF.items():
        value = getattr(settings, name)
        if value is None:
            continue
        if name == "memory_arena":
            changed.parameters[parameter].string_value = MEMORY_ARENAS[value]
        else:
            changed.parameters[parameter].string_value = "auto" if name == "threads" and value == 0 else str(value)
    return changed


def axes(settings: Settings, cores: int) -> dict[str, tuple[int, ...]]:
    """The values each of the model's settings may take on a host with `cores` cores, ascending;
    the current value is always among them."""
    powers = tuple(sorted({1, 2, 4, 8, 16, 32, cores} & set(range(1, cores + 1))))
    choices = {
        "instances": tuple(v for v in (1, 2, 3, 4, 6, 8) if v <= max(2, cores)),
        "threads": powers,
        "token_budget": TOKEN_BUDGETS,
        "max_sub_batch": SUB_BATCHES,
        "queue_delay_us": QUEUE_DELAYS_US,
        "length_bucket": LENGTH_BUCKETS,
        "memory_arena": tuple(range(len(MEMORY_ARENAS))),
    }
    out = {}
    for name in AXES:
        value = getattr(settings, name)
        if value is None:
            continue
        values = choices[name]
        if name == "threads" and value == 0:  # "auto" stands for its resolution; keep it as a choice
            values = (0, *values)
        elif value not in values:
            values = tuple(sorted({*values, value}, key=lambda v: _order(name, v)))
        out[name] = values
    return out


def _order(name: str, value: int) -> float:
    """Where `value` sits on its axis (0 sub-batch rows = no limit = the widest)."""
    return float("inf") if name == "max_sub_batch" and value == 0 else value


def step(settings: Settings, cores: int, axis: str, direction: int) -> Settings | None:
    """The setting `direction` steps along `axis` (+1: the next value, -2: two back), or None past
    either end."""
    values = axes(settings, cores)[axis]
    index = values.index(getattr(settings, axis)) + direction
    return replace(settings, **{axis: values[index]}) if 0 <= index < len(values) else None


def around(settings: Settings, cores: int, axis: str, radius: int = 2) -> list[Settings]:
    """The settings within `radius` steps along `axis`, nearest first (+1, -1, +2, -2, ...)."""
    found = []
    for distance in range(1, radius + 1):
        for direction in (distance, -distance):
            other = step(settings, cores, axis, direction)
            if other is not None:
                found.append(other)
    return found


def settings_from_dict(data: Mapping[str, Any]) -> Settings:
    """The Settings a report or manifest recorded (`Settings.values()`)."""
    return Settings(**{f.name: data.get(f.name) for f in fields(Settings)})  # type: ignore[arg-type]
