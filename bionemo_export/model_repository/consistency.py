"""Check a written repository the way the servers that will load it do, without loading it.

`check_repository(root)` reads every `config.pbtxt` back through Triton's protobuf schema and
reports, one line each:
- configs that do not parse, or whose `name` is not their folder's;
- ensembles whose steps disagree with the models they call (names, dtypes, dims, batch sizes:
  `RepositoryPlan.validate` on the plans read back from the configs);
- graph models (`onnxruntime_onnx`, `tensorrt_plan`) whose inputs and outputs differ from the ONNX
  graph's after ONNX shape inference: names, dtypes, dims (the batch axis left out when the
  config batches, where the graph's first axis must then be dynamic);
- TensorRT models whose `engine.json` profiles do not cover every shape the repository's other
  models can send them, disagree with the graph, or are not all listed in the instance group.

The shapes callers can send are derived here from the configs and the manifest, not from the
planner's own `ShapeRange`s, so that a planner mistake shows: batch up to the config's
max_batch_size (the decoder graphs: a decode loop's rows, max_batch_size x max_samples_x_beams
bounded by max_decode_tokens); token lengths up to the manifest's max_length; a decoder's
self-attention cache from 0 to max_decode_length tokens. ONNX axes are matched by the names the
exporter gave them (batch, length, src_length, past_length).

The build runs it before a repository is moved into place, and `engines build` before building.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import product
from pathlib import Path

import onnx
from google.protobuf import text_format

from bionemo_export.tasks import DType

from .backends import ENGINE_FILE
from .manifest import MANIFEST_NAME, Manifest
from .pbtxt import read_config
from .plan import ModelPlan, PlanError, RepositoryPlan

GRAPH_PLATFORMS = ("onnxruntime_onnx", "tensorrt_plan")


@dataclass(frozen=True)
class GraphIO:
    """An ONNX graph input or output: Triton dtype name and dims (a str for a named dynamic axis,
    None for an unnamed one)."""

    name: str
    dtype: str
    dims: tuple[int | str | None, ...]


def graph_io(path: Path) -> tuple[list[GraphIO], list[GraphIO]]:
    """The graph's inputs (initializers excluded) and outputs after ONNX shape inference; the
    weights (external data included) are not read."""
    model = onnx.load(str(path), load_external_data=False)
    model = onnx.shape_inference.infer_shapes(model)
    initializers = {init.name for init in model.graph.initializer}

    def describe(value) -> GraphIO:
        tensor = value.type.tensor_type
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        try:
            dtype = DType.from_onnx(tensor.elem_type).value
        except ValueError:  # a type Triton does not serve: reported as a mismatch by the checks
            dtype = f"onnx:{tensor.elem_type}"
        return GraphIO(value.name, dtype, dims)

    inputs = [describe(v) for v in model.graph.input if v.name not in initializers]
    return inputs, [describe(v) for v in model.graph.output]


def caller_sizes(root: Path, configs: dict[str, ModelPlan]) -> dict[str, dict[str, tuple[int, int]]]:
    """Per graph model: each named axis's (smallest, largest) size that the repository's other
    models (or a client within the config's limits) can send."""
    max_length = (Manifest.read(root).max_length or 0) if (root / MANIFEST_NAME).is_file() else 0
    loops = [plan for plan in configs.values() if "max_decode_length" in plan.parameters]
    decode_length = max((int(p.parameters["max_decode_length"]) for p in loops), default=0)
    rows = 0
    for loop in loops:
        hypotheses = int(loop.parameters.get("max_samples_x_beams", "1"))
        tokens = int(loop.parameters.get("max_decode_tokens", str(loop.max_batch_size * hypotheses)))
        rows = max(rows, min(loop.max_batch_size * hypotheses, tokens))
    sizes = {}
    for name, plan in configs.items():
        if plan.platform not in GRAPH_PLATFORMS:
            continue
        batch = plan.max_batch_size or rows
        sizes[name] = {"batch": (1, batch), "length": (1, max_length), "src_length": (1, max_length),
                       "past_length": (0, decode_length)}
    return sizes


def check_repository(root: Path) -> list[str]:
    """Every inconsistency found in the repository at `root`, one line each (empty: none)."""
    findings: list[str] = []
    plans: dict[str, ModelPlan] = {}
    for folder in sorted(p for p in root.iterdir() if (p / "config.pbtxt").is_file()):
        try:
            config = read_config(folder)
        except text_format.ParseError as err:
            findings.append(f"{folder.name}: config.pbtxt does not parse as Triton's ModelConfig: {err}")
            continue
        if config.name and config.name != folder.name:
            findings.append(f"{folder.name}: config name {config.name!r} differs from its folder")
        plans[folder.name] = ModelPlan.from_config(config)
    try:
        RepositoryPlan(list(plans.values())).validate()
    except PlanError as err:
        findings.append(str(err))
    sizes = caller_sizes(root, plans)
    for name, plan in plans.items():
        if plan.platform in GRAPH_PLATFORMS:
            findings += _check_graph_model(root / name, plan, sizes[name])
    return findings


def _check_graph_model(folder: Path, plan: ModelPlan, sizes: dict[str, tuple[int, int]]) -> list[str]:
    version = folder / "1"
    graph_file = version / "model.onnx"
    if not graph_file.is_file():
        return [f"{plan.name}: no 1/model.onnx to check the config against"]
    if plan.platform == "onnxruntime_onnx" and plan.default_model_filename not in (None, "model.onnx"):
        return [f"{plan.name}: default_model_filename {plan.default_model_filename!r} is not the graph model.onnx"]
    inputs, outputs = graph_io(graph_file)
    findings = _compare_io(plan, "input", plan.inputs, inputs) + _compare_io(plan, "output", plan.outputs, outputs)
    if plan.platform == "tensorrt_plan":
        findings += _check_profiles(version, plan, inputs, sizes)
    return findings


def _compare_io(plan: ModelPlan, kind: str, tensors, graph: list[GraphIO]) -> list[str]:
    findings = []
    config_names, graph_names = [t.name for t in tensors], [g.name for g in graph]
    if sorted(config_names) != sorted(graph_names):
        return [f"{plan.name}: config {kind}s {config_names} differ from the graph's {graph_names}"]
    by_name = {g.name: g for g in graph}
    for tensor in tensors:
        have = by_name[tensor.name]
        if tensor.dtype != have.dtype:
            findings.append(f"{plan.name}: {kind} {tensor.name!r} is {tensor.dtype} in the config but "
                            f"{have.dtype} in the graph")
        dims = have.dims
        if plan.max_batch_size:
            if not dims or isinstance(dims[0], int):
                findings.append(f"{plan.name}: {kind} {tensor.name!r} has no dynamic batch axis in the graph "
                                f"({list(dims)}), but the config batches (max_batch_size {plan.max_batch_size})")
                continue
            dims = dims[1:]
        expected = tuple(-1 if not isinstance(d, int) else d for d in dims)
        if tuple(tensor.dims) != expected:
            findings.append(f"{plan.name}: {kind} {tensor.name!r} has dims {list(tensor.dims)} in the config but "
                            f"{list(expected)} in the graph ({list(dims)})")
    return findings


def _check_profiles(version: Path, plan: ModelPlan, inputs: list[GraphIO],
                    sizes: dict[str, tuple[int, int]]) -> list[str]:
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
                    findings.append(f"{where}: profile {index}, input {graph_input.name!r}: min {low} <= opt {opt} "
                                    f"<= max {high} does not hold")
                elif isinstance(axis, int):
                    if not lo == hi == axis:
                        findings.append(f"{where}: profile {index}, input {graph_input.name!r}: fixed axis {axis} "
                                        f"given {lo}..{hi}")
                elif axis is None:
                    findings.append(f"{where}: input {graph_input.name!r} has an unnamed dynamic axis")
                elif box.setdefault(axis, (lo, hi)) != (lo, hi):
                    findings.append(f"{where}: profile {index}: axis {axis!r} has different ranges across inputs")
        boxes.append(box)
    if findings:
        return findings
    axes = sorted({axis for box in boxes for axis in box})
    unknown = [axis for axis in axes if axis not in sizes]
    if unknown:
        return [f"{where}: no known caller range for the graph axes {unknown}"]
    hole = _uncovered(boxes, {axis: sizes[axis] for axis in axes})
    if hole is not None:
        findings.append(f"{where}: no profile covers {hole}, which callers can send "
                        f"(ranges: { {axis: sizes[axis] for axis in axes} })")
    return findings


def _uncovered(boxes: list[dict[str, tuple[int, int]]], ranges: dict[str, tuple[int, int]]) -> dict | None:
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
