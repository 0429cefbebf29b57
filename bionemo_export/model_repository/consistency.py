"""Check a written repository the way the servers that will load it do, without loading it.

`check_repository(root)` reads every `config.pbtxt` back through Triton's protobuf schema and
reports, one line each:
- configs that do not parse, or whose `name` is not their folder's;
- ensembles whose steps disagree with the models they call (names, dtypes, dims, batch sizes:
  `RepositoryPlan.validate` on the plans read back from the configs);
- graph models (those a serving backend owns: `onnxruntime_onnx`, `tensorrt_plan`) whose inputs
  and outputs differ from the ONNX graph's after ONNX shape inference: names, dtypes, dims (the
  batch axis left out when the config batches, where the graph's first axis must then be dynamic);
- what each backend's own rules find in its models (backends.py: `check_config`, `check_version`):
  an ONNX Runtime model whose default_model_filename is not its graph; TensorRT models whose
  `engine.json` profiles do not cover every shape the repository's other models can send them,
  disagree with the graph, or are not all listed in the instance group;
- models of the manifest whose `source_sha256` parameter (parameters.py) is missing while others
  carry it, or differs from the one manifest.json's checkpoint digests and precision give: a client
  tells repositories apart by it, so it must say what the repository was built from. A repository
  none of whose models carries it was built before the stamp (or by hand) and is not checked.

The shapes callers can send are derived here from the configs and the manifest, not from the
planner's own `ShapeRange`s, so that a planner mistake shows: batch up to the config's
max_batch_size (the decoder graphs: a decode loop's rows, max_batch_size x max_samples_x_beams
bounded by max_decode_tokens); token lengths up to the manifest's max_length; a decoder's
self-attention cache from 0 to max_decode_length tokens. ONNX axes are matched by the names the
exporter gave them (batch, length, src_length, past_length).

The build runs it before a repository is moved into place, and `engines build` before building.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from google.protobuf import text_format

from bionemo_export.tensors import TensorSpec

from .backends import ServingBackend, graph_backend
from .graph_io import GraphIO, graph_io
from .manifest import MANIFEST_NAME, Manifest
from .parameters import SOURCE_SHA256
from .pbtxt import read_config
from .plan import ModelPlan, PlanError, RepositoryPlan

__all__ = ["caller_sizes", "check_repository"]


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
        if graph_backend(plan) is None:
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
    findings += _check_source(root, plans)
    sizes = caller_sizes(root, plans)
    for name, plan in plans.items():
        backend = graph_backend(plan)
        if backend is not None:
            findings += _check_graph_model(root / name, plan, backend, sizes[name])
    return findings


def _check_source(root: Path, plans: dict[str, ModelPlan]) -> list[str]:
    """The SOURCE_SHA256 stamp of the models manifest.json lists (every model when it lists none:
    folders a user added beside a build's models are served, not checked) against the manifest's."""
    manifest = Manifest.read(root) if (root / MANIFEST_NAME).is_file() else None
    listed = [name for name in plans if manifest is None or not manifest.models or name in manifest.models]
    stamps = {name: plans[name].parameters.get(SOURCE_SHA256) for name in listed}
    if not any(stamps.values()):
        return []
    expected = manifest.source_sha256 if manifest is not None else None
    if expected is None:
        return [f"models carry a {SOURCE_SHA256} parameter, but {MANIFEST_NAME} records no checkpoint digest to "
                "check it against: build the repository again with `bionemo-export build repo`"]
    findings = []
    for name, stamp in stamps.items():
        if stamp is None:
            findings.append(f"{name}: no {SOURCE_SHA256} parameter, which the repository's other models carry: "
                            "build the repository again")
        elif stamp != expected:
            findings.append(f"{name}: {SOURCE_SHA256} {stamp} is not the {expected} that {MANIFEST_NAME}'s "
                            "checkpoint digests and precision give: its config comes from another build; "
                            "build the repository again")
    return findings


def _check_graph_model(folder: Path, plan: ModelPlan, backend: type[ServingBackend],
                       sizes: dict[str, tuple[int, int]]) -> list[str]:
    version = folder / "1"
    graph_file = version / "model.onnx"  # every backend's graph models keep the exported graph
    if not graph_file.is_file():
        return [f"{plan.name}: no 1/model.onnx to check the config against"]
    refused = backend.check_config(plan)
    if refused:
        return refused
    inputs, outputs = graph_io(graph_file)
    findings = _compare_io(plan, "input", plan.inputs, inputs) + _compare_io(plan, "output", plan.outputs, outputs)
    return findings + backend.check_version(version, plan, inputs, sizes)


def _compare_io(plan: ModelPlan, kind: str, tensors: Sequence[TensorSpec], graph: list[GraphIO]) -> list[str]:
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

