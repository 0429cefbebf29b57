"""`precision auto`: which encoder precisions a build tries on this host, in which order, and the
record of what it chose.

A user who wants the fastest repository a host can serve should not need to know that int8 runs
2-4x fp32 on CPUs with VNNI or AMX (docs/benchmarks.md) but may gain nothing where int8 dot
products saturate, nor that int8w is a memory lever and no speed lever (0.44-0.51x int8 on AVX-512 VNNI:
docs/building.md). `auto` tries the precisions in the order they usually pay on the build's
device, each one a whole build held to that precision's own accuracy gate, and keeps the first
that passes (build.py `_build_choosing_precision`):

- CPU (ONNX Runtime's CPU kernels): int8, kept only when its graph passes the int8 gate (with the
  margin every quantized graph needs) and the graph this host would open runs at least
  AUTO_INT8_MIN_SPEEDUP x the fp32 graph on the build's check batch, the two timed side by side
  (pipeline.verified_int8_graphs `min_speedup`); else fp32, which is exact. A checkpoint whose int8
  and fp32 builds do not fit this host's memory: int8w, written weight by weight (the closest to
  fp32 of the precisions that stream; int4 stays the user's choice: its gate is looser).
- GPU, ONNX Runtime's CUDA provider: fp16, then fp32.
- TensorRT: fp32 ONNX; its engines choose their own precision (`engines build --precision`).

The precision chosen is the one manifest.json's `precision` names, as if asked for by name; its
`precision_choice` says what was tried, why each refused one was, and on which host (tune and
serve warn when a repository runs on another kind of CPU than the one that chose: tune/record.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bionemo_export.choices import AUTO_PRECISION, Precision

AUTO_INT8_MIN_SPEEDUP = 1.2
"""The least speed, in times the fp32 graph's, an int8 graph must show on the build host for
`auto` to keep it: int8 costs accuracy (min cosine ~0.9994 against fp32 on ESM-2 150M) and is kept
only where it pays. Measured: 2.2-4x on AVX-512 VNNI (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Candidates:
    """The precisions `auto` tries, in order, and why those."""

    precisions: tuple[str, ...]
    why: str


def candidate_precisions(*, cpu_kernels: bool, tensorrt: bool,
                         fits: Callable[[str], bool] = lambda precision: True) -> Candidates:
    """The precisions `auto` tries for a backend that runs ONNX Runtime's CPU kernels
    (`cpu_kernels`), TensorRT engines (`tensorrt`) or ONNX Runtime on a GPU (neither). `fits(p)`:
    whether a build in `p` fits this host's memory (build.check_build_memory), asked for the CPU
    precisions only."""
    if tensorrt:
        return Candidates((Precision.FP32,), "TensorRT builds its engines' precision itself (`engines build`)")
    if not cpu_kernels:
        return Candidates((Precision.FP16, Precision.FP32), "a GPU: fp16 where it meets its gate, else fp32")
    fitting = tuple(p for p in (Precision.INT8, Precision.FP32) if fits(p))
    if fitting:
        return Candidates(fitting, "a CPU: int8 where it meets its gate and runs at least "
                                   f"{AUTO_INT8_MIN_SPEEDUP:g}x fp32 here, else fp32"
                          + ("" if len(fitting) == 2 else " (int8's build does not fit this host's memory)"))
    return Candidates((Precision.INT8W,), "a CPU whose memory holds neither the int8 nor the fp32 build: int8w, "
                                          "written weight by weight")


@dataclass
class PrecisionChoice:
    """manifest.json's `precision_choice`: what `auto` tried, in order, and what it kept."""

    candidates: Candidates
    host: dict[str, Any]
    """The build host's CPU (serving.host.cpu_description): what decided int8's speed."""
    refused: list[dict[str, str]] = field(default_factory=list)
    """{"precision": ..., "why": the build's message} for each precision tried and refused."""

    def refuse(self, precision: str, why: str) -> None:
        self.refused.append({"precision": str(precision), "why": why})

    def to_dict(self, chosen: str) -> dict[str, Any]:
        # The candidates are tried in order: the refused ones, then the one kept.
        return {"asked": AUTO_PRECISION, "chosen": str(chosen),
                "tried": [record["precision"] for record in self.refused] + [str(chosen)],
                "refused": self.refused, "rule": self.candidates.why, "min_int8_speedup": AUTO_INT8_MIN_SPEEDUP,
                "host": self.host}


def describe_choice(record: dict[str, Any]) -> str:
    """manifest.json's `precision_choice` in one clause for the command line: the rule, then each
    refused precision and why."""
    return record["rule"] + "".join(f"; {r['precision']} refused: {r['why']}" for r in record["refused"])
