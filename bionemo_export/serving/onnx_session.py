"""The ONNX Runtime session a generated model runs its exported graph with, configured from the
model's config.pbtxt `parameters` and the serving host.

This file is copied verbatim into the version folders of the generated models that run a graph
themselves (and only those: it is the one served module that imports onnxruntime), so besides
onnxruntime it imports only the standard library and its sibling modules.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import onnxruntime as ort

from .golden import check_at_load
from .host import NO_VNNI_FOLDER, cpu_description, threads_per_instance
from .parameters import (
    config_file,
    flag_parameter,
    model_config,
    model_parameters,
    number_parameter,
)
from .responses import triton

OPTIMIZATION_LEVELS = "ORT_DISABLE_ALL, ORT_ENABLE_BASIC, ORT_ENABLE_EXTENDED, ORT_ENABLE_ALL"
MEMORY_ARENAS = ("run", "false", "true")
"""The values of config parameter `memory_arena` (bionemo_export.choices.MemoryArena; absent: "false",
as repositories built before "run" existed)."""


def create_session(args: Mapping[str, str], here: str, graph: str = "model.onnx", *, prepack: bool | None = None,
                   level: str | None = None) -> tuple[Any, dict[str, str]]:
    """(the ONNX Runtime session for `here`/`graph`, the model's config parameters), its thread
    pool sized for this host: the config's `intra_op_threads` when it is a number, else ("auto")
    from the cores this server process may use and this model's instance count (host.py; times
    `models_sharing_cores`, a checkpoint ensemble's K members running at once). Idle
    threads sleep instead of spinning unless `allow_spinning` is "true": spinning threads take the
    cores from Triton, the other instances and the clients on the same host.

    `memory_arena` "run" (the default): ONNX Runtime's CPU arena serves a run's tensors and is
    shrunk at the run's end (`ArenaPerRun`), so a run's layers reuse one another's pages and the
    memory still goes back to the system after every run; "false": tensors from malloc, freed as
    soon as they are used (each allocation over glibc's mmap threshold is a fresh mapping whose
    pages the kernel zeroes: up to 1.4x slower); "true": the arena keeps every chunk it ever grew
    to, the largest request's peak (choices.MemoryArena).

    On a KIND_GPU instance (`--device gpu`) the graph runs with the CUDA execution provider on the
    instance's GPU; an onnxruntime without it (the CPU wheel) is an error that says so, never a
    silent fall back to the CPU.

    An int8 graph comes in two forms (exporters/optimize/quantization.py): `model.onnx` for CPUs
    whose 8-bit dot products accumulate in 32 bits (VNNI, AMX), and `no-vnni/model.onnx`, exact on
    every x86 CPU, which a host without VNNI opens instead. Before the session is handed out, the
    graph answers the build's golden inputs on this host (golden.py): outside its tolerance the
    model refuses to load, naming the host's CPU and the figures.

    Weights: ONNX Runtime memory-maps a graph's external data (weights.bin, which the graphs of
    one folder share: exporters/shared_weights.py). `prepack` False keeps the session computing
    from those mapped pages, shared by every session and process on the host; True (ONNX
    Runtime's default) copies each MatMul weight into a private packed buffer, faster per call.
    None: the config's `prepack_weights` parameter ("true" unless set), for the model's own
    graph; the graphs it hosts pass False. `level`: the graph's optimization level (None: the
    config's `graph_optimization_level`)."""
    config = model_config(args)
    parameters = model_parameters(args)
    instances = sum(group.get("count", 1) for group in config.get("instance_group", [])) or 1
    # A checkpoint ensemble's members run side by side on the same cores: "auto" counts every
    # member's instances (config parameter `models_sharing_cores`, K; absent: 1).
    instances *= number_parameter(args, parameters, "models_sharing_cores", 1)
    options = ort.SessionOptions()
    threads = parameters.get("intra_op_threads", "auto")
    options.intra_op_num_threads = threads_per_instance(
        threads if threads in ("", "auto") else number_parameter(args, parameters, "intra_op_threads"), instances)
    options.inter_op_num_threads = 1
    spinning = "1" if flag_parameter(parameters, "allow_spinning") else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
    arena = parameters.get("memory_arena", "false")
    if arena not in MEMORY_ARENAS:
        raise ValueError(f"{config_file(args)}: parameter memory_arena is {arena!r}, not one of "
                         f"{', '.join(MEMORY_ARENAS)}")
    options.enable_cpu_mem_arena = arena != "false"
    # A graph stored optimized (the build records it) needs only the basic rewrites at load.
    options.graph_optimization_level = optimization_level(
        args, level or parameters.get("graph_optimization_level", "ORT_ENABLE_ALL"))
    if prepack is None:
        prepack = parameters.get("prepack_weights", "true") != "false"
    if not prepack:
        options.add_session_config_entry("session.disable_prepacking", "1")
    providers = execution_providers(args)
    path = graph_for_this_host(here, providers) if graph == "model.onnx" else os.path.join(here, graph)
    try:
        session = ort.InferenceSession(path, sess_options=options, providers=providers)
    except Exception as err:  # noqa: BLE001 - ONNX Runtime's own types (InvalidProtobuf, Fail, ...)
        raise RuntimeError(f"{path}: ONNX Runtime cannot load it ({err}); rebuild the repository "
                           "(`bionemo-export serve` compares its files with the build's digests)") from None
    check_at_load(session, path, args.get("model_name", here), warn=_log_warning)
    return (ArenaPerRun(session) if arena == "run" else session), parameters


class ArenaPerRun:
    """An ONNX Runtime session whose CPU memory arena is shrunk at the end of every run (the run
    option `memory.enable_memory_arena_shrinkage`): what `memory_arena` "run" serves with.
    Everything else is the session's own."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.run_options = ort.RunOptions()
        self.run_options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, output_names: Any, input_feed: Mapping[str, Any], run_options: Any = None) -> Any:
        return self.session.run(output_names, input_feed, run_options or self.run_options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


def graph_for_this_host(here: str, providers: list) -> str:
    """The graph file this host runs: `no-vnni/model.onnx` where the repository has one and the
    graph runs on a CPU without VNNI, else `model.onnx`."""
    portable = os.path.join(here, NO_VNNI_FOLDER, "model.onnx")
    if providers == ["CPUExecutionProvider"] and os.path.exists(portable) and not cpu_description()["vnni"]:
        return portable
    return os.path.join(here, "model.onnx")


def _log_warning(message: str) -> None:
    try:
        pb_utils = triton()
    except ImportError:  # imported outside a Triton Python backend (tests, verify)
        print(message, flush=True)
        return
    pb_utils.Logger.log_warn(message)


def optimization_level(args: Mapping[str, str], level: str) -> Any:
    """ONNX Runtime's GraphOptimizationLevel named `level`; another name fails the model's load
    with an error naming its config.pbtxt."""
    if not level.startswith("ORT_") or not hasattr(ort.GraphOptimizationLevel, level):
        raise ValueError(f"{config_file(args)}: parameter graph_optimization_level is {level!r}, not one of "
                         f"{OPTIMIZATION_LEVELS}")
    return getattr(ort.GraphOptimizationLevel, level)


def execution_providers(args: Mapping[str, str]) -> list:
    """ONNX Runtime's providers for this instance: CUDA on its GPU for KIND_GPU, else the CPU."""
    if args.get("model_instance_kind") != "GPU":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise RuntimeError(
            f"{args['model_name']} is placed on a GPU (--device gpu) but this onnxruntime "
            f"{ort.__version__} has no CUDAExecutionProvider: install onnxruntime-gpu in the "
            "Python backend's environment, or rebuild the repository with --device cpu")
    device = int(args.get("model_instance_device_id", "0"))
    return [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"]
