"""Benchmark served models with the real perf_analyzer: input data, runs, server statistics, report.

    from bionemo_export.bench import InputSpec, run_benchmark, write_report
    result = run_benchmark("model_repository", "esm2nv_embeddings", [1, 8, 32],
                           InputSpec(lengths="uniform:50-1000"), duration=5, out_dir="bench_out")
    write_report([result], "bench_out", command="my script")
"""

from .inputs import (
    LENGTH_DISTRIBUTIONS,
    InputData,
    InputError,
    InputSpec,
    LengthDistribution,
    generate_inputs,
    random_proteins,
    read_sequences,
)
from .report import comparison, comparison_table, plot, results_table, write_report
from .run import (
    BenchError,
    BenchResult,
    ConcurrencyResult,
    ModelStats,
    ProgressHook,
    Target,
    environment,
    run_benchmark,
    run_benchmarks,
)

__all__ = [
    "LENGTH_DISTRIBUTIONS",
    "BenchError",
    "BenchResult",
    "ConcurrencyResult",
    "InputData",
    "InputError",
    "InputSpec",
    "LengthDistribution",
    "ModelStats",
    "ProgressHook",
    "Target",
    "comparison",
    "comparison_table",
    "environment",
    "generate_inputs",
    "plot",
    "random_proteins",
    "read_sequences",
    "results_table",
    "run_benchmark",
    "run_benchmarks",
    "write_report",
]
