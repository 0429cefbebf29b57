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
- graphs whose external data (exporters/shared_weights.py) is missing, lies outside the graph's
  folder (ONNX Runtime refuses it; Triton downloads each model folder of an s3:// repository on its
  own) or reaches past the end of its file; a model whose SHARED_WEIGHTS parameter records another
  size or sha256 than its weights file has (the file changed since the build: every graph over it
  would answer wrong); graphs a model hosts (HOSTED_GRAPHS, hosted_graphs.py) that are missing, or
  whose outputs are not the ones its config serves for them;
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

import json
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from google.protobuf import text_format

from bionemo_export.digests import file_digest
from bionemo_export.serving.parameters import SOURCE_SHA256
from bionemo_export.tensors import TensorSpec

from .backends import ServingBackend, graph_backend
from .graph_io import GraphIO, external_references, graph_io
from .hosted_graphs import HOSTED_GRAPHS, SHARED_WEIGHTS
from .manifest import MANIFEST_NAME, Manifest
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
        findings += _check_external_data(root / name, plan) + _check_hosted_graphs(root / name, plan)
    return findings


def _check_external_data(folder: Path, plan: ModelPlan) -> list[str]:
    """Every graph of the model's version folder: its external data inside its own folder, present,
    long enough; the SHARED_WEIGHTS parameter's size and sha256 those of its file."""
    findings = []
    version = folder / "1"
    for graph in sorted(version.rglob("*.onnx")) if version.is_dir() else []:
        where = f"{plan.name}: {graph.relative_to(folder)}"
        sizes: dict[str, int | None] = {}
        for reference in external_references(graph):
            location = PurePosixPath(reference.location)
            if location.is_absolute() or ".." in location.parts or not location.parts:
                findings.append(f"{where}: tensor {reference.tensor!r} has its data at {reference.location!r}, outside "
                                "the graph's folder (ONNX Runtime refuses it, and Triton copies each model folder "
                                "alone): rebuild the repository")
                break
            if reference.location not in sizes:
                data = graph.parent / location
                sizes[reference.location] = data.stat().st_size if data.is_file() else None
            size = sizes[reference.location]
            if size is None:
                findings.append(f"{where}: its weights file {reference.location} is missing (tensor "
                                f"{reference.tensor!r}): rebuild the repository")
                break
            end = reference.offset + (reference.length or 0)
            if end > size:
                findings.append(f"{where}: tensor {reference.tensor!r} reaches byte {end} of {reference.location}, "
                                f"which has {size}: the file changed since the build; rebuild the repository")
                break
    recorded = plan.parameters.get(SHARED_WEIGHTS)
    if recorded:
        expected = json.loads(recorded)
        weights = version / expected["file"]
        if not weights.is_file():
            findings.append(f"{plan.name}: its shared weights file 1/{expected['file']} is missing: rebuild the "
                            "repository")
        elif (weights.stat().st_size != expected["bytes"]
              or file_digest(weights)["sha256"] != expected["sha256"]):
            findings.append(f"{plan.name}: 1/{expected['file']} is not the file its graphs were built over "
                            f"(config parameter {SHARED_WEIGHTS}: {expected['bytes']} bytes, sha256 "
                            f"{expected['sha256'][:16]}...): it changed since the build; rebuild the repository")
    return findings


def _check_hosted_graphs(folder: Path, plan: ModelPlan) -> list[str]:
    """The graphs a model hosts (HOSTED_GRAPHS): each file present, answering the outputs listed
    for it, each of which the config serves with the graph's dims (the batch axis left out)."""
    hosted = json.loads(plan.parameters.get(HOSTED_GRAPHS) or "{}")
    findings = []
    for name, entry in hosted.items():
        graph = folder / "1" / entry["file"]
        if not graph.is_file():
            findings.append(f"{plan.name}: hosted graph {name}'s 1/{entry['file']} is missing: rebuild the repository")
            continue
        _, outputs = graph_io(graph)
        listed = [tensor for tensor in outputs if tensor.name in entry["outputs"]]
        missing = sorted(set(entry["outputs"]) - {tensor.name for tensor in listed})
        if missing:
            findings.append(f"{plan.name}: hosted graph {name} ({entry['file']}) has no outputs {missing}")
        unserved = sorted(set(entry["outputs"]) - {tensor.name for tensor in plan.outputs})
        if unserved:
            findings.append(f"{plan.name}: the config has no outputs {unserved} of hosted graph {name}")
        findings += _compare_io(plan, "output", [t for t in plan.outputs if t.name in entry["outputs"]], listed,
                                check_names=False)
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


def _compare_io(plan: ModelPlan, kind: str, tensors: Sequence[TensorSpec], graph: list[GraphIO],
                check_names: bool = True) -> list[str]:
    findings = []
    config_names, graph_names = [t.name for t in tensors], [g.name for g in graph]
    if check_names and sorted(config_names) != sorted(graph_names):
        return [f"{plan.name}: config {kind}s {config_names} differ from the graph's {graph_names}"]
    by_name = {g.name: g for g in graph}
    for tensor in tensors:
        have = by_name.get(tensor.name)
        if have is None:
            continue
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

