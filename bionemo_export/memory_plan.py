"""What building and serving a model needs in memory, from its fp32 weight bytes alone.

One set of figures for three readers: `build` checks its estimate before it loads anything,
`inspect CHECKPOINT` reports both for the checkpoint at hand, and `doctor` tabulates them for the
released models against the memory of the host it runs on. Standard library only: `doctor` runs
on hosts that only serve (no torch).

The factors are measurements (benchmarks/results/model_sizes.json for builds,
benchmarks/results/weight_only.json and shared_weights.json for served weights), not bounds: a
prediction says "about".
"""

from __future__ import annotations

from dataclasses import dataclass

EXTERNAL_DATA_THRESHOLD_BYTES = 256 << 20
"""Weights above this are saved as external data (one `<name>.onnx.data` beside the graph) and the
build keeps them on disk. A protobuf file cannot exceed 2 GiB, but the reason to start far below
that is memory: such a graph is written tensor by tensor, checked and optimized with its weights
left on disk (ONNX Runtime maps the file; exporters/external_data.py), where an inline graph is
serialized, parsed and copied whole at each step (ESM-2 150M, 0.59 GB of weights: 5.9 GB peak held
in memory). Small models (AntiBERTy, ESM-2 35M) stay one file."""

IN_MEMORY = "held in memory"
WEIGHTS_ON_DISK = "weights left on disk"
STREAMED = "weights streamed"
"""int8w and int4 of a checkpoint whose weights-on-disk build exceeds the host's memory: the graph
is written weight by weight, quantized as it goes (exporters/streamed.py)."""
WEIGHT_ONLY_PRECISIONS = ("int8w", "int4")
"""The precisions a streamed build writes."""
BUILD_MEMORY_FACTORS: dict[str, float] = {IN_MEMORY: 9.5, WEIGHTS_ON_DISK: 1.3}
"""A build's peak resident memory beyond BUILD_BASELINE_BYTES, in multiples of the model's fp32
weights, per path (`build_memory`). Held in memory (graphs up to EXTERNAL_DATA_THRESHOLD_BYTES):
the graph is serialized, parsed, fused and checked whole at each step (measured when 150M took this
path: 5.9 GB for 0.59 GB of weights, 9.3x beyond the libraries; under 256 MB that is at most
3.2 GB). Weights left on disk (larger graphs): the checkpoint is memory-mapped, the export and the
optimizer write and copy the weights file chunk by chunk, ONNX Runtime computes from the mapped
file, and PyTorch's answers are computed before each session opens, its pages handed back to the
kernel meanwhile (models/readers/mapped.py), so the model's weights and a session's are resident
one at a time (benchmarks/results/model_sizes.json)."""
QUANTIZE_MEMORY_FACTOR = 1.5
"""A quantized build (int8, int8w, int4) of a graph with its weights on disk. int8's quantizer
reads every fp32 weight in and writes the quantized copy; int8w and int4 read one weight at a time
(WEIGHT_ONLY_MEMORY_FACTOR), but ESM-2 150M int8w peaked all the same (1.8 GB anonymous, 3.1x its
fp32 weights, before and after that change) in the quantized graph's optimization and checks
(benchmarks/results/model_sizes_int8w.json), so every quantized build keeps this estimate until a
larger build is measured."""
WEIGHT_ONLY_MEMORY_FACTOR = 0.5
"""The free memory int8w and int4 quantization itself needs for a graph with its weights on disk,
in multiples of its fp32 weights: one MatMul's weights at a time and the quantized copies (0.30x
at 8 bits, 0.19x at 4; exporters/optimize/weight_only.py)."""
STREAMED_MEMORY_FACTOR = 1.5
"""A streamed build's peak beyond BUILD_BASELINE_BYTES, in multiples of its quantized weights
(STORED_WEIGHT_SHARE): the int4 graph's check sessions, which hold its weights and the packed
copies MatMulNBits computes from. Measured on ESM C 6B int4 (random weights, bf16): 5.7 GiB of
anonymous memory at that check for 4.5 GiB of int4 weights (1.22x beyond the libraries;
benchmarks/results/model_sizes_esmc_6b_int4.json); the fp32 weights are pages of the mapped
checkpoint, read one weight (one layer, in the PyTorch reference) at a time and dropped by the
kernel when memory is short; a half-precision checkpoint's are widened in memory one weight (one
layer) at a time (models/readers/mapped.widening_deferred)."""
BUILD_BASELINE_BYTES = 800 << 20
"""What a build holds whatever the model: Python with torch, transformers, onnx and ONNX Runtime loaded."""

STORED_WEIGHT_SHARE: dict[str, float] = {"fp32": 1.0, "fp16": 0.5, "int8": 0.51, "int8w": 0.30, "int4": 0.19}
"""A built graph's weight bytes per fp32 weight byte, by precision: measured on the real AntiBERTy
(benchmarks/results/weight_only.json: int8 0.508, int8w 0.299, int4 0.193; its embeddings and
kept-precision products weigh more there than in a larger model, so larger models come in under
these)."""
SERVE_BASELINE_BYTES = 1 << 30
"""What a served repository holds beyond its weights: tritonserver, each stub's Python with ONNX
Runtime (about 70 MB), each session's arena, and the activations of one token-budget batch."""


@dataclass(frozen=True)
class BuildMemory:
    """What a build of one checkpoint is expected to hold at its peak, and why."""

    path: str
    """IN_MEMORY or WEIGHTS_ON_DISK: how the build handles the weights (`build_memory`)."""
    weights: int
    """The checkpoint's weights in fp32 bytes."""
    factor: float
    needed: int
    """BUILD_BASELINE_BYTES + factor x weights."""
    why: str

    def text(self) -> str:
        return (f"about {self.needed / 2**30:.1f} GiB ({self.factor} x its {self.weights / 2**30:.1f} GiB of fp32 "
                f"weights + {BUILD_BASELINE_BYTES / 2**30:.1f} GiB, {self.path}: {self.why})")


def build_memory(weights: int, precision: str = "fp32", available: int | None = None,
                 streamed: bool | None = None) -> BuildMemory:
    """The memory a build of a model with `weights` fp32 bytes needs in `precision`, by the path it
    will take: graphs whose weights exceed EXTERNAL_DATA_THRESHOLD_BYTES keep their weights on disk
    (BUILD_MEMORY_FACTORS says what each path holds), and quantizing those reads them in. int8w and
    int4 builds are streamed (STREAMED) when `streamed`, or, where `streamed` is None, when the
    weights-on-disk build needs more than `available` bytes (None: unknown, never)."""
    if streamed and precision not in WEIGHT_ONLY_PRECISIONS:
        raise ValueError(f"a streamed build writes {' or '.join(WEIGHT_ONLY_PRECISIONS)} graphs, not {precision}")
    if streamed:
        return _streamed(weights, precision)
    if weights <= EXTERNAL_DATA_THRESHOLD_BYTES:
        path, why = IN_MEMORY, (f"up to {EXTERNAL_DATA_THRESHOLD_BYTES >> 20} MB of weights the graph is exported, "
                                "fused and checked whole, beside the PyTorch model")
        factor = BUILD_MEMORY_FACTORS[IN_MEMORY]
    elif precision != "fp32":
        path, why = WEIGHTS_ON_DISK, (f"the checkpoint is mapped, but {precision} quantization reads every fp32 "
                                      "weight in and writes the quantized copy")
        factor = QUANTIZE_MEMORY_FACTOR
    else:
        path, why = WEIGHTS_ON_DISK, ("the checkpoint is mapped and the graph written with external data, the "
                                      "PyTorch model and an ONNX Runtime session resident one at a time")
        factor = BUILD_MEMORY_FACTORS[WEIGHTS_ON_DISK]
    estimate = BuildMemory(path, weights, factor, int(BUILD_BASELINE_BYTES + factor * weights), why)
    if (streamed is None and precision in WEIGHT_ONLY_PRECISIONS and available is not None
            and estimate.needed > available):
        return _streamed(weights, precision, f"the build with its {path} needs {estimate.needed / 2**30:.1f} GiB; ")
    return estimate


def _streamed(weights: int, precision: str, reason: str = "") -> BuildMemory:
    factor = round(STREAMED_MEMORY_FACTOR * STORED_WEIGHT_SHARE[precision], 2)
    why = (f"{reason}the graph is written weight by weight from the mapped checkpoint, quantized as it goes, "
           f"and only the {precision} graph is opened in ONNX Runtime")
    return BuildMemory(STREAMED, weights, factor, int(BUILD_BASELINE_BYTES + factor * weights), why)


BUILD_DISK_COPIES: dict[str, float] = {"fp32": 4.0, "quantized": 2.0}
"""The most a build writes beside its output at once, in copies of the model's fp32 weights. fp32:
the repository's shared weights file, the graph at hand's export, the fused graph and the
optimized candidate written from it (each graph's own data is deleted once it is rewritten over
the shared file: build.py `_share_graph`; measured at most 1.98 copies between steps,
tests/export/test_bounded_build.py). Quantized (int8, int8w, int4 on the weights-on-disk path): the
export and the fused graph, beside the quantized candidates (STORED_WEIGHT_SHARE). A streamed build
writes its quantized graph alone. A half-precision checkpoint adds its fp32 copy (a temporary file
of the build: models/readers/mapped.widened), except streamed: its layers are widened in memory,
one at a time (mapped.widening_deferred)."""


@dataclass(frozen=True)
class BuildDisk:
    """What a build writes beside its output at its peak (its temporary files and the repository)."""

    needed: int
    weights: int
    widened: int
    """The fp32 copy of a half-precision checkpoint's weights, written to a temporary file."""
    copies: float

    def text(self) -> str:
        widened = f" + {self.widened / 2**30:.1f} GiB for the fp32 copy of its half-precision weights" \
            if self.widened else ""
        return (f"about {self.needed / 2**30:.1f} GiB ({self.copies:g} x its {self.weights / 2**30:.1f} GiB of fp32 "
                f"weights{widened})")


def build_disk(memory: BuildMemory, precision: str = "fp32", widened: int = 0) -> BuildDisk:
    """The disk a build by the path `memory` estimated writes at its peak (BUILD_DISK_COPIES), with
    `widened` bytes of fp32 copies of half-precision weights."""
    if memory.path == STREAMED:
        copies = STORED_WEIGHT_SHARE[precision]
    elif precision == "fp32":
        copies = BUILD_DISK_COPIES["fp32"]
    else:
        copies = BUILD_DISK_COPIES["quantized"] + STORED_WEIGHT_SHARE[precision]
    return BuildDisk(int(copies * memory.weights + widened), memory.weights, widened, round(copies, 2))


@dataclass(frozen=True)
class ServeMemory:
    """What serving one built repository is expected to hold."""

    precision: str
    instances: int
    weights: int
    """The built graph's weight bytes (fp32 weights x STORED_WEIGHT_SHARE)."""
    needed: int
    """SERVE_BASELINE_BYTES + instances x weights."""

    def text(self) -> str:
        copies = "its" if self.instances == 1 else f"{self.instances} instances x its"
        return (f"about {self.needed / 2**30:.1f} GiB ({copies} {self.weights / 2**30:.2f} GiB of {self.precision} "
                f"weights + {SERVE_BASELINE_BYTES / 2**30:.1f} GiB)")


def serve_memory(weights: int, precision: str = "fp32", instances: int = 1) -> ServeMemory:
    """The memory serving a model with `weights` fp32 bytes built in `precision` needs with
    `instances` encoder instances. Each instance holds the encoder's weights once (ONNX Runtime
    prepacks them: resident, not shared); the other graphs of a repository map one weights file
    that every instance shares, pages the kernel may drop (benchmarks/results/shared_weights.md)."""
    stored = int(weights * STORED_WEIGHT_SHARE[precision])
    return ServeMemory(precision, instances, stored, SERVE_BASELINE_BYTES + instances * stored)


@dataclass(frozen=True)
class ReleasedModel:
    """A released model's name and size, for `doctor`'s table of what a host builds and serves."""

    name: str
    family: str
    shape: str
    """Its key in testing/large_checkpoints.SHAPES (which writes random checkpoints of it)."""
    parameters: int
    """Every tensor of its masked-LM checkpoint, heads included (checked against transformers'
    module in tests/unit/test_memory_plan.py)."""

    @property
    def fp32_bytes(self) -> int:
        return 4 * self.parameters


RELEASED_MODELS: tuple[ReleasedModel, ...] = (
    ReleasedModel("ESM-2 8M", "esm2", "esm2_t6_8M", 7_512_474),
    ReleasedModel("ESM-2 35M", "esm2", "esm2_t12_35M", 33_501_394),
    ReleasedModel("ESM-2 150M", "esm2", "esm2_t30_150M", 148_140_154),
    ReleasedModel("ESM-2 650M", "esm2", "esm2_t33_650M", 651_043_254),
    ReleasedModel("ESM-2 3B", "esm2", "esm2_t36_3B", 2_839_005_634),
    ReleasedModel("ESM-2 15B", "esm2", "esm2_t48_15B", 15_129_100_194),
    ReleasedModel("ESM C 300M", "esmc", "esmc_300m", 332_997_184),
    ReleasedModel("ESM C 600M", "esmc", "esmc_600m", 575_036_992),
    ReleasedModel("ESM C 6B", "esmc", "esmc_6b", 6_352_005_184),
)
"""The sizes people serve, smallest first per family."""


@dataclass(frozen=True)
class HostCapacity:
    """What one released model needs on a host: its builds (fp32, int4) and its serving (fp32,
    int4; one encoder instance), each against the memory available there."""

    model: ReleasedModel
    builds: dict[str, BuildMemory]
    serves: dict[str, ServeMemory]
    available: int | None
    """MemAvailable when the table was made; None where unknown (everything is said to fit)."""

    def fits(self, needed: int) -> bool:
        return self.available is None or needed <= self.available


def host_capacity(available: int | None, precisions: tuple[str, ...] = ("fp32", "int4")) -> list[HostCapacity]:
    """`doctor`'s table: every released model's build and serving estimates in `precisions` against
    `available` bytes."""
    return [HostCapacity(model, {p: build_memory(model.fp32_bytes, p, available) for p in precisions},
                         {p: serve_memory(model.fp32_bytes, p) for p in precisions}, available)
            for model in RELEASED_MODELS]
