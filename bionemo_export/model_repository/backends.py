"""Serving backends: what runs an exported graph inside a generated repository, one class each.

Each backend (its `name`, the command line's --backend), its class, what a graph model is, devices:
- `python`, `PythonBackend`: a Python-backend model running ONNX Runtime (any Triton with the
  Python backend, the embedded CPU server included; the CUDA provider on KIND_GPU instances); cpu, gpu.
- `native`, `OnnxRuntimeBackend`: Triton's `onnxruntime_onnx` platform (NVIDIA's Triton
  containers); cpu, gpu.
- `tensorrt`, `TensorRTBackend`: Triton's `tensorrt_plan` platform: `model.onnx` plus `engine.json`
  (optimization profiles), turned into `model.plan` by `bionemo-export engines build` where
  TensorRT is installed; gpu.

The planners (encoder.py, seq2seq.py) describe each graph model as a `GraphModel` (its tensors,
files, role settings and the shapes its callers can send) and hand it to `backend.plan_graph()`;
they never compare backend names. Everything else about a backend is its class's too: the devices
it runs on, whether `auto` may pick it on a host (`picked_by_auto`), what a deployment image needs
(`image_needs`), its help text, and the rules the consistency check applies to its models
(`owns`, `check_config`, `check_version`: consistency.py runs them). Adding a backend is one
class here plus tests; `BACKENDS` and the command line's `BackendChoice` list it from its `name`.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from itertools import product
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol

from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.choices import ChoiceError, Device, EnginePrecision

from .graph_io import GraphIO
from .plan import ModelPlan, data_type

AUTO = "auto"
"""The backend choice that picks one for the host (`resolve_auto`)."""
BACKENDS: dict[str, type[ServingBackend]] = {}
"""Every serving backend by name, in the order they are defined (each class adds itself)."""
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
                def dims(pick: Callable[[tuple[int, int], str], int], axes: tuple[str | int, ...] = axes,
                         sizes: dict[str, tuple[int, int]] = sizes) -> list[int]:
                    return [axis if isinstance(axis, int) else pick(sizes[axis], axis) for axis in axes]

                profile[name] = {
                    "min": dims(lambda r, a: r[0]),
                    "opt": dims(lambda r, a: min(max(self.opt.get(a, r[1]), r[0]), r[1])),
                    "max": dims(lambda r, a: r[1]),
                }
            result.append(profile)
        return result


class RoleSettings(Protocol):
    """What a backend reads of the settings of the model it plans (options.RoleOptions has them;
    a protocol here, so that this module needs nothing of options.py, which imports it)."""

    @property
    def instances(self) -> int: ...

    @property
    def threads(self) -> int: ...

    def session_parameters(self) -> dict[str, str]: ...


@dataclass
class GraphModel:
    """What a planner knows of a model that runs one exported graph; a backend turns it into the
    model's platform, files and parameters."""

    plan: ModelPlan
    """The model so far: name, tensors, max_batch_size, batching. The backend completes it."""
    role: RoleSettings
    what: str
    """What the graph computes, for descriptions: "encoder", "decoder step"."""
    onnx_files: dict[str, Path]
    """Version-folder name -> exported file (model.onnx and its external data, if any)."""
    shapes: ShapeRange
    python_model: Callable[[], tuple[dict[str, str], dict[str, Path | str | bytes]]]
    """The Python model that runs the graph in the Python backend: its (config parameters, files),
    encoder.python_model's, made on demand."""
    python_files: dict[str, Path | str] = field(default_factory=dict)
    """Further version-folder files it reads (a tokenizer's tokenizer.json)."""
    python_parameters: dict[str, str] = field(default_factory=dict)
    """Config parameters model.py reads, beyond the ONNX Runtime session's."""
    warmup: bool = False
    """Native backends: warm the model up with one all-zero request at load."""


class ServingBackend(ABC):
    """Where a graph model runs. Subclasses set the class attributes and `plan_graph`."""

    name: ClassVar[str]
    """The backend's choice (`ServingOptions.backend`, the command line's --backend)."""
    help: ClassVar[str]
    """One clause for the command line's help."""
    devices: ClassVar[tuple[Device, ...]] = tuple(Device)
    default_device: ClassVar[Device] = Device.CPU
    triton_backend: ClassVar[str]
    """The tritonserver backend that must be installed to load its graph models."""
    runs_python: ClassVar[bool] = False
    """Graphs run inside Python-backend models, so the encoder model may tokenize (fused layout)."""
    auto_preference: ClassVar[int | None] = None
    """Rank among the backends `auto` may pick (the lowest available wins); None: never picked."""
    image_needs: ClassVar[str] = ""
    """What a container image needs beyond tritonserver to load this backend's models ('':
    nothing); `deploy k8s` writes it into its manifests and prints it."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:  # a concrete backend: the choices list it (BACKENDS)
            if cls.name in BACKENDS or cls.name == AUTO:
                raise TypeError(f"serving backend {cls.name!r} is defined twice")
            BACKENDS[cls.name] = cls

    def __init__(self, device: str | None = None) -> None:
        chosen = Device.parse(device, "device") if device else self.default_device
        if chosen not in self.devices:
            raise ChoiceError(f"`backend` {self.name} runs on {' or '.join(self.devices)}, not {chosen}: "
                              f"pass `device` {self.devices[0]}")
        self.device = chosen

    @classmethod
    def picked_by_auto(cls, can_load: Callable[[str], bool] | None) -> bool:
        """Whether `auto` may pick this backend for a host whose tritonserver loads the backends
        `can_load` accepts (None: no tritonserver found). By default: a backend with an
        `auto_preference`, when the server can load it."""
        return cls.auto_preference is not None and can_load is not None and can_load(cls.triton_backend)

    @classmethod
    def owns(cls, plan: ModelPlan) -> bool:
        """Whether a config read back from a repository is one of this backend's graph models,
        whose rules the consistency check then applies (`check_config`, `check_version`)."""
        return False

    @classmethod
    def check_config(cls, plan: ModelPlan) -> list[str]:
        """Findings in one of its model's configs alone, before its graph is read (empty: none);
        any finding stops the model's other checks."""
        return []

    @classmethod
    def check_version(cls, version: Path, plan: ModelPlan, inputs: list[GraphIO],
                      sizes: dict[str, tuple[int, int]]) -> list[str]:
        """Findings in one of its model's version folder beyond the graph's inputs and outputs,
        which consistency.py compares for every backend: `inputs` are the graph's, `sizes` each
        named axis's (smallest, largest) size that callers can send."""
        return []

    @property
    def instance_kind(self) -> int:
        """Triton's instance kind for the models that run graphs."""
        return mc.ModelInstanceGroup.KIND_GPU if self.device == Device.GPU else mc.ModelInstanceGroup.KIND_CPU

    @property
    def stores_cpu_optimized_graphs(self) -> bool:
        """Whether the build may store graphs rewritten by ONNX Runtime's CPU optimizer (contrib
        operators, CPU-specific fusions). TensorRT parses standard ONNX only, and a GPU execution
        provider optimizes the plain graph for itself."""
        return self.device == Device.CPU

    @abstractmethod
    def plan_graph(self, graph: GraphModel) -> ModelPlan:
        """Complete `graph.plan`: platform or backend, files, parameters, instance kind."""

    def _place(self, plan: ModelPlan, role: RoleSettings) -> None:
        plan.instance_count = role.instances
        plan.instance_kind = self.instance_kind


class PythonBackend(ServingBackend):
    name = "python"
    help = "ONNX Runtime inside a Python-backend model (any Triton with the Python backend)"
    triton_backend = "python"
    runs_python = True
    auto_preference = 1
    image_needs = ("the numpy and onnxruntime Python packages (NVIDIA's tritonserver images have no onnxruntime "
                   "Python package; build an image FROM one with `pip install onnxruntime`)")

    @classmethod
    def picked_by_auto(cls, can_load: Callable[[str], bool] | None) -> bool:
        return True  # the last resort: the embedded CPU server runs it, with or without a tritonserver found

    def plan_graph(self, graph: GraphModel) -> ModelPlan:
        plan = graph.plan
        self._place(plan, graph.role)
        plan.backend = "python"
        plan.files.update(graph.onnx_files)
        served, files = graph.python_model()
        plan.files.update(graph.python_files)
        plan.files.update(files)
        plan.parameters.update(graph.role.session_parameters())
        plan.parameters.update(graph.python_parameters)
        plan.parameters.update(served)
        plan.description = f"{graph.what} (ONNX Runtime in the Python backend" + (
            ", CUDA provider)" if self.device == Device.GPU else ")")
        return plan


class TritonRuntimeBackend(ServingBackend):
    """A backend whose graph models run on one of Triton's own platforms: the config names the
    platform and the model file, the version folder holds the exported graph, and a warmup request
    runs at load. Subclasses add their platform's settings in `configure`."""

    platform: ClassVar[str]
    model_file: ClassVar[str]

    @classmethod
    def owns(cls, plan: ModelPlan) -> bool:
        return plan.platform == cls.platform

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
    auto_preference = 0

    @classmethod
    def check_config(cls, plan: ModelPlan) -> list[str]:
        # The server loads default_model_filename: it must be the graph the checks read.
        if plan.default_model_filename not in (None, cls.model_file):
            return [f"{plan.name}: default_model_filename {plan.default_model_filename!r} is not the graph "
                    f"{cls.model_file}"]
        return []

    def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
        if graph.role.threads:
            plan.parameters["intra_op_thread_count"] = str(graph.role.threads)
        return self.device.upper()


class TensorRTBackend(TritonRuntimeBackend):
    name = "tensorrt"
    help = ("Triton's tensorrt_plan platform; `bionemo-export engines build REPO` makes the engines where "
            "TensorRT is installed")
    devices = (Device.GPU,)
    default_device = Device.GPU
    triton_backend = "tensorrt"
    platform = "tensorrt_plan"
    model_file = PLAN_FILE
    precision = EnginePrecision.FP16
    """The engines' precision (`engines build --precision` overrides it)."""

    def configure(self, plan: ModelPlan, graph: GraphModel) -> str:
        # model.onnx stays beside the plan: it is the engine's source, parsed by `engines build`.
        profiles = graph.shapes.profiles()
        plan.profiles = tuple(str(index) for index in range(len(profiles)))
        plan.files[ENGINE_FILE] = engine_json({"onnx": "model.onnx", "plan": PLAN_FILE, "precision": self.precision,
                                               "profiles": profiles, "built": None})
        return f"{len(profiles)} optimization profiles"

    @classmethod
    def check_version(cls, version: Path, plan: ModelPlan, inputs: list[GraphIO],
                      sizes: dict[str, tuple[int, int]]) -> list[str]:
        """engine.json's profiles: present, listed in the instance group, agreeing with the graph,
        and covering every shape the repository's other models (or a client) can send."""
        where = f"{plan.name}: {ENGINE_FILE}"
        if not (version / ENGINE_FILE).is_file():
            return [f"{where} is missing (the TensorRT build recipe)"]
        recipe = json.loads((version / ENGINE_FILE).read_text())
        profiles = recipe.get("profiles") or []
        if not profiles:
            return [f"{where} has no optimization profiles"]
        findings = []
        if list(plan.profiles) != [str(i) for i in range(len(profiles))]:
            findings.append(f"{plan.name}: instance_group profile {list(plan.profiles)} should list all "
                            f"{len(profiles)} profiles of {ENGINE_FILE}")
        boxes = []  # per profile: axis name -> (min, max)
        for index, profile in enumerate(profiles):
            box: dict[str, tuple[int, int]] = {}
            for graph_input in inputs:
                shapes = profile.get(graph_input.name)
                if shapes is None:
                    findings.append(f"{where}: profile {index} has no shapes for input {graph_input.name!r}")
                    continue
                low, opt, high = shapes["min"], shapes["opt"], shapes["max"]
                if not len(low) == len(opt) == len(high) == len(graph_input.dims):
                    findings.append(f"{where}: profile {index}, input {graph_input.name!r}: rank differs from the "
                                    f"graph's {list(graph_input.dims)}")
                    continue
                for axis, lo, op, hi in zip(graph_input.dims, low, opt, high):
                    if not lo <= op <= hi:
                        findings.append(f"{where}: profile {index}, input {graph_input.name!r}: min {low} <= opt "
                                        f"{opt} <= max {high} does not hold")
                    elif isinstance(axis, int):
                        if not lo == hi == axis:
                            findings.append(f"{where}: profile {index}, input {graph_input.name!r}: fixed axis "
                                            f"{axis} given {lo}..{hi}")
                    elif axis is None:
                        findings.append(f"{where}: input {graph_input.name!r} has an unnamed dynamic axis")
                    elif box.setdefault(axis, (lo, hi)) != (lo, hi):
                        findings.append(f"{where}: profile {index}: axis {axis!r} has different ranges across "
                                        "inputs")
            boxes.append(box)
        if findings:
            return findings
        axes = sorted({axis for box in boxes for axis in box})
        unknown = [axis for axis in axes if axis not in sizes]
        if unknown:
            return [f"{where}: no known caller range for the graph axes {unknown}"]
        hole = uncovered(boxes, {axis: sizes[axis] for axis in axes})
        if hole is not None:
            findings.append(f"{where}: no profile covers {hole}, which callers can send "
                            f"(ranges: { {axis: sizes[axis] for axis in axes} })")
        return findings


def uncovered(boxes: list[dict[str, tuple[int, int]]], ranges: dict[str, tuple[int, int]]) -> dict | None:
    """A point of the box `ranges` that no box in `boxes` contains, or None. Cuts every axis at
    the boxes' edges, so one corner per cell decides the whole cell."""
    cuts = {}
    for axis, (low, high) in ranges.items():
        edges = {low, high + 1} | {edge for box in boxes for edge in (box[axis][0], box[axis][1] + 1)
                                   if low <= edge <= high}
        cuts[axis] = sorted(edges)[:-1]  # each is the first point of a cell along this axis
    for corner in product(*(cuts[axis] for axis in ranges)):
        point = dict(zip(ranges, corner))
        if not any(all(box[a][0] <= v <= box[a][1] for a, v in point.items()) for box in boxes):
            return point
    return None


if TYPE_CHECKING:  # the members are made at run time, from the classes: checkers see the type only
    class BackendChoice(StrEnum):
        """The command line's --backend: a backend's name, or auto."""
else:
    BackendChoice = StrEnum("BackendChoice", [(AUTO.upper(), AUTO), *((name.upper(), name) for name in BACKENDS)])
    """The command line's --backend: a backend's name, or auto (`resolve_auto`); generated from the
    backend classes, so a new class is a new choice."""


def get_backend(name: str, device: str | None = None) -> ServingBackend:
    """The backend `name` ("python", "native", "tensorrt") placing its graph models on `device`
    (its default when None)."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ChoiceError(f"`backend` {name!r}: choose one of {', '.join(BACKENDS)}") from None
    return cls(device)


def graph_backend(plan: ModelPlan) -> type[ServingBackend] | None:
    """The backend whose graph model a config read back from a repository is (None: not a graph
    model whose rules are checked, e.g. a Python model)."""
    return next((cls for cls in BACKENDS.values() if cls.owns(plan)), None)


def runs_python(triton_backend: str) -> bool:
    """Whether a model of the tritonserver backend `triton_backend` (a config.pbtxt's `backend`)
    runs Python code: a serving backend whose graphs run inside Python-backend models uses it."""
    return any(cls.runs_python and cls.triton_backend == triton_backend for cls in BACKENDS.values())


def resolve_auto(can_load: Callable[[str], bool] | None) -> str:
    """The backend `auto` picks on a host whose tritonserver loads the backends `can_load` accepts
    (None: none found): the available one of lowest `auto_preference`."""
    ranked = sorted((cls for cls in BACKENDS.values() if cls.auto_preference is not None),
                    key=lambda cls: cls.auto_preference or 0)
    for cls in ranked:
        if cls.picked_by_auto(can_load):
            return cls.name
    raise LookupError("no serving backend can be picked by auto")  # PythonBackend always can


def backend_help() -> str:
    """The command line's help for --backend: each backend's own clause, and what auto picks."""
    ranked = sorted((cls for cls in BACKENDS.values() if cls.auto_preference is not None),
                    key=lambda cls: cls.auto_preference or 0)
    auto = " when the found tritonserver can load it, else ".join(cls.name for cls in ranked)
    return "; ".join(f"{cls.name}: {cls.help}" for cls in BACKENDS.values()) + f"; {AUTO}: {auto}."


def device_help() -> str:
    """The command line's help for --device: the devices and each backend's default."""
    defaults: dict[Device, list[str]] = {}
    for cls in BACKENDS.values():
        defaults.setdefault(cls.default_device, []).append(cls.name)
    usual = max(defaults, key=lambda device: len(defaults[device]))
    others = "; ".join(f"{device} for {', '.join(names)}" for device, names in defaults.items() if device != usual)
    return (f"{' or '.join(Device)}: where the models that run graphs are placed (instance kind; the python "
            f"backend then uses ONNX Runtime's CUDA provider). Default: {others}, {usual} otherwise.")


def deployment_note(name: str | None) -> str | None:
    """What a deployment image needs for a repository of backend `name` (None: unknown, or
    nothing beyond tritonserver), and which backend would need nothing."""
    cls = BACKENDS.get(name or "")
    if cls is None or not cls.image_needs:
        return None
    plain = [other.name for other in BACKENDS.values() if not other.image_needs and cls.default_device in other.devices]
    return (f"the repository uses the {cls.name} backend: the image must have {cls.image_needs}"
            + (f"; or build the repository with the {' or '.join(plain)} backend, which needs nothing more" if plain
               else ""))


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
        warmup.inputs[tensor.name].data_type = data_type(tensor)
        warmup.inputs[tensor.name].dims.extend(dims)
        warmup.inputs[tensor.name].zero_data = True
    return warmup
