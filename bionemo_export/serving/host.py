"""How many cores this process may use, and so how many ONNX Runtime threads each model instance
gets. Resolved when the server loads the model, on the machine that serves the repository (which is
rarely the one that built it).

This file is copied verbatim into generated Triton Python-backend model folders, so it imports
only the standard library.
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
