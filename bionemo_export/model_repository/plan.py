"""A typed plan of a Triton model repository, checked for consistency, then written to disk.

The plan is what a build decides (models, tensors, batching, ensemble steps, files); `write()`
turns it into folders, `config.pbtxt` files serialized from Triton's `ModelConfig` protobuf, and
the version folders' files. `validate()` catches what Triton would only report at load time, or
not at all: an ensemble step naming a tensor nobody produces, mismatched dtypes or shapes between
steps, an ensemble allowing larger batches than a model it calls.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.errors import UserError
from bionemo_export.tensors import Dim, DType, TensorSpec

from .pbtxt import write_config


class PlanError(UserError, ValueError):
    """The repository plan is inconsistent; the message names the model and tensor."""


def data_type(tensor: TensorSpec) -> int:
    """The tensor's type as ModelConfig's DataType number."""
    return mc.DataType.Value(tensor.dtype.config)


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's dynamic batcher for one model, with its admission control: at most
    `max_queue_size` requests wait (0: no bound) and none waits longer than
    `queue_timeout_microseconds` (0: no bound); Triton answers the others at once with
    UNAVAILABLE (HTTP 503), also through the ensembles that call the model."""

    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 0
    queue_timeout_microseconds: int = 0

    def __post_init__(self) -> None:
        for name in ("max_queue_delay_microseconds", "max_queue_size", "queue_timeout_microseconds"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)}")

    def write(self, config: mc.ModelConfig) -> None:
        """Fill `config.dynamic_batching`."""
        batching = config.dynamic_batching
        batching.preferred_batch_size.extend(self.preferred_batch_sizes)
        batching.max_queue_delay_microseconds = self.max_queue_delay_microseconds
        if self.max_queue_size or self.queue_timeout_microseconds:
            policy = batching.default_queue_policy
            policy.max_queue_size = self.max_queue_size
            policy.default_timeout_microseconds = self.queue_timeout_microseconds
            policy.timeout_action = mc.ModelQueuePolicy.REJECT
            policy.allow_timeout_override = True  # a client may ask for less (its request's `timeout`)

    @classmethod
    def read(cls, config: mc.ModelConfig) -> DynamicBatching:
        """The batcher a written config holds."""
        batching = config.dynamic_batching
        policy = batching.default_queue_policy
        return cls(tuple(batching.preferred_batch_size), batching.max_queue_delay_microseconds,
                   policy.max_queue_size, policy.default_timeout_microseconds)


@dataclass(frozen=True)
class EnsembleStep:
    """One call inside an ensemble: maps the model's tensor names to ensemble tensor names."""

    model: str
    input_map: dict[str, str]
    output_map: dict[str, str]


@dataclass
class ModelPlan:
    """One model folder of the repository."""

    name: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int
    backend: str | None = None  # "python"
    platform: str | None = None  # "onnxruntime_onnx", "tensorrt_plan", "ensemble"
    instance_count: int = 1
    instance_kind: int = mc.ModelInstanceGroup.KIND_CPU
    profiles: tuple[str, ...] = ()
    """TensorRT: the optimization profiles the instances may use (Triton picks one that fits
    each batch; without the list it uses profile 0 only)."""
    dynamic_batching: DynamicBatching | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    response_cache: bool = False
    default_model_filename: str | None = None
    steps: list[EnsembleStep] = field(default_factory=list)
    files: dict[str, Path | str | bytes] = field(default_factory=dict)
    """Version-folder files: relative name -> a Path to copy, or text/bytes to write."""
    warmup: list[mc.ModelWarmup] = field(default_factory=list)
    description: str = ""

    @property
    def is_ensemble(self) -> bool:
        return self.platform == "ensemble"

    @classmethod
    def public_python(cls, task: Any, prefix: str, role: Any, max_batch_size: int, *, parameters: dict[str, str],
                      files: dict[str, Path | str | bytes], description: str) -> ModelPlan:
        """A task's public model run by the Python backend (tasks.Task `task`, served as
        `<prefix>_<task>`): its tensors from the task table, its instances and batcher from `role`
        (options.RoleOptions), its settings in `parameters` and its code in `files`."""
        return cls(name=task.model(prefix),
                   inputs=[TensorSpec(t.name, t.dtype, t.shape(), optional=t.optional, ragged=t.ragged)
                           for t in task.inputs],
                   outputs=[TensorSpec(t.name, t.dtype, t.shape()) for t in task.outputs],
                   max_batch_size=max_batch_size, backend="python", instance_count=role.instances,
                   dynamic_batching=role.batching, parameters=parameters, files=files, description=description)

    def tensor(self, name: str, *, output: bool) -> TensorSpec | None:
        for tensor in self.outputs if output else self.inputs:
            if tensor.name == name:
                return tensor
        return None

    def to_config(self) -> mc.ModelConfig:
        """The ModelConfig protobuf Triton reads from config.pbtxt."""
        config = mc.ModelConfig(name=self.name, max_batch_size=self.max_batch_size)
        if self.backend:
            config.backend = self.backend
        if self.platform:
            config.platform = self.platform
        if self.default_model_filename:
            config.default_model_filename = self.default_model_filename
        for tensor in self.inputs:
            config.input.append(mc.ModelInput(name=tensor.name, data_type=data_type(tensor),
                                              dims=list(tensor.dims), optional=tensor.optional,
                                              allow_ragged_batch=tensor.ragged))
        for tensor in self.outputs:
            config.output.append(mc.ModelOutput(name=tensor.name, data_type=data_type(tensor),
                                                dims=list(tensor.dims)))
        if self.is_ensemble:
            for step in self.steps:
                config.ensemble_scheduling.step.append(mc.ModelEnsembling.Step(
                    model_name=step.model, model_version=-1,
                    input_map=step.input_map, output_map=step.output_map,
                ))
        else:
            config.instance_group.append(mc.ModelInstanceGroup(kind=self.instance_kind, count=self.instance_count,
                                                               profile=list(self.profiles)))
        if self.dynamic_batching is not None:
            self.dynamic_batching.write(config)
        for key, value in self.parameters.items():
            config.parameters[key].string_value = value
        if self.response_cache:
            config.response_cache.enable = True
        config.model_warmup.extend(self.warmup)
        return config


    @classmethod
    def from_config(cls, config: mc.ModelConfig) -> ModelPlan:
        """The plan of a written config (files aside): what the consistency checks read back."""
        def tensors(entries) -> list[TensorSpec]:
            return [TensorSpec(t.name, DType.of(mc.DataType.Name(t.data_type)), tuple(t.dims),
                               optional=getattr(t, "optional", False), ragged=getattr(t, "allow_ragged_batch", False))
                    for t in entries]

        group = config.instance_group[0] if config.instance_group else None
        batching = DynamicBatching.read(config) if config.HasField("dynamic_batching") else None
        return cls(
            name=config.name, inputs=tensors(config.input), outputs=tensors(config.output),
            max_batch_size=config.max_batch_size, backend=config.backend or None,
            platform=config.platform or None,
            instance_count=group.count if group else 1,
            instance_kind=group.kind if group else mc.ModelInstanceGroup.KIND_CPU,
            profiles=tuple(group.profile) if group else (),
            dynamic_batching=batching,
            parameters={key: value.string_value for key, value in config.parameters.items()},
            response_cache=config.response_cache.enable,
            default_model_filename=config.default_model_filename or None,
            steps=[EnsembleStep(step.model_name, dict(step.input_map), dict(step.output_map))
                   for step in config.ensemble_scheduling.step],
        )


def _dims_compatible(a: tuple[Dim, ...], b: tuple[Dim, ...]) -> bool:
    return len(a) == len(b) and all(x == y or x == -1 or y == -1 for x, y in zip(a, b))


@dataclass
class RepositoryPlan:
    models: list[ModelPlan]

    def model(self, name: str) -> ModelPlan:
        for model in self.models:
            if model.name == name:
                return model
        raise PlanError(f"no model named {name!r} in the plan")

    def validate(self) -> None:
        """Raise PlanError on the first inconsistency."""
        names = [m.name for m in self.models]
        duplicates = {n for n in names if names.count(n) > 1}
        if duplicates:
            raise PlanError(f"model names used twice: {sorted(duplicates)}")
        for model in self.models:
            if model.max_batch_size < 0:
                raise PlanError(f"{model.name}: max_batch_size must be >= 0")
            if model.dynamic_batching and any(
                size > model.max_batch_size for size in model.dynamic_batching.preferred_batch_sizes
            ):
                raise PlanError(f"{model.name}: a preferred batch size exceeds max_batch_size {model.max_batch_size}")
            if model.is_ensemble:
                self._validate_ensemble(model)

    def _validate_ensemble(self, ensemble: ModelPlan) -> None:
        # Tensors available so far: ensemble inputs, then each step's outputs in order.
        available: dict[str, TensorSpec] = {t.name: t for t in ensemble.inputs}
        for step in ensemble.steps:
            where = f"ensemble {ensemble.name}, step {step.model}"
            target = self.model(step.model)
            if target.max_batch_size < ensemble.max_batch_size:
                raise PlanError(f"{where}: max_batch_size {ensemble.max_batch_size} exceeds the model's "
                                f"{target.max_batch_size}")
            for model_input, ensemble_tensor in step.input_map.items():
                wanted = target.tensor(model_input, output=False)
                if wanted is None:
                    raise PlanError(f"{where}: the model has no input {model_input!r}")
                have = available.get(ensemble_tensor)
                if have is None:
                    raise PlanError(f"{where}: ensemble tensor {ensemble_tensor!r} is not produced before this step")
                self._check_match(where, ensemble_tensor, have, wanted)
            for model_input in (t.name for t in target.inputs if not t.optional):
                if model_input not in step.input_map:
                    raise PlanError(f"{where}: required input {model_input!r} is not mapped")
            for model_output, ensemble_tensor in step.output_map.items():
                produced = target.tensor(model_output, output=True)
                if produced is None:
                    raise PlanError(f"{where}: the model has no output {model_output!r}")
                if ensemble_tensor in available:
                    raise PlanError(f"{where}: ensemble tensor {ensemble_tensor!r} is produced twice")
                available[ensemble_tensor] = TensorSpec(ensemble_tensor, produced.dtype, produced.dims)
        for output in ensemble.outputs:
            have = available.get(output.name)
            if have is None:
                raise PlanError(f"ensemble {ensemble.name}: output {output.name!r} is produced by no step")
            self._check_match(f"ensemble {ensemble.name}", output.name, have, output)

    @staticmethod
    def _check_match(where: str, name: str, have: TensorSpec, wanted: TensorSpec) -> None:
        if have.dtype != wanted.dtype:
            raise PlanError(f"{where}: tensor {name!r} is {have.dtype} but {wanted.dtype} is expected")
        if not _dims_compatible(have.dims, wanted.dims):
            raise PlanError(f"{where}: tensor {name!r} has dims {list(have.dims)} but {list(wanted.dims)} is expected")

    def write(self, root: Path, link_from: Path | None = None) -> None:
        """Validate, then write every model folder under `root` (which must exist and be empty).
        Files under `link_from` (a build's own temporary files, on the same file system) are
        hard-linked rather than copied: a graph's weights are then on disk once while the build
        ends (ESM-2 3B: 11 GB not written again); any other file is copied."""
        self.validate()
        for model in self.models:
            model_dir = root / model.name
            version_dir = model_dir / "1"
            version_dir.mkdir(parents=True)
            write_config(model_dir, model.to_config())
            for relative, source in model.files.items():
                destination = version_dir / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                if isinstance(source, Path):
                    _place(source, destination, link_from)
                elif isinstance(source, bytes):
                    destination.write_bytes(source)
                else:
                    destination.write_text(source)


def _place(source: Path, destination: Path, link_from: Path | None) -> None:
    """Hard-link `source` to `destination` when it lies under `link_from`, else copy it (also when
    the file system refuses the link)."""
    if link_from is not None and source.resolve().is_relative_to(link_from.resolve()):
        try:
            os.link(source, destination)
            return
        except OSError:
            pass
    shutil.copy2(source, destination)
