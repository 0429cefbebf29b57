"""What a tuned repository remembers about its tuning, in manifest.json's `tuning` key.

Settings that won on one host are a guess on another: the record names the host the figures were
measured on (its cores as the server would count them: affinity and cgroup quota), so that `serve`
can warn when it starts the repository on a host with a different count. So is a precision that
`build --precision auto` chose (manifest.json's `precision_choice`): int8 pays on CPUs with VNNI
or AMX, and `precision_mismatch` says when the repository runs on a CPU of other features. Kept
free of torch, onnx and perf_analyzer: `serve` reads it.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone
from typing import Any

from bionemo_export import procfs
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.serving.host import available_cores, cpu_description, describe_cpu

TUNING_KEY = "tuning"


def this_host() -> dict[str, Any]:
    """The facts about this host that decide the best settings."""
    import os

    return {"cores": available_cores(), "cpu_count": os.cpu_count(), "cpu_model": procfs.cpu_model(),
            "platform": platform.platform()}


def stamp() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def host_mismatch(manifest: Manifest, cores: int | None = None) -> str | None:
    """A warning when `manifest` records tuning on a host with another core count than this one
    (`cores`: this host's, by default as the server counts them), else None."""
    tuning = manifest.tuning or {}
    tuned_cores = (tuning.get("host") or {}).get("cores")
    here = available_cores() if cores is None else cores
    if not isinstance(tuned_cores, int) or tuned_cores == here:
        return None
    when = tuning.get("tuned", "at an unknown time")
    return (f"this repository was tuned on a host with {tuned_cores} cores ({when}); "
            f"this one has {here}: its instances and threads may not suit it. Run `bionemo-export tune` here, or "
            "`bionemo-export tune --restore` for the settings it had before")


def precision_mismatch(manifest: Manifest, cpu: dict[str, Any] | None = None) -> str | None:
    """A warning when `build --precision auto` chose the repository's precision on a CPU whose
    instruction-set features (those that decide ONNX Runtime's kernels: serving.host.CPU_FEATURES)
    or int8 dot products differ from this one's (`cpu`: serving.host.cpu_description's), else None."""
    choice = manifest.precision_choice or {}
    chosen_on = choice.get("host")
    if not isinstance(chosen_on, dict):
        return None
    here = cpu_description() if cpu is None else cpu

    def kind(description: dict[str, Any]) -> tuple[set[str], bool]:
        features = description.get("features")
        return set(features) if isinstance(features, list) else set(), bool(description.get("vnni"))

    if kind(chosen_on) == kind(here):
        return None
    return (f"`build --precision auto` chose {manifest.precision} for this repository on {describe_cpu(chosen_on)}; "
            f"this host is {describe_cpu(here)}, where another precision may serve faster. Build it again here "
            "with --precision auto to choose for this host")
