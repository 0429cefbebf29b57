"""Optimize exported graphs for ONNX Runtime once, at build time, and store them optimized.

    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512)                    # fp32
    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512, precision="int8")  # CPU int8

The steps, in order (each measured in benchmarks/graph_optimization.py on AntiBERTy and ESM-2):

1. **Attention fusion** (`fuse_attention`, this module). Exporters decompose attention into
   MatMul, scaling, a mask (Add or Where), Softmax, a NaN guard (torch.onnx's
   scaled_dot_product_attention) and a second MatMul, each a pass over a [batch, heads, length,
   length] tensor. The subgraph becomes one `com.microsoft.MultiHeadAttention` node with the same
   scale and the same additive mask (`attention_bias`), whatever produced the queries and keys
   (BERT's projections, ESM-2's rotary embeddings, the project's own transformer).
   ONNX Runtime's transformer optimizer fuses none of these (0 Attention nodes on the
   dynamo-exported BERT and ESM-2 graphs, onnxruntime 1.31): it expects older exporters' masks.
2. **ONNX Runtime's transformer fusions** (`onnxruntime.transformers.optimizer.optimize_model`,
   model_type "bert", opt_level 0): Gelu/BiasGelu and LayerNormalization, which the runtime's own
   optimizer misses on the dynamo graph (its Erf-based GELU stays 5 nodes). Its attention fusion is
   off (step 1 does it) and so is SkipLayerNormalization: its CPU kernel measured ~3x slower than
   Add + LayerNormalization here (onnxruntime 1.31).
3. **Reduced precision**, when asked: `int8` = `onnxruntime.quantization.quantize_dynamic`
   (int8 weights per output channel for MatMul with constant weights; activations quantized per
   tensor at run time, which VNNI/AMX CPUs run fast); `fp16` = float16 weights and compute with
   float32 graph inputs and outputs (`onnxruntime.transformers.float16`), meant for GPU hosts.
4. **ONNX Runtime's offline graph optimization** at the extended level (constant folding,
   MatMul+scale/transpose -> FusedMatMul, the int8 MatMul fusions, redundant nodes), saved with
   `SessionOptions.optimized_model_filepath`. Extended, not "all": "all" adds layout
   transformations specific to this CPU, which a repository copied to another host must not carry.
   Skipped for fp16 (the GPU host's runtime optimizes for its own execution provider).

A server then opens the stored graph at `ORT_ENABLE_BASIC` (SERVING_GRAPH_OPTIMIZATION_LEVEL):
the expensive rewrites are already in the file, and "all" measured no faster.

Models with more than ~1.8 GB of weights are read and written with external data (one
`<name>.onnx.data` file next to the graph, as the exporter writes them); step 2, which needs the
whole graph in one protobuf, is skipped for them (recorded in `skipped`).

A graph whose weights times MEMORY_FACTOR exceed the free memory is not optimized (the step
raises, the build keeps the plain export and says why).

`optimize_and_verify` is what the build calls: it makes candidates in order (ATTEMPTS), checks
each against the PyTorch module with the precision's tolerance (exporters/verification.py) and
keeps the first that passes. For fp32 it falls back to the plain export, with the reason logged
and recorded, when no optimized graph verifies. For int8 the candidates keep a growing share of
the feed-forward output MatMuls (the most sensitive to int8, ranked by their simulated int8 error
on the build's sample batch) in fp32; when none passes, the build fails with the figures rather
than silently shipping another precision.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

LOG = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"
OPTIMIZATION_LEVELS = ("none", "basic", "extended")
DEFAULT_LEVEL = "extended"
PRECISIONS = ("fp32", "int8", "fp16")
SERVING_GRAPH_OPTIMIZATION_LEVEL = "ORT_ENABLE_BASIC"
"""The ONNX Runtime session level for a graph stored by `optimize_onnx` (fp32, int8)."""
UNOPTIMIZED_SERVING_LEVEL = "ORT_ENABLE_ALL"
"""The session level for a graph stored without offline optimization (plain export, fp16)."""
EXTERNAL_DATA_THRESHOLD_BYTES = 1_800_000_000
"""Same rule as the exporter: weights above this are written as external data."""
MASK_FILL_LIMIT = -1e4
"""A Where-mask fill value at or below this is a "masked out" score (finfo.min, -inf, -1e4)."""
DISABLED_RUNTIME_FUSIONS = ("SkipLayerNormFusion",)
"""ONNX Runtime optimizers left out of the offline optimization (see step 2 above)."""


class OptimizationError(RuntimeError):
    """An optimization step failed; the build keeps the unoptimized graph and logs this."""


@dataclass(frozen=True)
class OptimizationResult:
    """What `optimize_onnx` wrote and which rewrites it applied, for manifest.json."""

    path: Path
    precision: str
    level: str
    """ONNX Runtime's offline level applied: "none", "basic" or "extended"."""
    applied: tuple[str, ...]
    """The steps that changed the graph, in order."""
    fused: dict[str, int]
    """Fused / contrib operator -> count in the written graph."""
    skipped: tuple[str, ...]
    """Steps left out, each with its reason."""
    nodes_before: int
    nodes_after: int
    external_data: bool
    bytes: int
    """Size of the graph file plus its external data."""
    seconds: float
    versions: dict[str, str]
    serving_graph_optimization_level: str
    quantization: dict[str, Any] = field(default_factory=dict)
    """int8: the method and the MatMuls kept in fp32; fp16: the method."""

    def to_dict(self) -> dict[str, Any]:
        result = dataclasses.asdict(self)
        result["path"] = self.path.name
        result["applied"] = list(self.applied)
        result["skipped"] = list(self.skipped)
        return result


def optimize_onnx(
    src: Path,
    dst: Path,
    *,
    num_heads: int | None,
    hidden_size: int | None,
    precision: str = "fp32",
    level: str = DEFAULT_LEVEL,
    fuse: bool = True,
    keep_fp32: float = 0.0,
    calibration: dict[str, np.ndarray] | None = None,
    external_data: bool | None = None,
) -> OptimizationResult:
    """Optimize the graph at `src` (with its external data, if any) and write it to `dst`.

    `num_heads`/`hidden_size` (the model's attention heads and width) enable the attention and
    transformer fusions; None skips them. `precision`: "fp32", "int8" or "fp16". `keep_fp32`
    (int8): the fraction of the feed-forward output MatMuls (those fed by a GELU, the most sensitive
    to int8) left in fp32, those whose simulated int8 error on `calibration` (one batch of graph
    inputs) is largest; without `calibration`, the last ones. `external_data`: None decides by the
    weights' size. Raises OptimizationError when a step fails (dst is then not written).
    """
    if level not in OPTIMIZATION_LEVELS:
        raise ValueError(f"unknown optimization level {level!r}; choose one of {', '.join(OPTIMIZATION_LEVELS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if not 0.0 <= keep_fp32 <= 1.0:
        raise ValueError(f"keep_fp32 is a fraction between 0 and 1, not {keep_fp32}")
    import onnxruntime as ort

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("optimize_onnx writes a new file: dst must differ from src")
    start = time.perf_counter()
    applied: list[str] = []
    skipped: list[str] = []
    quantization: dict[str, Any] = {}
    _check_memory(src)
    try:
        model = onnx.load(str(src))  # with its external data
    except Exception as err:
        raise OptimizationError(f"cannot load {src}: {err}") from err
    nodes_before = len(model.graph.node)
    external = _weight_bytes(model) > EXTERNAL_DATA_THRESHOLD_BYTES if external_data is None else external_data
    if fuse and num_heads:
        fused = _step("attention fusion", lambda: fuse_attention(model, num_heads))
        if fused:
            applied.append(f"attention_fusion(MultiHeadAttention x{fused})")
        else:
            skipped.append("attention_fusion: no attention subgraph recognized")
    elif fuse:
        skipped.append("attention_fusion: number of heads unknown")
    _remove_unused(model.graph)
    if fuse and num_heads and hidden_size:
        if external:
            skipped.append("transformer_fusions: the graph needs external data (over 2 GiB in one protobuf)")
        else:
            model, stats = _step("transformer fusions", lambda: _transformer_fusions(model, num_heads, hidden_size))
            if stats:
                applied.append("transformer_fusions(" + ", ".join(f"{op} x{n}" for op, n in stats.items()) + ")")
    if precision == "int8":
        quantization = _step("int8 quantization",
                             lambda: _quantize_int8(model, keep_fp32, calibration, external))
        model = quantization.pop("model")
        applied.append("quantize_dynamic(int8)")
    elif precision == "fp16":
        model = _step("fp16 conversion", lambda: _convert_fp16(model, external))
        quantization = {"method": FP16_METHOD}
        applied.append("float16(keep_io_types)")
    if precision == "fp16" and level != "none":
        skipped.append(f"onnxruntime_{level}: fp16 graphs are for GPU hosts, whose runtime optimizes for its own "
                       "execution provider")
        level = "none"

    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_file(dst)
    with tempfile.TemporaryDirectory(prefix=".bionemo-export-opt-", dir=dst.parent) as work:
        if level == "none":
            _save(model, dst, external)
        else:
            staged = Path(work) / "staged.onnx"
            _save(model, staged, external)
            del model
            _step(f"ONNX Runtime {level} optimization", lambda: _runtime_optimize(staged, dst, level, external))
            applied.append(f"onnxruntime_{level}")
    written = onnx.load(str(dst), load_external_data=False)
    size = dst.stat().st_size + (_data_path(dst).stat().st_size if _data_path(dst).exists() else 0)
    return OptimizationResult(
        path=dst,
        precision=precision,
        level=level,
        applied=tuple(applied),
        fused=fused_operators(written),
        skipped=tuple(skipped),
        nodes_before=nodes_before,
        nodes_after=len(written.graph.node),
        external_data=external,
        bytes=size,
        seconds=round(time.perf_counter() - start, 3),
        versions={"onnxruntime": ort.__version__, "onnx": onnx.__version__},
        serving_graph_optimization_level=(SERVING_GRAPH_OPTIMIZATION_LEVEL if level != "none"
                                          else UNOPTIMIZED_SERVING_LEVEL),
        quantization=quantization,
    )


MEMORY_FACTOR = 2.5
"""Free memory an optimization needs, in multiples of the graph's weights: the graph in memory,
ONNX Runtime's copy while it optimizes, and the quantizer's or converter's working copies."""


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_memory(src: Path) -> None:
    """Refuse (OptimizationError, so the build keeps the plain graph) when the graph's weights
    times MEMORY_FACTOR exceed the memory available: a 3B-parameter model (12 GB of fp32 weights)
    would otherwise be killed mid-build on a 24 GB host that held the export."""
    weights = src.stat().st_size + (_data_path(src).stat().st_size if _data_path(src).exists() else 0)
    available = available_memory_bytes()
    if available is not None and weights * MEMORY_FACTOR > available:
        raise OptimizationError(
            f"skipped: optimizing {weights / 2**30:.1f} GiB of weights needs about "
            f"{weights * MEMORY_FACTOR / 2**30:.1f} GiB of free memory; {available / 2**30:.1f} GiB is available")


def _step(what: str, run):
    """Run one step; any failure becomes an OptimizationError naming the step."""
    try:
        return run()
    except OptimizationError:
        raise
    except Exception as err:  # a pattern we mis-read or a runtime refusal must not fail the build
        raise OptimizationError(f"{what} failed: {type(err).__name__}: {err}") from err


FUSED_OPERATORS = ("MultiHeadAttention", "Attention", "SkipLayerNormalization", "LayerNormalization",
                   "BiasGelu", "FastGelu", "Gelu", "RotaryEmbedding", "FusedMatMul", "FusedGemm",
                   "EmbedLayerNormalization", "MatMulInteger", "DynamicQuantizeMatMul",
                   "MatMulIntegerToFloat", "DynamicQuantizeLinear")


def fused_operators(model: onnx.ModelProto) -> dict[str, int]:
    """Counts of the fused / contrib operators in `model` (those present only)."""
    counts = collections.Counter(node.op_type for node in model.graph.node)
    return {op: counts[op] for op in FUSED_OPERATORS if counts[op]}


def _transformer_fusions(model: onnx.ModelProto, num_heads: int, hidden_size: int
                         ) -> tuple[onnx.ModelProto, dict[str, int]]:
    """onnxruntime.transformers' BERT fusions without attention and SkipLayerNormalization."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_attention = False  # fuse_attention did it
    options.enable_skip_layer_norm = False
    options.enable_bias_skip_layer_norm = False
    options.enable_embed_layer_norm = False  # needs BERT's exact embedding layout; ESM differs
    quiet = logging.getLogger("onnxruntime.transformers")
    previous = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        optimized = optimize_model(model, model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                   optimization_options=options, opt_level=0, use_gpu=False)
    finally:
        quiet.setLevel(previous)
    stats = {op: n for op, n in optimized.get_fused_operator_statistics().items()
             if n and op not in ("LayerNormalization", "MultiHeadAttention", "Attention")}
    return optimized.model, stats


def _runtime_optimize(src: Path, dst: Path, level: str, external: bool) -> None:
    """ONNX Runtime's offline optimization of `src`, written to `dst` (+ its external data)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    options.log_severity_level = 3
    written = src.with_name("optimized.onnx")
    options.optimized_model_filepath = str(written)
    if external:
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         _data_path(dst).name)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=list(DISABLED_RUNTIME_FUSIONS))
    # ONNX Runtime stamps every domain it knows (ai.onnx.ml 5, com.microsoft.nchwc, training, ...):
    # keep those the nodes use, so an older runtime (a Triton container's) is not asked for more.
    graph = onnx.load(str(written), load_external_data=False)
    used = {node.domain or "" for node in graph.graph.node}
    kept = [opset for opset in graph.opset_import if (opset.domain or "") in used | {""}]
    del graph.opset_import[:]
    graph.opset_import.extend(kept)
    onnx.save_model(graph, str(dst))  # the external data references stay as they are
    written.unlink()
    if external:
        _data_path(dst).unlink(missing_ok=True)
        (written.parent / _data_path(dst).name).rename(_data_path(dst))
        _data_path(dst).chmod(dst.stat().st_mode & 0o777)


class PrecisionError(RuntimeError):
    """No reduced-precision graph met its tolerance; the message has the figures."""


@dataclass(frozen=True)
class VerifiedGraph:
    """The graph a build stores for one model, and how it got there."""

    path: Path
    """The optimized graph, or the plain export when optimization failed or was not asked."""
    report: Any
    """Its VerificationReport against PyTorch (fp32)."""
    record: dict[str, Any]
    """manifest.json's `optimization` entry: precision, steps applied, fused operators, the
    serving level, and `fallback` (why the plain export was kept) or None."""


ATTEMPTS: dict[str, tuple[dict[str, Any], ...]] = {
    "fp32": ({},),
    # int8: everything, then a growing share of the feed-forward output MatMuls in fp32 (the most
    # sensitive: AntiBERTy's embeddings went from min cosine 0.9987 to 0.9990 / 0.9992 / 0.9995 with
    # 1/4, 1/2, all of them kept), then without the fusions in case they are what disagrees.
    "int8": ({}, {"keep_fp32": 0.25}, {"keep_fp32": 0.5}, {"keep_fp32": 1.0}, {"fuse": False, "keep_fp32": 1.0}),
    "fp16": ({}, {"fuse": False}),
}
"""The optimize_onnx options tried in order for each precision; the first that verifies is kept."""


def optimize_and_verify(
    module: Any,
    plain: Path,
    plain_report: Any,
    work: Path,
    batches: Sequence[Any],
    *,
    num_heads: int | None,
    hidden_size: int | None,
    atol: float,
    min_cosine: float,
    output_names: Sequence[str],
    mask_input: str,
    precision: str = "fp32",
    optimize: bool = True,
    log: Any = None,
) -> VerifiedGraph:
    """Optimize the verified plain export `plain` (and convert it to `precision`), check each
    candidate against `module` on `batches` with the precision's tolerance (fp32: the family's
    `atol`/`min_cosine`), and return the first that passes.

    fp32: when nothing passes (or optimize is False) the plain export is kept, with the reason
    logged and recorded. int8/fp16: raises PrecisionError when no candidate meets the tolerance.
    """
    from bionemo_export.exporters.verification import precision_tolerances, verify_onnx

    log = log or LOG.warning
    tolerances = precision_tolerances(precision, output_names, atol, min_cosine)
    if precision == "fp32" and not optimize:
        return VerifiedGraph(plain, plain_report, _plain_record("not asked (--no-optimize)"))
    failures: list[dict[str, Any]] = []
    for index, options in enumerate(ATTEMPTS[precision]):
        options = dict(options)
        if not optimize:
            options.update(fuse=False, level="none" if precision != "int8" else DEFAULT_LEVEL)
        destination = Path(work) / f"{precision}-{index}" / plain.name
        if precision == "int8":
            options.setdefault("calibration", {name: np.asarray(value) for name, value in batches[0].items()})
        try:
            result = optimize_onnx(plain, destination, num_heads=num_heads, hidden_size=hidden_size,
                                   precision=precision, **options)
        except OptimizationError as err:
            failures.append({"options": _options_record(options), "error": str(err)})
            log(f"{plain.parent.name}: {precision} optimization {_options_text(options)} failed: {err}")
            continue
        try:
            report = verify_onnx(module, result.path, batches, atol=atol, min_cosine=min_cosine,
                                 output_names=output_names, mask_input=mask_input,
                                 tolerances=tolerances if precision != "fp32" else None)
        except Exception as err:  # ONNX Runtime refusing to run the rewritten graph
            failures.append({"options": _options_record(options), "error": f"{type(err).__name__}: {err}"})
            log(f"{plain.parent.name}: the {precision} graph {_options_text(options)} does not run: {err}")
            continue
        if report.passed:
            record = {**result.to_dict(), "fallback": None, "rejected": failures}
            return VerifiedGraph(result.path, report, record)
        figures = {check.name: {"max_abs_error": check.max_abs_error, "min_cosine": check.min_cosine,
                                "required_min_cosine": tolerances[check.name].min_cosine}
                   for check in report.outputs}
        failures.append({"options": _options_record(options), "applied": list(result.applied),
                         "figures": figures})
        log(f"{plain.parent.name}: the {precision} graph {_options_text(options)} is outside tolerance: "
            + "; ".join(f"{name} min cosine {f['min_cosine']:.6f} (required {f['required_min_cosine']:g}), "
                        f"max abs error {f['max_abs_error']:.3g}" for name, f in figures.items()))
    if precision == "fp32":
        reason = "the optimized graph " + ("; ".join(_failure_text(f) for f in failures) or "was not produced")
        log(f"{plain.parent.name}: keeping the unoptimized graph: {reason}")
        return VerifiedGraph(plain, plain_report, {**_plain_record(reason), "rejected": failures})
    raise PrecisionError(
        f"no {precision} graph of {plain.parent.name} meets the {precision} tolerance against PyTorch fp32 ("
        + ", ".join(f"{name} min cosine {t.min_cosine:g}" for name, t in tolerances.items()) + "): "
        + "; ".join(_failure_text(f) for f in failures)
        + f". Build with --precision fp32{' or fp16' if precision == 'int8' else ''}.")


def _plain_record(reason: str) -> dict[str, Any]:
    return {"precision": "fp32", "applied": [], "fused": {}, "level": "none",
            "serving_graph_optimization_level": UNOPTIMIZED_SERVING_LEVEL, "fallback": reason}


def _options_record(options: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in options.items() if key != "calibration"}


def _options_text(options: dict[str, Any]) -> str:
    record = _options_record(options)
    return f"with {record}" if record else "with all steps"


def _failure_text(failure: dict[str, Any]) -> str:
    what = _options_text(failure["options"])
    if "error" in failure:
        return f"{what}: {failure['error']}"
    return f"{what}: " + ", ".join(f"{name} min cosine {f['min_cosine']:.6f}, max abs error {f['max_abs_error']:.3g}"
                                   for name, f in failure["figures"].items())


# --------------------------------------------------------------------------------------------
# Attention fusion
# --------------------------------------------------------------------------------------------


class _Graph:
    """Producer/consumer maps and constant lookup over a GraphProto (rebuilt after each rewrite)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = collections.defaultdict(list)
        for node in graph.node:
            for name in node.output:
                self.producer[name] = node
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
        self.initializers = {init.name: init for init in graph.initializer}
        self.outputs = {value.name for value in graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        """The value of `name` if it is an initializer or a Constant node's output."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
                if attribute.name == "value_float":
                    return np.array(attribute.f, dtype=np.float32)
                if attribute.name == "value_int":
                    return np.array(attribute.i, dtype=np.int64)
        return None

    def scalar(self, name: str) -> float | None:
        value = self.constant(name)
        if value is None or value.size != 1 or not np.issubdtype(value.dtype, np.floating):
            return None
        return float(value.reshape(()))

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        found = self.consumers.get(name, [])
        return found[0] if len(found) == 1 and name not in self.outputs else None


def _attribute(node: onnx.NodeProto, name: str, default: Any = None) -> Any:
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


@dataclass
class _Match:
    """One attention subgraph: softmax(q @ k^T * scale + bias) @ v."""

    query: str
    key: str
    key_layout: str
    """"bnsh" ([batch, heads, length, head]) or "bsnh" ([batch, length, heads, head])."""
    value: str
    bias: str | None
    """An additive float mask, broadcastable to [batch, heads, queries, keys]; None: no mask."""
    where_mask: tuple[str, float, bool] | None
    """(condition, fill, fill_when_true) when the mask is a Where on the scores."""
    scale: float
    output: str
    nodes: list[onnx.NodeProto]
    """The nodes the fused node replaces (their outputs feed only each other)."""


def fuse_attention(model: onnx.ModelProto, num_heads: int) -> int:
    """Replace every attention subgraph of `model` (in place) by a com.microsoft.MultiHeadAttention
    node; returns how many were fused. Subgraphs whose intermediate values are used elsewhere, or
    whose scale is not a constant, are left alone."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 15:  # the fused subgraph uses Shape(start, end), opset 15
        return 0
    matches: list[_Match] = []
    view = _Graph(graph)
    claimed: set[int] = set()
    for node in graph.node:
        if node.op_type != "Softmax":
            continue
        match = _match_attention(view, node)
        if match is None or any(id(n) in claimed for n in match.nodes):
            continue
        claimed.update(id(n) for n in match.nodes)
        matches.append(match)
    if not matches:
        return 0
    if not any(opset.domain == MS_DOMAIN for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    constants = _Constants(graph)
    replaced = {id(n) for m in matches for n in m.nodes}
    by_output_node = {id(m.nodes[-1]): m for m in matches}  # the final MatMul
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if id(node) in by_output_node:
            new_nodes.extend(_fused_nodes(by_output_node[id(node)], num_heads, constants, view))
        elif id(node) not in replaced:
            new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    _cancel_transposes(graph)
    _remove_unused(graph)
    return len(matches)


def _match_attention(view: _Graph, softmax: onnx.NodeProto) -> _Match | None:
    axis = _attribute(softmax, "axis", -1)
    if axis not in (-1, 3):
        return None
    nodes = [softmax]
    probabilities = softmax.output[0]
    # torch.onnx's SDPA: Where(IsNaN(p), 0, p) after the softmax.
    consumers = view.consumers.get(probabilities, [])
    if probabilities in view.outputs:
        return None
    if len(consumers) == 2 and {c.op_type for c in consumers} == {"IsNaN", "Where"}:
        isnan = next(c for c in consumers if c.op_type == "IsNaN")
        where = next(c for c in consumers if c.op_type == "Where")
        if (view.only_consumer(isnan.output[0]) is not where or where.input[0] != isnan.output[0]
                or where.input[2] != probabilities or view.scalar(where.input[1]) != 0.0):
            return None
        nodes += [isnan, where]
        probabilities = where.output[0]
    final = view.only_consumer(probabilities)
    if final is None or final.op_type != "MatMul" or final.input[0] != probabilities:
        return None
    value = final.input[1]

    # Softmax input: scores (+ bias | Where mask | nothing).
    scores_name = softmax.input[0]
    bias = where_mask = None
    producer = view.producer.get(scores_name)
    if producer is None or view.only_consumer(scores_name) is not softmax:
        return None
    if producer.op_type == "Add":
        scored = [name for name in producer.input if _leads_to_matmul(view, name)]
        if len(scored) != 1:
            return None
        bias = next(name for name in producer.input if name != scored[0])
        nodes.append(producer)
        scores_name = scored[0]
    elif producer.op_type == "Where":
        condition, when_true, when_false = producer.input
        fill_true, fill_false = view.scalar(when_true), view.scalar(when_false)
        if fill_true is not None and fill_true <= MASK_FILL_LIMIT and _leads_to_matmul(view, when_false):
            where_mask, scores_name = (condition, fill_true, True), when_false
        elif fill_false is not None and fill_false <= MASK_FILL_LIMIT and _leads_to_matmul(view, when_true):
            where_mask, scores_name = (condition, fill_false, False), when_true
        else:
            return None
        nodes.append(producer)
    elif not _leads_to_matmul(view, scores_name):
        return None
    if scores_name != softmax.input[0] and view.only_consumer(scores_name) is None:
        return None

    # Scores: [Mul|Div by a constant] of MatMul(q', k'^T).
    scale = 1.0
    producer = view.producer[scores_name]
    if producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        if factor is None:
            return None
        scale *= factor[0]
        nodes.append(producer)
        scores_name = factor[1]
        producer = view.producer.get(scores_name)
        if producer is None or view.only_consumer(scores_name) is None:
            return None
    if producer.op_type != "MatMul":
        return None
    nodes.append(producer)
    query, key_transposed = producer.input
    query, factor = _unscaled(view, query, nodes)
    scale *= factor
    key_transposed, factor = _unscaled(view, key_transposed, nodes)
    scale *= factor
    found = _untransposed_key(view, key_transposed, nodes)
    if found is None or not math.isfinite(scale) or scale == 0.0:
        return None
    key, key_layout = found
    nodes.append(final)  # last: the node the fused ones take the place of
    # Every intermediate value must feed only the subgraph.
    inside = {id(n) for n in nodes}
    for node in nodes[:-1]:
        for name in node.output:
            if name in view.outputs or any(id(c) not in inside for c in view.consumers.get(name, [])):
                return None
    return _Match(query, key, key_layout, value, bias, where_mask, scale, final.output[0], nodes)


def _leads_to_matmul(view: _Graph, name: str) -> bool:
    """Whether `name` is a MatMul output, directly or through one Mul/Div by a constant."""
    producer = view.producer.get(name)
    if producer is None:
        return False
    if producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        producer = view.producer.get(factor[1]) if factor else None
    return producer is not None and producer.op_type == "MatMul"


def _scale_of(view: _Graph, node: onnx.NodeProto) -> tuple[float, str] | None:
    """(factor, the other input) when `node` is Mul/Div of a tensor by a scalar constant."""
    first, second = node.input
    if node.op_type == "Div":
        divisor = view.scalar(second)
        return (1.0 / divisor, first) if divisor else None
    for constant, other in ((first, second), (second, first)):
        factor = view.scalar(constant)
        if factor is not None:
            return factor, other
    return None


def _unscaled(view: _Graph, name: str, nodes: list[onnx.NodeProto]) -> tuple[str, float]:
    """`name` without a Mul/Div by a scalar constant (recorded in `nodes`), and that factor; `name`
    itself (factor 1) when it is not scaled or its scaled value is used elsewhere too."""
    producer = view.producer.get(name)
    if producer is not None and producer.op_type in ("Mul", "Div"):
        factor = _scale_of(view, producer)
        if factor is not None and view.only_consumer(name) is not None:
            nodes.append(producer)
            return factor[1], factor[0]
    return name, 1.0


def _untransposed_key(view: _Graph, name: str, nodes: list[onnx.NodeProto]) -> tuple[str, str] | None:
    """(keys, layout) for the transposed keys `name` ([batch, heads, head, length]): a Transpose
    with perm [0, 1, 3, 2] of [batch, heads, length, head] keys ("bnsh"), a Transpose with perm
    [0, 2, 3, 1] of [batch, length, heads, head] keys ("bsnh", the TorchScript exporter), or
    torch.onnx's Reshape -> Transpose([0, 2, 1]) -> Reshape with shapes from Shape(keys) ("bnsh",
    the dynamo exporter)."""
    producer = view.producer.get(name)
    if producer is None or view.only_consumer(name) is None:
        return None
    if producer.op_type == "Transpose":
        layout = {(0, 1, 3, 2): "bnsh", (0, 2, 3, 1): "bsnh"}.get(tuple(_attribute(producer, "perm", ())))
        if layout is None:
            return None
        nodes.append(producer)
        return producer.input[0], layout
    if producer.op_type != "Reshape":
        return None
    transpose = view.producer.get(producer.input[0])
    if transpose is None or transpose.op_type != "Transpose" or list(_attribute(transpose, "perm", [])) != [0, 2, 1]:
        return None
    first = view.producer.get(transpose.input[0])
    if first is None or first.op_type != "Reshape" or view.only_consumer(transpose.input[0]) is None:
        return None
    key = first.input[0]
    # Both target shapes must come from Shape(key) (and constants) only.
    for shape_input in (first.input[1], producer.input[1]):
        shapes = _shape_sources(view, shape_input)
        if not shapes or any(source != key for source in shapes):
            return None
    if view.only_consumer(transpose.output[0]) is None:
        return None
    nodes += [producer, transpose, first]
    return key, "bnsh"


def _shape_sources(view: _Graph, name: str, depth: int = 4) -> set[str] | None:
    """The tensors whose Shape feeds the shape tensor `name` through Slice/Concat/Gather/Unsqueeze
    and constants; None when something else does."""
    if view.constant(name) is not None:
        return set()
    producer = view.producer.get(name)
    if producer is None or depth == 0:
        return None
    if producer.op_type == "Shape":
        return {producer.input[0]}
    if producer.op_type not in ("Slice", "Concat", "Gather", "Unsqueeze", "Squeeze"):
        return None
    sources: set[str] = set()
    data_inputs = producer.input if producer.op_type == "Concat" else producer.input[:1]
    for data in data_inputs:
        found = _shape_sources(view, data, depth - 1)
        if found is None:
            return None
        sources |= found
    for index in producer.input[1:] if producer.op_type != "Concat" else ():
        if index and view.constant(index) is None:
            return None
    return sources


class _Constants:
    """New initializers added to the graph, shared by value."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.names = {init.name for init in graph.initializer} | {o for n in graph.node for o in n.output} | {
            i.name for i in graph.input}
        self.cache: dict[tuple, str] = {}

    def get(self, value: np.ndarray, stem: str) -> str:
        key = (value.dtype.str, value.shape, value.tobytes())
        if key not in self.cache:
            name = self.unique(stem)
            self.graph.initializer.append(numpy_helper.from_array(value, name))
            self.cache[key] = name
        return self.cache[key]

    def unique(self, stem: str) -> str:
        index = 0
        while f"{stem}_{index}" in self.names:
            index += 1
        name = f"{stem}_{index}"
        self.names.add(name)
        return name


def _fused_nodes(match: _Match, num_heads: int, constants: _Constants, view: _Graph) -> list[onnx.NodeProto]:
    """MultiHeadAttention over [batch, length, heads * head] views of q, k, v, its output turned
    back into [batch, heads, length, head] under the original output name."""
    nodes: list[onnx.NodeProto] = []
    flat = constants.get(np.array([0, 0, -1], dtype=np.int64), "mha_flat_shape")
    split = constants.get(np.array([0, 0, num_heads, -1], dtype=np.int64), "mha_split_shape")
    perm = [0, 2, 1, 3]

    def to_bsd(name: str, layout: str = "bnsh") -> str:
        flattened = constants.unique(f"{name}_bsd")
        if layout == "bnsh":
            transposed = constants.unique(f"{name}_bsnh")
            nodes.append(helper.make_node("Transpose", [name], [transposed], perm=perm, name=transposed))
            name = transposed
        nodes.append(helper.make_node("Reshape", [name, flat], [flattened], name=flattened))
        return flattened

    query, key, value = to_bsd(match.query), to_bsd(match.key, match.key_layout), to_bsd(match.value)
    bias = match.bias or ""
    if match.where_mask is not None:
        condition, fill, fill_when_true = match.where_mask
        zero = constants.get(np.array(0.0, dtype=np.float32), "mha_zero")
        filled = constants.get(np.array(fill, dtype=np.float32), "mha_fill")
        bias = constants.unique(f"{match.output}_attention_bias")
        inputs = [condition, filled, zero] if fill_when_true else [condition, zero, filled]
        nodes.append(helper.make_node("Where", inputs, [bias], name=bias))
    if bias:
        # MultiHeadAttention takes attention_bias [batch or 1, heads or 1, queries, keys]: expand a
        # bias broadcast over queries (e.g. [batch, 1, 1, keys]) to that shape.
        bias = _expanded_bias(bias, match, nodes, constants)
    fused_out = constants.unique(f"{match.output}_mha")
    nodes.append(helper.make_node(
        "MultiHeadAttention", [query, key, value, "", "", bias], [fused_out], domain=MS_DOMAIN,
        num_heads=num_heads, scale=float(match.scale), name=fused_out))
    split_out = constants.unique(f"{match.output}_bsnh")
    nodes.append(helper.make_node("Reshape", [fused_out, split], [split_out], name=split_out))
    nodes.append(helper.make_node("Transpose", [split_out], [match.output], perm=perm,
                                  name=constants.unique(f"{match.output}_bnsh")))
    return nodes


def _expanded_bias(bias: str, match: _Match, nodes: list[onnx.NodeProto], constants: _Constants) -> str:
    """Expand(bias, [shape(bias)[0], shape(bias)[1], queries, keys]) with queries and keys read
    from the query and key tensors ([batch, heads, length, head])."""
    def shape_slice(source: str, start: int, end: int) -> str:
        shape = constants.unique(f"{source}_shape")
        nodes.append(helper.make_node("Shape", [source], [shape], start=start, end=end, name=shape))
        return shape

    leading = shape_slice(bias, 0, 2)
    queries = shape_slice(match.query, 2, 3)
    keys = shape_slice(match.key, *((2, 3) if match.key_layout == "bnsh" else (1, 2)))
    target = constants.unique(f"{bias}_target")
    nodes.append(helper.make_node("Concat", [leading, queries, keys], [target], axis=0, name=target))
    expanded = constants.unique(f"{bias}_expanded")
    nodes.append(helper.make_node("Expand", [bias, target], [expanded], name=expanded))
    return expanded


def _cancel_transposes(graph: onnx.GraphProto) -> None:
    """Transpose(Transpose(x, p), q) with q∘p the identity -> x, for every consumer."""
    view = _Graph(graph)
    rename: dict[str, str] = {}
    for node in graph.node:
        if node.op_type != "Transpose":
            continue
        inner = view.producer.get(node.input[0])
        if inner is None or inner.op_type != "Transpose":
            continue
        outer_perm, inner_perm = _attribute(node, "perm"), _attribute(inner, "perm")
        if outer_perm is None or inner_perm is None or len(outer_perm) != len(inner_perm):
            continue
        if [inner_perm[axis] for axis in outer_perm] == list(range(len(outer_perm))):
            if node.output[0] not in view.outputs:
                rename[node.output[0]] = inner.input[0]
    if not rename:
        return
    def resolve(name: str) -> str:
        while name in rename:
            name = rename[name]
        return name
    for node in graph.node:
        for index, name in enumerate(node.input):
            if name in rename:
                node.input[index] = resolve(name)


def _remove_unused(graph: onnx.GraphProto) -> None:
    """Drop nodes whose outputs nothing uses, and initializers nothing reads."""
    while True:
        used = {name for node in graph.node for name in node.input} | {value.name for value in graph.output}
        keep = [node for node in graph.node if any(name in used for name in node.output)]
        if len(keep) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(keep)
    used = {name for node in graph.node for name in node.input}
    unused = [init for init in graph.initializer if init.name not in used]
    for init in unused:
        graph.initializer.remove(init)


# --------------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------------

INT8_METHOD = ("onnxruntime.quantization.quantize_dynamic: int8 weights per output channel (symmetric), "
               "MatMuls with constant weights; uint8 activations quantized per tensor at run time")
FP16_METHOD = "onnxruntime.transformers.float16: float16 weights and compute; float32 graph inputs and outputs"


def _quantize_int8(model: onnx.ModelProto, keep_fp32: float, calibration: dict[str, np.ndarray] | None,
                   external: bool) -> dict[str, Any]:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ranked, ranking = _ffn_outputs_by_error(model, calibration if keep_fp32 and not external else None)
    excluded = ranked[:math.ceil(keep_fp32 * len(ranked))]
    with tempfile.TemporaryDirectory(prefix="bionemo-export-int8-") as work:
        out = Path(work) / "int8.onnx"
        quantize_dynamic(
            model, str(out), op_types_to_quantize=["MatMul", "Gemm"], per_channel=True, reduce_range=False,
            weight_type=QuantType.QInt8, nodes_to_exclude=excluded, use_external_data_format=external,
            extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT},
        )
        quantized = onnx.load(str(out))
    counts = collections.Counter(node.op_type for node in quantized.graph.node)
    return {"model": quantized, "method": INT8_METHOD, "keep_fp32": keep_fp32,
            "kept_fp32": excluded, "kept_fp32_chosen_by": ranking if excluded else None,
            "matmuls_int8": counts["MatMulInteger"], "matmuls_fp32": counts["MatMul"]}


def _ffn_outputs_by_error(model: onnx.ModelProto, calibration: dict[str, np.ndarray] | None
                          ) -> tuple[list[str], str]:
    """The feed-forward output MatMuls (input from a GELU, weights constant), largest simulated
    int8 error first: relative error of (uint8 per-tensor input) x (int8 per-column weights)
    against fp32 on the calibration batch. Without a calibration batch: last layers first."""
    view = _Graph(model.graph)
    nodes = []
    for index, node in enumerate(model.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in view.initializers:
            continue
        producer = view.producer.get(node.input[0])
        if producer is not None and (producer.op_type in ("Gelu", "BiasGelu", "FastGelu", "QuickGelu")
                                     or _is_erf_gelu(view, producer)):
            node.name = node.name or f"matmul_{index}"
            nodes.append(node)
    if calibration is None or not nodes:
        return [node.name for node in reversed(nodes)], "position (last layers first)"
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    names = list(dict.fromkeys(node.input[0] for node in nodes))
    probe.graph.output.extend(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None) for name in names)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    inputs = {value.name: calibration[value.name] for value in session.get_inputs()}
    activations = dict(zip(names, session.run(names, inputs)))
    errors = {}
    for node in nodes:
        x = activations[node.input[0]].reshape(-1, activations[node.input[0]].shape[-1]).astype(np.float64)
        w = numpy_helper.to_array(view.initializers[node.input[1]]).astype(np.float64)
        exact = x @ w
        errors[node.name] = float(np.linalg.norm(_fake_quantize_activations(x) @ _fake_quantize_weights(w) - exact)
                                  / max(np.linalg.norm(exact), 1e-30))
    return sorted(errors, key=errors.get, reverse=True), "simulated int8 error on the build's sample batch"


def _fake_quantize_activations(x: np.ndarray) -> np.ndarray:
    """What DynamicQuantizeLinear does: uint8, asymmetric, one scale for the tensor."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (high - low) / 255 or 1.0
    zero = np.round(-low / scale)
    return (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale


def _fake_quantize_weights(w: np.ndarray) -> np.ndarray:
    """int8 symmetric, one scale per output column (per_channel=True)."""
    scale = np.abs(w).max(axis=0, keepdims=True) / 127
    scale[scale == 0] = 1.0
    return np.round(w / scale) * scale


def _is_erf_gelu(view: _Graph, node: onnx.NodeProto) -> bool:
    """Whether `node` ends an unfused erf GELU (x * 0.5 * (1 + erf(x / sqrt 2)) in some order)."""
    if node.op_type != "Mul":
        return False
    frontier, seen = [node], 0
    while frontier and seen < 6:
        current = frontier.pop()
        seen += 1
        if current.op_type == "Erf":
            return True
        frontier += [view.producer[name] for name in current.input if name in view.producer]
    return False


def _convert_fp16(model: onnx.ModelProto, external: bool) -> onnx.ModelProto:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=external)


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def _weight_bytes(model: onnx.ModelProto) -> int:
    return sum(len(init.raw_data) if init.raw_data else numpy_helper.to_array(init).nbytes
               for init in model.graph.initializer)


def _data_path(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def _remove_file(path: Path) -> None:
    path.unlink(missing_ok=True)
    _data_path(path).unlink(missing_ok=True)


def _save(model: onnx.ModelProto, path: Path, external: bool) -> None:
    _remove_file(path)
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=_data_path(path).name, size_threshold=1024)
    if external:
        _data_path(path).chmod(path.stat().st_mode & 0o777)
