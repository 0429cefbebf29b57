"""Serving backends: what runs an exported graph inside a generated repository, one class each.

| `--backend` | class | a graph model is | devices |
|---|---|---|---|
| `python` | `PythonBackend` | a Python-backend model running ONNX Runtime (any Triton with the Python backend, the embedded CPU server included; the CUDA provider on KIND_GPU instances) | cpu, gpu |
| `native` | `OnnxRuntimeBackend` | Triton's `onnxruntime_onnx` platform (NVIDIA's Triton containers) | cpu, gpu |
| `tensorrt` | `TensorRTBackend` | Triton's `tensorrt_plan` platform: `model.onnx` plus `engine.json` (optimization profiles), turned into `model.plan` by `bionemo-export engines build` where TensorRT is installed | gpu |

The planners (encoder.py, seq2seq.py) describe each graph model as a `GraphModel` (its tensors,
files, role settings and the shapes its callers can send) and hand it to `backend.plan_graph()`;
they never compare backend names. Adding a backend is one class here plus tests.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from tritonclient.grpc import model_config_pb2 as mc

from .plan import ModelPlan

if TYPE_CHECKING:
    from .options import RoleOptions

DEVICES = ("cpu", "gpu")
ENGINE_FILE = "engine.json"
"""The TensorRT model's build recipe in its version folder: ONNX source, precision, profiles."""
PLAN_FILE = "model.plan"


@dataclass(frozen=True)
class ShapeRange:
    """The shapes a graph model's callers can send: each input's axes (a name for a dynamic axis,
    shared by every input naming it) and each dynamic axis's (smallest, largest) size."""

    axes: dict[str, tuple[str | int, ...]]
    sizes: dict[str, tuple[int, int]]
    split_axis: str | None = None
    """The axis whose range is split into several TensorRT profiles (the sequence length: an
    engine tuned for 64 tokens runs short sequences faster than one tuned for 1024)."""
    bucket: int = 16
    """The length bucket the split points are multiples of."""
    opt: dict[str, int] = field(default_factory=dict)
    """The sizes TensorRT tunes its kernels for, per axis (clamped into each profile's range);
    an axis not named here is tuned for its largest size in the profile."""

    def __post_init__(self) -> None:
        named = {axis for axes in self.axes.values() for axis in axes if isinstance(axis, str)}
        missing = named - set(self.sizes)
        if missing:
            raise ValueError(f"no size range for the dynamic axes {sorted(missing)}")
        for axis, (low, high) in self.sizes.items():
            if not 0 <= low <= high:
                raise ValueError(f"axis {axis!r}: bad range {low}..{high}")

    def segments(self) -> list[tuple[int, int]]:
        """The split axis's range cut at 4, 8, 16, ... buckets; the last segment ends at the
        largest size and is at least half as long as the one before it (no profile for 1025-1026
        tokens); one segment when nothing is split."""
        if self.split_axis is None:
            return [(0, 0)]
        low, high = self.sizes[self.split_axis]
        cuts, edge = [], 4 * max(self.bucket, 1)
        while edge + edge // 2 < high:
            if edge >= low:
                cuts.append(edge)
            edge *= 2
        starts = [low] + [cut + 1 for cut in cuts]
        return list(zip(starts, cuts + [high]))

    def profiles(self) -> list[dict[str, dict[str, list[int]]]]:
        """TensorRT optimization profiles covering every shape in range: per profile, per input,
        min/opt/max dims (full shapes, batch axis included: what the engine sees)."""
        result = []
        for start, end in self.segments():
            sizes = dict(self.sizes)
            if self.split_axis is not None:
                sizes[self.split_axis] = (start, end)
            profile = {}
            for name, axes in self.axes.items():
                def dims(pick: Callable[[tuple[int, int], str], int]) -> list[int]:
                    return [axis if isinstance(axis, int) else pick(sizes[axis], axis) for axis in axes]

                profile[name] = {
                    "min": dims(lambda r, a: r[0]),
                    "opt": dims(lambda r, a: min(max(self.opt.get(a, r[1]), r[0]), r[1])),
                    "max": dims(lambda r, a: r[1]),
                }
            result.append(profile)
        return result


@dataclass
class GraphModel:
    """What a planner knows of a model that runs one exported graph; a backend turns it into the
    model's platform, files and parameters."""

    plan: ModelPlan
    """The model so far: name, tensors, max_batch_size, batching. The backend completes it."""
    role: RoleOptions
    what: str
    """What the graph computes, for descriptions: "encoder", "decoder step"."""
    onnx_files: dict[str, Path]
    """Version-folder name -> exported file (model.onnx and its external data, if any)."""
    shapes: ShapeRange
    python_model: Callable[[], str]
    """The model.py source that runs the graph in the Python backend (rendered on demand)."""
    python_files: dict[str, Path | str] = field(default_factory=dict)
    """Further version-folder files that model.py imports."""
    python_parameters: dict[str, str] = field(default_factory=dict)
    """Config parameters model.py reads, beyond the ONNX Runtime session's."""
    warmup: bool = False
    """Native backends: warm the model up with one all-zero request at load."""


class ServingBackend(ABC):
    """Where a graph model runs. Subclasses set the class attributes and `plan_graph`."""

    name: ClassVar[str]
    help: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = DEVICES
    default_device: ClassVar[str] = "cpu"
    triton_backend: ClassVar[str]
    """The tritonserver backend that must be installed to load its graph models."""
    runs_python: ClassVar[bool] = False
    """Graphs run inside Python-backend models, so the encoder model may tokenize (fused layout)."""

    def __init__(self, device: str | None = None) -> None:
        device = device or self.default_device
        if device not in DEVICES:
            raise ValueError(f"--device {device!r}: choose one of {', '.join(DEVICES)}")
        if device not in self.devices:
            raise ValueError(f"--backend {self.name} runs on {' or '.join(self.devices)}, not {device}: "
                             f"pass --device {self.devices[0]}")
        self.device = device

    @property
    def instance_kind(self) -> int:
        """Triton's instance kind for the models that run graphs."""
        return mc.ModelInstanceGroup.KIND_GPU if self.device == "gpu" else mc.ModelInstanceGroup.KIND_CPU

    @property
    def stores_cpu_optimized_graphs(self) -> bool:
        """Whether the build may store graphs rewritten by ONNX Runtime's CPU optimizer (contrib
        operators, CPU-specific fusions). TensorRT parses standard ONNX only, and a GPU execution
        provider optimizes the plain graph for itself."""
        return self.device == "cpu"

    @abstractmethod
    def plan_graph(self, graph: GraphModel) -> ModelPlan:
        """Complete `graph.plan`: platform or backend, files, parameters, instance kind."""

    def _place(self, plan: ModelPlan, role: RoleOptions) -> None:
        plan.instance_count = role.instances
        plan.instance_kind = self.instance_kind


class PythonBackend(ServingBackend):
    name = "python"
    help = "ONNX Runtime inside a Python-backend model (any Triton with the Python backend)"
    triton_backend = "python"
    runs_python = True

    def plan_graph(self, graph: GraphModel) -> ModelPlan:
        plan = graph.plan
        self._place(plan, graph.role)
        plan.backend = "python"
        plan.files.update(graph.onnx_files)
        plan.files.update(graph.python_files)
        plan.files["model.py"] = graph.python_model()
        plan.parameters.update(graph.role.session_parameters())
        plan.parameters.update(graph.python_parameters)
        plan.description = f"{graph.what} (ONNX Runtime in the Python backend" + (
            ", CUDA provider)" if self.device == "gpu" else ")")
        return plan


class TritonRuntimeBackend(ServingBackend):
    """A backend whose graph models run on one of Triton's own platforms: the config names the
    platform and the model file, the version folder holds the exported graph, and a warmup request
    runs at load. Subclasses add their platform's settings in `configure`."""

    platform: ClassVar[str]
    model_file: ClassVar[str]

    def plan_graph(self, graph: GraphModel) -> ModelPlan:
        plan = graph.plan
        self._place(plan, graph.role)
        plan.platform = self.platform
        plan.default_model_filename = self.model_file
        plan.files.update(graph.onnx_files)
        if graph.warmup:
            plan.warmup = [zero_warmup(plan, graph.shapes)]
        plan.description = f"{graph.what} ({self.platform}, {self.configure(plan, graph)})"
        return plan

    @abstractmethod
    def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
        """Add the platform's own settings and files to `plan`; the description's detail."""


class OnnxRuntimeBackend(TritonRuntimeBackend):
    name = "native"
    help = "Triton's onnxruntime_onnx platform (NVIDIA's Triton containers)"
    triton_backend = "onnxruntime"
    platform = "onnxruntime_onnx"
    model_file = "model.onnx"

    def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
        if graph.role.threads:
            plan.parameters["intra_op_thread_count"] = str(graph.role.threads)
        return self.device.upper()


class TensorRTBackend(TritonRuntimeBackend):
    name = "tensorrt"
    help = ("Triton's tensorrt_plan platform; `bionemo-export engines build REPO` makes the engines where "
            "TensorRT is installed")
    devices = ("gpu",)
    default_device = "gpu"
    triton_backend = "tensorrt"
    platform = "tensorrt_plan"
    model_file = PLAN_FILE
    precision = "fp16"
    """The engines' precision (`engines build --precision` overrides it)."""

    def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
        # model.onnx stays beside the plan: it is the engine's source, parsed by `engines build`.
        profiles = graph.shapes.profiles()
        plan.profiles = tuple(str(index) for index in range(len(profiles)))
        plan.files[ENGINE_FILE] = engine_json({"onnx": "model.onnx", "plan": PLAN_FILE, "precision": self.precision,
                                               "profiles": profiles, "built": None})
        return f"{len(profiles)} optimization profiles"


BACKENDS: dict[str, type[ServingBackend]] = {cls.name: cls for cls in (PythonBackend, OnnxRuntimeBackend,
                                                                       TensorRTBackend)}


def get_backend(name: str, device: str | None = None) -> ServingBackend:
    """The backend `name` ("python", "native", "tensorrt") placing its graph models on `device`
    (its default when None)."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"--backend {name!r}: choose one of {', '.join(BACKENDS)}") from None
    return cls(device)


def engine_json(recipe: dict) -> str:
    """`engine.json` text: indented, with each dims list on one line ("min": [1, 64])."""
    text = json.dumps(recipe, indent=2)
    return re.sub(r"\[\s*(-?\d+(?:,\s*-?\d+)*)\s*\]",
                  lambda m: "[" + ", ".join(v.strip() for v in m.group(1).split(",")) + "]", text) + "\n"


def zero_warmup(plan: ModelPlan, shapes: ShapeRange, length: int = 16) -> mc.ModelWarmup:
    """One all-zero request of batch 1 (token id 0 is a valid special token in every vocabulary
    here), each dynamic axis at `length` within its range."""
    warmup = mc.ModelWarmup(name="zeros", batch_size=1)
    for tensor in plan.inputs:
        axes = shapes.axes[tensor.name]
        if plan.max_batch_size:  # the batch axis is the warmup's batch_size
            axes = axes[1:]
        dims = [axis if isinstance(axis, int) else min(max(length, shapes.sizes[axis][0]), shapes.sizes[axis][1])
                for axis in axes]
        warmup.inputs[tensor.name].data_type = tensor.data_type
        warmup.inputs[tensor.name].dims.extend(dims)
        warmup.inputs[tensor.name].zero_data = True
    return warmup
