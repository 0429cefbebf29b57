"""Build the TensorRT engines of a `--backend tensorrt` repository, where TensorRT is installed.

A tensorrt repository ships each graph model as `1/model.onnx` plus `1/engine.json` (precision
and optimization profiles, written by backends.TensorRTBackend); Triton's tensorrt_plan platform
loads `1/model.plan`. Engines are specific to the GPU model and the TensorRT version, so they are
built on (a machine like) the serving host, typically inside NVIDIA's Triton container:

    docker run --gpus all -v $PWD/repo:/repo nvcr.io/nvidia/tritonserver:24.10-py3 \\
        bash -c "pip install 'bionemo-export[engines]' && bionemo-export engines build /repo"

`build_engines(repository)`:
- checks the repository first (consistency.check_repository), so an engine is never built from a
  config that disagrees with its graph;
- builds each engine with every profile of its engine.json, fp16 unless the recipe or
  `precision` says fp32, with one timing cache for the repository (`engines.timing_cache`), so a
  rebuild re-times nothing it has seen;
- skips an engine whose recorded build (`built` in engine.json: the ONNX file's digest, the
  precision, the profiles, TensorRT's version and the GPU) matches this host: restarting a server
  or re-running the step never rebuilds; `force` rebuilds;
- records TensorRT's version, the GPU and each engine in manifest.json (`engines`), and the
  digests of the plans and engine.json files beside the build's (`files`), which serve checks.

It lives with the serving host's code (runtime), not with the exporters: an engine belongs to the
host that serves it (its GPU, its TensorRT), it starts from a finished repository rather than a
PyTorch model, and it must run where only the base install is (no torch), e.g. in NVIDIA's Triton
container. It reads the repository through model_repository (the check, engine.json, the manifest
and its file records), a layer below. Its check reads each graph's inputs and outputs with the
`onnx` package, which the base install does not carry (pip install 'bionemo-export[engines]').
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from bionemo_export.choices import EnginePrecision
from bionemo_export.digests import file_digest
from bionemo_export.errors import UserError
from bionemo_export.model_repository.backends import ENGINE_FILE, engine_json
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.integrity import update_records
from bionemo_export.model_repository.manifest import Manifest

TIMING_CACHE = "engines.timing_cache"
WORKSPACE_BYTES = 4 << 30
"""TensorRT's scratch memory limit while it times tactics (4 GiB)."""


class EngineBuildError(UserError, RuntimeError):
    """An engine could not be built; the message says which and what to do."""


@dataclass(frozen=True)
class EngineResult:
    model: str
    status: str
    """"built" or "up to date"."""
    seconds: float = 0.0
    bytes: int = 0


def engine_recipes(repository: Path) -> dict[str, Path]:
    """Model name -> its version folder, for every model with an engine.json."""
    return {recipe.parent.parent.name: recipe.parent for recipe in sorted(repository.glob(f"*/1/{ENGINE_FILE}"))}


def _digest(path: Path) -> str:
    return "sha256:" + file_digest(path)["sha256"]


def gpu_name(device: int = 0) -> str:
    """The GPU's product name (NVML), or "unknown" where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(device))
        finally:
            pynvml.nvmlShutdown()
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # noqa: BLE001 - no driver, no NVML: the record says so
        return "unknown"


def import_tensorrt():
    """The tensorrt module, or EngineBuildError saying where engines can be built."""
    try:
        import tensorrt  # pyright: ignore[reportMissingImports]  # NVIDIA's, not on this machine
    except ImportError as err:
        raise EngineBuildError(
            "TensorRT is not installed here, so no engine can be built. Build them on the GPU host that "
            "serves the repository, e.g. inside NVIDIA's Triton container: docker run --gpus all -v "
            "REPO:/repo nvcr.io/nvidia/tritonserver:24.10-py3 bash -c 'pip install \"bionemo-export[engines]\" && "
            "bionemo-export engines build /repo'") from err
    return tensorrt


def require_onnx() -> None:
    """EngineBuildError unless the `onnx` package, with which the check before a build reads each
    graph's inputs and outputs, imports here. Where TensorRT is missing too, TensorRT's error comes
    first: no engine can be built on this host whatever else is installed, and the fix is to build
    where TensorRT is, not to install onnx."""
    try:
        import onnx  # noqa: F401
    except ImportError as err:
        import_tensorrt()
        raise EngineBuildError(
            "The onnx package is not installed here: `engines build` checks each config.pbtxt against its "
            "graph (model.onnx) before building an engine from it. Install it with: pip install "
            "'bionemo-export[engines]' (or pip install onnx)") from err


def build_engines(repository: Path, *, precision: str | None = None, force: bool = False,
                  progress: Callable[[str], None] = lambda message: None) -> list[EngineResult]:
    """Build every missing or outdated engine of `repository` (see the module docstring)."""
    if precision is not None:  # before any work: a ChoiceError naming the setting and its choices
        precision = EnginePrecision.parse(precision, "precision")
    recipes = engine_recipes(repository)
    if not recipes:
        raise EngineBuildError(f"{repository} has no TensorRT models (no */1/{ENGINE_FILE}): build it with "
                               "`bionemo-export build repo --backend tensorrt`")
    require_onnx()
    findings = check_repository(repository)
    if findings:
        raise EngineBuildError(f"{repository} is inconsistent; no engine built:\n  " + "\n  ".join(findings))
    trt = import_tensorrt()
    gpu = gpu_name()
    cache_path = repository / TIMING_CACHE
    results = []
    for model, version in recipes.items():
        recipe = json.loads((version / ENGINE_FILE).read_text())
        wanted = {"onnx_digest": _digest(version / recipe["onnx"]), "precision": precision or recipe["precision"],
                  "profiles": recipe["profiles"], "tensorrt": trt.__version__, "gpu": gpu}
        built = recipe.get("built") or {}
        if not force and (version / recipe["plan"]).is_file() and all(built.get(k) == v for k, v in wanted.items()):
            progress(f"{model}: engine up to date")
            results.append(EngineResult(model, "up to date"))
            continue
        progress(f"{model}: building the {wanted['precision']} engine ({len(recipe['profiles'])} profiles) on {gpu}")
        started = time.perf_counter()
        plan = _build_engine(trt, version / recipe["onnx"], recipe["profiles"], wanted["precision"], cache_path,
                             model)
        (version / recipe["plan"]).write_bytes(plan)
        seconds = round(time.perf_counter() - started, 1)
        recipe["built"] = {**wanted, "seconds": seconds, "bytes": len(plan),
                           "at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        (version / ENGINE_FILE).write_text(engine_json(recipe))
        results.append(EngineResult(model, "built", seconds, len(plan)))
    _record(repository, trt.__version__, gpu, recipes)
    return results


def _build_engine(trt, onnx_path: Path, profiles: list[dict], precision: str, cache_path: Path, model: str) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:  # explicit batch is the only mode from TensorRT 10 on
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # by path: external data is read beside it
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineBuildError(f"{model}: TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    cache = config.create_timing_cache(cache_path.read_bytes() if cache_path.is_file() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    for shapes in profiles:
        profile = builder.create_optimization_profile()
        for name, dims in shapes.items():
            profile.set_shape(name, dims["min"], dims["opt"], dims["max"])
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise EngineBuildError(f"{model}: TensorRT failed to build the engine (its log above says why)")
    cache_path.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(serialized)


def _record(repository: Path, version: str, gpu: str, recipes: dict[str, Path]) -> None:
    """Write what `recorded_engines` adds to manifest.json."""
    recorded_engines(Manifest.read(repository), repository, version, gpu, recipes).write(repository)


def recorded_engines(manifest: Manifest, repository: Path, version: str, gpu: str,
                     recipes: dict[str, Path]) -> Manifest:
    """`manifest` with the engines built (TensorRT version, GPU, each model's build record) and
    the digests of the files Triton now loads: each model.plan and the engine.json that records
    it, built or found up to date (a plan built before digests were recorded is recorded too).
    The other files' digests are kept as the build recorded them (integrity.update_records), so a
    model.onnx changed before this step is still reported when the repository is served.

    The timing cache (TIMING_CACHE, at the root) is not recorded: it is generated state, TensorRT's
    memory of timed tactics, which the next `engines build` rewrites and no server reads; a stale
    one only costs re-timing. The check ignores files outside the model folders."""
    built, written = {}, []
    for model, folder in recipes.items():
        recipe = json.loads((folder / ENGINE_FILE).read_text())
        built[model] = recipe["built"]
        relative = folder.relative_to(repository).as_posix()
        written += [f"{relative}/{recipe['plan']}", f"{relative}/{ENGINE_FILE}"]
    engines = {"tensorrt": version, "gpu": gpu, "models": built}
    return replace(manifest, engines=engines, files=update_records(manifest.files, repository, written))
