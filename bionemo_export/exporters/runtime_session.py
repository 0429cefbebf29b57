"""The ONNX Runtime settings a build runs graphs with: its checks against PyTorch, the int8
calibration probe, the side-by-side timing of int8 graphs, and `verify`'s golden checks.

ONNX Runtime's default thread count (one per core), but idle threads sleep, as in a served model
(serving/onnx_session.py, `allow_spinning` "false"): by default its intra-op threads spin for a while
after each run, and a build shares its cores with whatever else runs there (other builds, a
server, a test suite's workers). Three processes checking the real AntiBERTy side by side on two
cores used 20% less CPU, and finished 18% sooner, with idle threads asleep (measured 2026-11-27).
Threads and spinning change when a run finishes, never what it computes.
"""

from __future__ import annotations

import onnxruntime as ort


def session_options(*, mapped_weights: bool = False) -> ort.SessionOptions:
    """Fresh SessionOptions for a build-time session: warnings off (they are about graph rewrites),
    one inter-op thread, idle intra-op threads asleep. `mapped_weights`, for a graph whose weights
    are external data: no prepacking, so that ONNX Runtime computes from the pages of the weights
    file it maps instead of a packed copy of every MatMul's weights in its own memory (a graph of
    168 MB of weights: 160 MB less resident). Its answers differ from a prepacked session's by
    float rounding only (another summation order: 2e-8 on outputs of 0.016 there), far inside an
    fp32 check's tolerance; a quantized graph is checked in its served sessions' own options."""
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if mapped_weights:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return options


def served_session_options(level: str, threads: int) -> ort.SessionOptions:
    """The options a served Python-backend model opens its graph with (serving/onnx_session.py's
    create_session, which copies nothing from here: it is copied into repositories): `level` (an
    ORT_* GraphOptimizationLevel name: the config's graph_optimization_level), `threads` intra-op
    threads, one inter-op thread, idle threads asleep, no memory arena. A quantized graph is checked
    under these at build time (exporters/optimize/pipeline.py), since its answers move with them."""
    options = session_options()
    options.intra_op_num_threads = threads
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    return options
