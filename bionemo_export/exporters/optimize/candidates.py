"""One candidate graph: the exported graph optimized for ONNX Runtime (and converted to a reduced
precision) with one set of options, written once at build time.

    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512)                    # fp32
    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512, precision="int8")  # CPU int8
    result = optimize_onnx(src, dst, num_heads=8, hidden_size=512, precision="int4",  # CPU weight-only
                           block_size=32, accuracy_level=4)

The steps, in order (each measured in benchmarks/graph_optimization.py on AntiBERTy and ESM-2):

1. **Attention fusion** (attention.py): each attention subgraph becomes one MultiHeadAttention node,
   after the rotary fusion (rotary.py): each rotary position embedding (ESM-2's, ESM C's) becomes
   one RotaryEmbedding node.
2. **ONNX Runtime's transformer fusions** (`onnxruntime.transformers.optimizer.optimize_model`,
   model_type "bert", opt_level 0): Gelu/BiasGelu and LayerNormalization, which the runtime's own
   optimizer misses on the dynamo graph (its Erf-based GELU stays 5 nodes). Its attention fusion is
   off (step 1 does it) and so is SkipLayerNormalization: its CPU kernel measured ~3x slower than
   Add + LayerNormalization here (onnxruntime 1.31).
3. **Reduced precision**, when asked: int8 for CPUs (quantization.py), int8w and int4 weight-only
   for CPUs (weight_only.py), fp16 for GPU hosts (quantization.py). Then, but for fp16, the **key
   padding folded into the attention heads** (padding_mask.py), so that ONNX Runtime's CPU
   attention runs its flash kernel: 1.06-1.15x per ESM-2 150M int8 pass.
4. **ONNX Runtime's offline graph optimization** at the extended level (constant folding,
   MatMul+scale/transpose -> FusedMatMul, the int8 MatMul fusions, redundant nodes), saved with
   `SessionOptions.optimized_model_filepath`. Extended, not "all": "all" adds layout
   transformations specific to this CPU, which a repository copied to another host must not carry.
   Skipped for fp16 (the GPU host's runtime optimizes for its own execution provider).

A server then opens the stored graph at `ORT_ENABLE_BASIC` (SERVING_GRAPH_OPTIMIZATION_LEVEL):
the expensive rewrites are already in the file, and "all" measured no faster.

Graphs exported with external data (one `<name>.onnx.data` file next to the graph: the exporter
writes them over 256 MB of weights) keep their weights on disk while an fp32 graph is optimized
(exporters/external_data.py): the fusions, steps 2 included, work on the nodes and small constants
(a transformer fusion that needs a weight's values is skipped, with why), the weights are copied
file to file chunk by chunk, and ONNX Runtime's offline optimization computes from the mapped file
without prepacking a copy; the optimized graph is stored with external data too. int8 and fp16
read every weight in (their quantizers rewrite them; int8w and int4 read one MatMul's weights at a
time) and store their graph with external data over INLINE_LIMIT_BYTES (1.8 GB, near protobuf's
limit); step 2 is
skipped for a graph over it whose weights are in memory.

A graph whose optimization would not fit in the free memory is not optimized (the step raises, the
build keeps the plain export and says why): one held in memory needs its weights times
MEMORY_FACTOR; one whose weights stay on disk needs MAPPED_MEMORY_FACTOR of them for fp32,
QUANTIZE_MEMORY_FACTOR to be quantized to int8 (its quantizer reads every weight in), and
WEIGHT_ONLY_MEMORY_FACTOR for int8w and int4, whose quantizer reads one MatMul's weights at a time
(both in memory_plan.py, which the build's estimate uses too).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import onnx

from bionemo_export.choices import OptimizationLevel, Precision
from bionemo_export.errors import UserError
from bionemo_export.exporters.external_data import (
    load_structure,
    load_weights,
    save_streamed,
    tensor_bytes,
    tensors,
    unloaded,
)
from bionemo_export.memory_plan import QUANTIZE_MEMORY_FACTOR, WEIGHT_ONLY_MEMORY_FACTOR
from bionemo_export.models.readers.mapped import return_freed_memory
from bionemo_export.procfs import available_memory_bytes
from bionemo_export.serving.parameters import SERVING_GRAPH_OPTIMIZATION_LEVEL, UNOPTIMIZED_SERVING_LEVEL

from .attention import fuse_attention
from .graph import remove_unused
from .padding_mask import fold_padding_mask
from .quantization import (
    Fp16Conversion,
    Int8Quantization,
    convert_fp16,
    ffn_outputs_by_error,
    quantize_all_but,
    quantize_int8,
)
from .rotary import fuse_rotary
from .weight_only import (
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_BLOCK_SIZE,
    WEIGHT_ONLY_BITS,
    WeightOnlyQuantization,
    check_settings,
    quantize_weight_only,
)

DEFAULT_LEVEL = OptimizationLevel.EXTENDED
INLINE_LIMIT_BYTES = 1_800_000_000
"""A graph this step rewrites in memory (a quantized one) is written with external data above this
many bytes of weights: near protobuf's 2 GiB limit, where the exporter's threshold (memory_plan.py,
256 MB) is about build memory, which these steps spend anyway."""
DISABLED_RUNTIME_FUSIONS = ("SkipLayerNormFusion",)
"""ONNX Runtime optimizers left out of the offline optimization of fp32 graphs (see step 2 above).
Quantized graphs (int8, int8w, int4) keep SkipLayerNormalization: its kernel's residual sum and
norm feed the next layer's quantized activations closer to fp32 than Add + LayerNormalization do
(the real AntiBERTy, int8 u8u8, opened at the serving level: embeddings min cosine 0.99857 with
it, 0.99790 without; int8w 0.999776 and 0.999768), which the runtime's own extended level used to
give a build's check and not the served session (docs/building.md, "Margin")."""


class OptimizationError(UserError, RuntimeError):
    """An optimization step failed; the build keeps the unoptimized graph and logs this."""


@dataclass(frozen=True)
class OptimizationResult:
    """What `optimize_onnx` wrote and which rewrites it applied, for manifest.json."""

    path: Path
    precision: Precision
    level: OptimizationLevel
    """ONNX Runtime's offline level applied: none, basic or extended."""
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
    quantization: Int8Quantization | WeightOnlyQuantization | Fp16Conversion | None = None
    """int8: the method and the MatMuls kept in fp32; int8w/int4: the bits, block size, accuracy
    level, the MatMuls kept and the weight bytes; fp16: the method; fp32: None."""

    def to_dict(self) -> dict[str, Any]:
        """manifest.json's form: the file's name, lists, and the quantization as an object ({} for fp32)."""
        result = dataclasses.asdict(self)
        result["path"] = self.path.name
        result["applied"] = list(self.applied)
        result["skipped"] = list(self.skipped)
        result["quantization"] = self.quantization.to_dict() if self.quantization is not None else {}
        return result


@dataclass
class FusedGraph:
    """The exported graph after the fusions (steps 1 and 2), in memory: what every candidate of a
    ladder starts from. An int8 ladder's candidates differ only in the share kept in fp32 and the
    weights' type, so it fuses once (`fuse_graph`) and hands this to each `optimize_onnx` call, with
    the int8 error ranking of each weights' type computed once too, and the graph with every other
    MatMul quantized (`int8_rest_quantized`). Candidates leave `model` as it is
    (the ranking names its unnamed feed-forward MatMuls; fp16 and fp32 candidates work on a copy)."""

    src: Path
    fuse: bool
    num_heads: int | None
    hidden_size: int | None
    model: onnx.ModelProto
    applied: tuple[str, ...]
    skipped: tuple[str, ...]
    nodes_before: int
    external: bool
    """Written with external data (weights over INLINE_LIMIT_BYTES): such a graph is not
    worth keeping in memory between candidates."""
    _rankings: dict[tuple[str, str | None], tuple[list[str], str]] = field(default_factory=dict, repr=False)
    _rest_quantized: dict[tuple[str, tuple[str, ...]], onnx.ModelProto] = field(default_factory=dict, repr=False)

    def int8_ranking(self, calibration: dict[str, np.ndarray] | None, weights: str) -> tuple[list[str], str]:
        """quantization.ffn_outputs_by_error for this graph, computed once per weights' type and batch."""
        key = (weights, _digest(calibration) if calibration is not None else None)
        if key not in self._rankings:
            self._rankings[key] = ffn_outputs_by_error(self.model, calibration, weights)
        return self._rankings[key]

    def int8_rest_quantized(self, ranked: list[str], weights: str) -> onnx.ModelProto | None:
        """quantization.quantize_all_but(model, `ranked`), made once per weights' type and set of
        ranked MatMuls (a ladder ranks them by position for its first candidate, by error after: the
        same set; the candidates then quantize only the ranked MatMuls they do not keep); None for a
        graph with external data, which is quantized whole per candidate instead of held in memory."""
        if self.external:
            return None
        key = (weights, tuple(sorted(ranked)))
        if key not in self._rest_quantized:
            self._rest_quantized[key] = quantize_all_but(self.model, ranked, weights)
        return self._rest_quantized[key]


def fuse_graph(src: Path, *, num_heads: int | None, hidden_size: int | None, fuse: bool = True,
               external_data: bool | None = None) -> FusedGraph:
    """Load the graph at `src` and apply the fusions (steps 1 and 2; `fuse` False: neither).
    OptimizationError when the host lacks the memory or a step fails."""
    src = Path(src)
    applied: list[str] = []
    skipped: list[str] = []
    _check_memory(src)
    try:
        # Weights over 1 MiB of a graph with external data stay in their file; the quantizers read
        # them in (optimize_onnx). An inline graph is read whole.
        model = load_structure(src)
    except Exception as err:
        raise OptimizationError(f"cannot load {src}: {err}") from err
    nodes_before = len(model.graph.node)
    external = _weight_bytes(model) > INLINE_LIMIT_BYTES if external_data is None else external_data
    # The rotary fusion first: the query scale it moves after the rotation then becomes
    # MultiHeadAttention's, and the Transposes it rebuilds cancel the attention fusion's (rotary.py).
    rotated = _step("rotary fusion", lambda: fuse_rotary(model)) if fuse else 0
    if rotated:
        applied.append(f"rotary_fusion(RotaryEmbedding x{rotated})")
    if fuse and num_heads:
        fused = _step("attention fusion", lambda: fuse_attention(model, num_heads))
        if fused:
            applied.append(f"attention_fusion(MultiHeadAttention x{fused})")
        else:
            skipped.append("attention_fusion: no attention subgraph recognized")
    elif fuse:
        skipped.append("attention_fusion: number of heads unknown")
    remove_unused(model.graph)
    if fuse and num_heads and hidden_size:
        on_disk = any(unloaded(tensor) for tensor in tensors(model))
        if external and not on_disk:
            skipped.append("transformer_fusions: the graph needs external data (over 2 GiB in one protobuf)")
        elif on_disk:  # the nodes and small constants only: one small protobuf
            before = onnx.ModelProto()
            before.CopyFrom(model)
            try:
                model, stats = _transformer_fusions(model, num_heads, hidden_size)
            except Exception as err:  # a fusion that needed a weight's values: go on without them
                model, stats = before, {}
                skipped.append(f"transformer_fusions: {type(err).__name__}: {err}"[:300])
            if stats:
                applied.append("transformer_fusions(" + ", ".join(f"{op} x{n}" for op, n in stats.items()) + ")")
        else:
            model, stats = _step("transformer fusions", lambda: _transformer_fusions(model, num_heads, hidden_size))
            if stats:
                applied.append("transformer_fusions(" + ", ".join(f"{op} x{n}" for op, n in stats.items()) + ")")
    return FusedGraph(src, fuse, num_heads, hidden_size, model, tuple(applied), tuple(skipped), nodes_before, external)


def _digest(arrays: dict[str, np.ndarray]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        array = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{array.dtype}:{array.shape}".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def optimize_onnx(
    src: Path,
    dst: Path,
    *,
    num_heads: int | None,
    hidden_size: int | None,
    precision: Precision | str = Precision.FP32,
    level: OptimizationLevel | str = DEFAULT_LEVEL,
    fuse: bool = True,
    keep_fp32: float = 0.0,
    int8_weights: str = "int8",
    calibration: dict[str, np.ndarray] | None = None,
    external_data: bool | None = None,
    fused: FusedGraph | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL,
    keep_int8: float = 0.0,
    fold_padding: bool = True,
) -> OptimizationResult:
    """Optimize the graph at `src` (with its external data, if any) and write it to `dst`.

    `num_heads`/`hidden_size` (the model's attention heads and width) enable the attention and
    transformer fusions; None skips them. `precision`: a Precision (or its value: "int8").
    `keep_fp32` (int8, int8w): the fraction of the feed-forward output MatMuls (those fed by a GELU, the most sensitive
    to int8) left in fp32, those whose simulated int8 error on `calibration` (one batch of graph
    inputs) is largest; without `calibration`, the last ones. `int8_weights`: "int8" (u8s8, exact on
    VNNI CPUs) or "uint8" (u8u8, exact on every x86 CPU): quantization.py. `external_data`: None decides by the
    weights' size. `fused`: `fuse_graph(src, ...)` made once for several candidates (it must have been
    made from `src` with the same `fuse` and heads); None fuses here. `block_size`, `accuracy_level`
    (int8w, int4): MatMulNBits' (weight_only.py); `keep_int8` (int4): the fraction of the feed-forward
    output MatMuls kept at 8 bits (int8w keeps `keep_fp32` of them in fp32). `fold_padding` False:
    each attention's key-padding bias left as it is (padding_mask.py; benchmarks/cpu_levers.py
    measures what folding is worth). Raises
    OptimizationError when a step fails (dst is then not written).
    """
    # A library caller's strings as enums, or ChoiceErrors (ValueErrors) naming the setting and its
    # choices (bionemo_export/choices.py).
    level = OptimizationLevel.parse(level, "level")
    precision = Precision.parse(precision, "precision")
    for name, share in (("keep_fp32", keep_fp32), ("keep_int8", keep_int8)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} is a fraction between 0 and 1, not {share}")
    if precision in WEIGHT_ONLY_BITS:
        check_settings(precision, block_size, accuracy_level)
    import onnxruntime as ort

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        raise ValueError("optimize_onnx writes a new file: dst must differ from src")
    start = time.perf_counter()
    if fused is None:
        fused = fuse_graph(src, num_heads=num_heads, hidden_size=hidden_size, fuse=fuse, external_data=external_data)
        model = fused.model
    elif (fused.src.resolve(), fused.fuse, fused.num_heads, fused.hidden_size) != (
            src.resolve(), fuse, num_heads, hidden_size):
        raise ValueError(f"`fused` was made from {fused.src} with fuse={fused.fuse}, num_heads={fused.num_heads}, "
                         f"hidden_size={fused.hidden_size}; this candidate optimizes {src} with fuse={fuse}, "
                         f"num_heads={num_heads}, hidden_size={hidden_size}")
    else:  # shared: int8 only reads it; fp16's conversion and an external-data save change a graph in place
        model = fused.model
        if precision != Precision.INT8:
            model = onnx.ModelProto()
            model.CopyFrom(fused.model)
    applied = list(fused.applied)
    skipped = list(fused.skipped)
    # An fp32 graph whose weights stayed on disk is stored with external data whatever its size.
    external = fused.external or (precision == Precision.FP32 and any(unloaded(tensor) for tensor in tensors(model)))
    quantization: Int8Quantization | WeightOnlyQuantization | Fp16Conversion | None = None
    on_disk = any(unloaded(tensor) for tensor in tensors(model))
    if precision in WEIGHT_ONLY_BITS and on_disk:  # read one MatMul's weights at a time (weight_only.py)
        _check_memory(src, WEIGHT_ONLY_MEMORY_FACTOR, f"{precision} quantization")
    elif precision != Precision.FP32 and on_disk:
        _check_memory(src, QUANTIZE_MEMORY_FACTOR, f"{precision} quantization")
        _step("loading the weights", lambda: load_weights(model, fused.src.parent))  # the quantizers read them all
    if precision == Precision.INT8:
        def quantize() -> tuple[onnx.ModelProto, Int8Quantization]:  # in the step: its failures are the step's
            ranking = fused.int8_ranking(calibration if keep_fp32 and not external else None, int8_weights)
            # Alone too (one pass more than needed): a candidate's file is the same bytes in or out of a ladder.
            return quantize_int8(model, keep_fp32, calibration, external, int8_weights, ranking=ranking,
                                 rest_quantized=fused.int8_rest_quantized(ranking[0], int8_weights))

        model, quantization = _step("int8 quantization", quantize)
        applied.append("quantize_dynamic(int8)")
    elif precision in WEIGHT_ONLY_BITS:
        keep = keep_int8 if precision == Precision.INT4 else keep_fp32
        model, quantization = _step(f"{precision} quantization", lambda: quantize_weight_only(
            model, precision, block_size=block_size, accuracy_level=accuracy_level, keep_share=keep,
            source_dir=fused.src.parent if on_disk else None))
        applied.append(f"matmul_nbits({quantization.bits} bits, block {block_size}, accuracy_level {accuracy_level})")
    elif precision == Precision.FP16:
        model, quantization = _step("fp16 conversion", lambda: convert_fp16(model, external))
        applied.append("float16(keep_io_types)")
    if fold_padding and fused.fuse and fused.num_heads and precision != Precision.FP16:  # CPU graphs (padding_mask.py)
        folded = _step("padding mask folding", lambda: fold_padding_mask(model))
        if folded:
            applied.append(f"padding_mask_folding(MultiHeadAttention x{folded})")
    if precision == Precision.FP16 and level != OptimizationLevel.NONE:
        skipped.append(f"onnxruntime_{level}: fp16 graphs are for GPU hosts, whose runtime optimizes for its own "
                       "execution provider")
        level = OptimizationLevel.NONE

    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_file(dst)
    with tempfile.TemporaryDirectory(prefix=".bionemo-export-opt-", dir=dst.parent) as work:
        if level == OptimizationLevel.NONE:
            _save(model, dst, external, fused.src.parent)
        else:
            staged = Path(work) / "staged.onnx"
            _save(model, staged, external, fused.src.parent)
            del model
            disabled = () if precision.quantized else DISABLED_RUNTIME_FUSIONS
            _step(f"ONNX Runtime {level} optimization",
                  lambda: _runtime_optimize(staged, dst, level, external, disabled))
            applied.append(f"onnxruntime_{level}")
    size = dst.stat().st_size + (_data_path(dst).stat().st_size if _data_path(dst).exists() else 0)
    return_freed_memory(size)  # the graph in memory and ONNX Runtime's session, before the candidate is checked
    written = onnx.load(str(dst), load_external_data=False)
    return OptimizationResult(
        path=dst,
        precision=precision,
        level=level,
        applied=tuple(applied),
        fused=fused_operators(written),
        skipped=tuple(skipped),
        nodes_before=fused.nodes_before,
        nodes_after=len(written.graph.node),
        external_data=external,
        bytes=size,
        seconds=round(time.perf_counter() - start, 3),
        versions={"onnxruntime": ort.__version__, "onnx": onnx.__version__},
        serving_graph_optimization_level=(SERVING_GRAPH_OPTIMIZATION_LEVEL if level != OptimizationLevel.NONE
                                          else UNOPTIMIZED_SERVING_LEVEL),
        quantization=quantization,
    )


MEMORY_FACTOR = 2.5
"""Free memory optimizing a graph held in memory needs, in multiples of its weights: the graph,
ONNX Runtime's copy while it optimizes, and the quantizer's or converter's working copies."""
MAPPED_MEMORY_FACTOR = 0.25
"""The same for a graph whose weights stay on disk (exported with external data, over
memory_plan.EXTERNAL_DATA_THRESHOLD_BYTES; fp32): the
nodes, the constants fusion adds, ONNX Runtime's working tensors; the weights themselves are pages
of the file, which the kernel reclaims as it needs."""


def _check_memory(src: Path, factor: float | None = None, what: str = "optimizing") -> None:
    """Refuse (OptimizationError, so the build keeps the plain graph) when the graph's weights
    times `factor` exceed the memory available. By default the factor of the path the graph takes:
    MEMORY_FACTOR held in memory, MAPPED_MEMORY_FACTOR with its weights left on disk (a
    3B-parameter model's 11 GB of fp32 weights: 2.8 GB, where held in memory it would need 28 GB)."""
    weights = src.stat().st_size + (_data_path(src).stat().st_size if _data_path(src).exists() else 0)
    mapped = _data_path(src).exists()
    factor = factor or (MAPPED_MEMORY_FACTOR if mapped else MEMORY_FACTOR)
    available = available_memory_bytes()
    if available is not None and weights * factor > available:
        how = "its weights left on disk" if mapped else "held in memory"
        raise OptimizationError(
            f"skipped: {what} {weights / 2**30:.1f} GiB of weights ({how}) needs about "
            f"{weights * factor / 2**30:.1f} GiB of free memory ({factor} x); {available / 2**30:.1f} GiB is "
            "available")


_T = TypeVar("_T")


def _step(what: str, run: Callable[[], _T]) -> _T:
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
                   "MatMulIntegerToFloat", "DynamicQuantizeLinear", "MatMulNBits")


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
    # Operators fused by this module's own steps or exported as they are: not this step's.
    stats = {op: n for op, n in optimized.get_fused_operator_statistics().items()
             if n and op not in ("LayerNormalization", "MultiHeadAttention", "Attention", "RotaryEmbedding")}
    return optimized.model, stats


def _runtime_optimize(src: Path, dst: Path, level: str, external: bool,
                      disabled: tuple[str, ...] = DISABLED_RUNTIME_FUSIONS) -> None:
    """ONNX Runtime's offline optimization of `src`, written to `dst` (+ its external data),
    without the optimizers `disabled`."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = {
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    }[level]
    options.log_severity_level = 3
    if external:  # compute from the mapped weights file: no packed copy (nothing packed is saved anyway)
        options.add_session_config_entry("session.disable_prepacking", "1")
    written = src.with_name("optimized.onnx")
    options.optimized_model_filepath = str(written)
    if external:
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                         _data_path(dst).name)
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"],
                         disabled_optimizers=list(disabled))
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



def _weight_bytes(model: onnx.ModelProto) -> int:
    """The initializers' bytes, held in the proto or left in their file."""
    return sum(tensor_bytes(init) for init in model.graph.initializer)


def _data_path(path: Path) -> Path:
    return path.with_name(path.name + ".data")


def _remove_file(path: Path) -> None:
    path.unlink(missing_ok=True)
    _data_path(path).unlink(missing_ok=True)


def _save(model: onnx.ModelProto, path: Path, external: bool, source_dir: Path | None = None) -> None:
    """Write `model` to `path` (`external`: its weights in `<path>.data`). Weights it still refers
    to in their file (relative to `source_dir`) are copied there chunk by chunk."""
    _remove_file(path)
    if source_dir is not None and any(unloaded(tensor) for tensor in tensors(model)):
        save_streamed(model, path, source_dir=source_dir)
        return
    onnx.save_model(model, str(path), save_as_external_data=external, all_tensors_to_one_file=True,
                    location=_data_path(path).name, size_threshold=1024)
    if external:
        _data_path(path).chmod(path.stat().st_mode & 0o777)
