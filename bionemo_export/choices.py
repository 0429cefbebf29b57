"""The fixed choices of builds and deployments, one enum each, shared by every layer.

Each is a `StrEnum`: a member equals its value ("fp32" == Precision.FP32), formats and serializes
as it (f-strings, json, manifest.json), so library callers may pass plain strings; the command
line declares its options with these types, so Typer lists and checks the choices. The serving
backends' names are not here: each backend is a class (model_repository/backends.py), and their
choice is generated from those classes (`backends.BackendChoice`).

Only the standard library (and errors.py) is imported: the planners, the exporters, the runtime and the command
line all import this module.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Literal, Self

from bionemo_export.errors import UserError


class ChoiceError(UserError, ValueError):
    """A value that is none of a setting's choices; the message names the setting and the choices."""


class Choice(StrEnum):
    """A StrEnum that reads a user's value with a message naming the setting and its choices."""

    @classmethod
    def parse(cls, value: str, field: str) -> Self:
        """`value` as a member; a ChoiceError naming `field` (in backticks: errors.py) when it is none."""
        try:
            return cls(value)
        except ValueError:
            raise ChoiceError(f"`{field}` {value!r}: choose one of {', '.join(cls)}") from None


class Precision(Choice):
    """The encoder graph's numeric precision (exporters/optimize)."""

    FP32 = "fp32"
    INT8 = "int8"
    """Dynamic quantization, for CPU hosts: 8-bit weights per output channel and 8-bit activations
    quantized per tensor at run time (ONNX Runtime's MatMulInteger kernels)."""
    INT8W = "int8w"
    """Weight-only 8-bit, for CPU hosts: weights quantized in blocks along the reduction axis
    (ONNX Runtime's MatMulNBits), activations quantized per block at run time
    (exporters/optimize/weight_only.py). Closer to fp32 than int8, and 4x smaller than fp32; not a
    speed precision: 0.44-0.51x int8 on an AVX-512 VNNI host (benchmarks/cpu_levers.py)."""
    INT4 = "int4"
    """Weight-only 4-bit, for CPU hosts: int8w's scheme with 4-bit weights (about 1/6 of the fp32
    weight bytes at block size 32); the most sensitive matrix products may stay 8-bit."""
    FP16 = "fp16"
    """Half precision, for GPU hosts."""

    @property
    def quantized(self) -> bool:
        """Integer weights (int8, int8w, int4): ONNX Runtime CPU kernels (no TensorRT or GPU graph),
        whose answers differ a little between CPUs and sessions, so a build accepts such a graph only
        with a margin over its tolerance (exporters/optimize/pipeline.py)."""
        return self in (Precision.INT8, Precision.INT8W, Precision.INT4)


AutoPrecision = Literal["auto"]
AUTO_PRECISION: AutoPrecision = "auto"
"""A build's precision when it is the build's to choose: the fastest that meets its accuracy gate
on the build host (build_precision.py); manifest.json then names the precision chosen."""

if TYPE_CHECKING:  # the members are made at run time, from Precision's: checkers see the type only
    class BuildPrecision(Choice):
        """The command line's --precision: a Precision, or auto."""
else:
    BuildPrecision = Choice("BuildPrecision", [(p.name, p.value) for p in Precision]
                            + [(AUTO_PRECISION.upper(), AUTO_PRECISION)])
    """The command line's --precision: a Precision, or auto (AUTO_PRECISION)."""


def build_precision(value: str, field: str = "precision") -> Precision | AutoPrecision:
    """A build's precision from a user's value (the command line's, a manifest's, a library
    caller's string): a Precision, or auto; a ChoiceError naming `field` and the choices otherwise."""
    return AUTO_PRECISION if BuildPrecision.parse(value, field) == AUTO_PRECISION else Precision(value)


WEIGHT_BLOCK_SIZES = (16, 32, 64, 128, 256)
"""int8w, int4: the weights per quantization block ONNX Runtime's MatMulNBits computes (powers of
two from 16; exporters/optimize/weight_only.py)."""
DEFAULT_WEIGHT_BLOCK_SIZE = 32
"""int8w, int4: the block size a build uses unless told (measured: docs/building.md)."""


class EnginePrecision(Choice):
    """The precision TensorRT builds an engine in (runtime/engines.py)."""

    FP16 = "fp16"
    FP32 = "fp32"


class Device(Choice):
    """Where the models that run graphs are placed (Triton's instance kind)."""

    CPU = "cpu"
    GPU = "gpu"


class Layout(Choice):
    """How the encoder is served: fused (the encoder model tokenizes, Python backend only),
    ensemble (a tokenizer model feeds the encoder model), auto (fused where the backend runs Python)."""

    AUTO = "auto"
    FUSED = "fused"
    ENSEMBLE = "ensemble"


class Exporter(Choice):
    """What writes the ONNX graphs: torch.onnx or Triton Model Navigator."""

    TORCH = "torch"
    NAVIGATOR = "navigator"


class OptimizationLevel(Choice):
    """ONNX Runtime's offline graph optimization applied to a stored graph (exporters/optimize)."""

    NONE = "none"
    BASIC = "basic"
    EXTENDED = "extended"


class DeployTarget(Choice):
    """Which Kubernetes manifests `deploy k8s` writes (deploy/kubernetes.py)."""

    ALL = "all"
    KSERVE = "kserve"
    PLAIN = "plain"


class Protocol(Choice):
    """The protocol a client speaks to Triton."""

    GRPC = "grpc"
    HTTP = "http"


class GoldenCheck(Choice):
    """What a served model does when its golden answers are outside tolerance on its host
    (serving/golden.py): refuse to load, or load with a warning in the server's log."""

    REFUSE = "refuse"
    WARN = "warn"


class TuneObjective(Choice):
    """What `tune` maximizes (tune/search.py): sequences/s, or the inverse of p99 latency."""

    THROUGHPUT = "throughput"
    LATENCY = "latency"


class MemoryArena(Choice):
    """How a served graph's ONNX Runtime session allocates its intermediate tensors (config
    parameter `memory_arena` of the models that run a graph; serving/onnx_session.py)."""

    RUN = "run"
    """ONNX Runtime's CPU arena during a run, shrunk to its first chunk at the run's end: a layer
    reuses the previous layer's pages instead of mapping fresh ones (glibc maps every allocation
    over 32 MB anew, and the kernel zeroes each page on first touch), and the memory still goes
    back to the system after every run. Measured on an ESM-2 150M graph at 8 x 256 tokens (2 AVX-512
    cores): 1.22x fp32 and 1.4x int8 the speed of `false`, within 5 % of `true`
    (benchmarks/results/esm_cpp.md)."""
    OFF = "false"
    """No arena: every tensor from malloc, freed as soon as it is used (what repositories built
    before `run` existed say)."""
    KEPT = "true"
    """The arena kept at the peak of the largest run for good: the fastest, but a server keeps the
    memory of its largest request."""
