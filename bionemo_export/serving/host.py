"""How many cores this process may use, and so how many ONNX Runtime threads each model instance
gets. Resolved when the server loads the model, on the machine that serves the repository (which is
rarely the one that built it).

Also which int8 kernels this CPU runs (cpu_description), which decides the int8 graph a served
model opens and what its golden check reports.

Part of the served package, copied whole into generated Triton Python-backend model folders, so it imports
only the standard library (and numpy, for its CPUID probe).
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity (taskset, cpusets), further bounded by a
    cgroup CPU quota (`docker --cpus`, Kubernetes limits), which affinity does not show."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def _cgroup_quota() -> float | None:
    """The cgroup CPU limit in cores, or None when there is none (or it cannot be read)."""
    try:  # cgroup v2: "max 100000" or "200000 100000"
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def threads_per_instance(setting: str | int | None, instances: int, cores: int | None = None) -> int:
    """ONNX Runtime intra-op threads for one model instance: a positive `setting` as given;
    "auto", 0 or None: every available core, as long as all instances together have at most two
    threads per core (so 1 or 2 instances get all the cores, 4 instances on 16 cores get 8 each).

    Why not the cores divided among the instances: with spinning off (the generated models turn it
    off), an idle instance's threads sleep, so at low load one instance runs a request on every
    core (latency), while under load two instances overlap one's Python work (tokenizing, copies)
    with the other's graph and keep the cores busy (throughput). Measured on 2 cores (AntiBERTy,
    perf_analyzer on the same host): 2 instances x 2 threads beat 1 x 2 and 2 x 1."""
    if setting not in (None, "", "auto") and int(setting) > 0:
        return int(setting)
    cores = available_cores() if cores is None else cores
    return max(1, min(cores, 2 * cores // max(1, instances)))


# ----------------------------------------------------------------------------- the CPU's int8 kernels
NO_VNNI_FOLDER = "no-vnni"
"""Where a version folder keeps the int8 graph for CPUs without VNNI (beside model.onnx)."""
CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8",
                "amx_bf16")
"""The instruction-set flags that decide which ONNX Runtime kernels run (and so what they answer)."""
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
"""8-bit dot products accumulated in 32 bits. Without them ONNX Runtime's uint8 x int8 kernels add
pairs of products into saturating 16-bit lanes (vpmaddubsw), which transformer activations overflow."""


def cpu_description() -> dict[str, object]:
    """This process's CPU: {"model": name, "features": the CPU_FEATURES it has, "vnni": whether its
    int8 dot products accumulate in 32 bits}. Where /proc/cpuinfo disagrees with what the CPUID
    instruction tells this process (an emulated CPU: `qemu-x86_64 -cpu Haswell` passes the host's
    /proc/cpuinfo through), CPUID, as numpy reads it, decides: it is what ONNX Runtime reads too."""
    model, flags = _cpuinfo()
    cpuid = _cpuid_features()
    if cpuid is not None and cpuid.get("AVX512F") != ("avx512f" in flags):
        names = {"avx2": "AVX2", "fma": "FMA3", "avx512f": "AVX512F", "avx512bw": "AVX512BW",
                 "avx512_vnni": "AVX512VNNI"}
        flags = {flag for flag, key in names.items() if cpuid.get(key)}
        model = f"{model or 'unknown CPU'} (emulated: CPUID differs from /proc/cpuinfo)"
    features = [flag for flag in CPU_FEATURES if flag in flags]
    return {"model": model or "unknown CPU", "features": features,
            "vnni": any(flag in flags for flag in VNNI_FLAGS)}


def describe_cpu(description: dict[str, object] | None = None) -> str:
    """One line for logs and errors: the model, its features, whether int8 runs on VNNI."""
    cpu = description or cpu_description()
    features = cpu["features"]
    listed = " ".join(features) if isinstance(features, list) and features else "none of " + " ".join(CPU_FEATURES)
    return f"{cpu['model']} [{listed}; int8 dot products: {'VNNI' if cpu['vnni'] else 'no VNNI (saturating)'}]"


def _cpuinfo() -> tuple[str | None, set[str]]:
    model, flags = None, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model is None:
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return model, flags


def _cpuid_features() -> dict[str, bool] | None:
    """numpy's CPUID probe (its runtime dispatch table), or None where this numpy has none."""
    try:
        from numpy.core._multiarray_umath import __cpu_features__  # pyright: ignore[reportAttributeAccessIssue]
    except ImportError:
        try:
            from numpy._core._multiarray_umath import __cpu_features__  # pyright: ignore  # numpy 2.x
        except ImportError:
            return None
    return dict(__cpu_features__)
