"""Encoder instances x ONNX Runtime threads (and the memory arena), side by side in one run.

    .venv/bin/python benchmarks/encoder_instances.py [--window 5] [--out DIR]

The real AntiBERTy repository is built once (fp32, python backend, fused layout); each variant is a
copy whose N_encoder config differs only in its instance count, its `intra_op_threads` and its
`memory_arena` parameter (edited as a ModelConfig, not as text). The variants are measured
interleaved by concurrency with the real perf_analyzer over gRPC, on the same 256 antibody-like
sequences. Results: benchmarks/results/encoder_instances.md (+ the bench report under
benchmarks/results/encoder_instances/).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from bionemo_export.bench import InputSpec, Target, run_benchmarks, write_report
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.model_repository.pbtxt import read_config, write_config
from bionemo_export.models.bert import antiberty_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
# label -> (instances, intra_op_threads, memory_arena)
VARIANTS = {"2x2": (2, "auto", "false"), "1x2": (1, "2", "false"), "2x1": (2, "1", "false"),
            "2x2_arena": (2, "auto", "true")}


def variant(base: Path, out: Path, instances: int, threads: str, arena: str) -> Path:
    shutil.copytree(base, out)
    folder = out / "antiberty_encoder"
    config = read_config(folder)
    config.instance_group[0].count = instances
    config.parameters["intra_op_threads"].string_value = threads
    config.parameters["memory_arena"].string_value = arena
    write_config(folder, config)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "encoder_instances")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bionemo-instances-") as work:
        base = Path(work) / "base"
        build_repository(BuildRequest(family="bert", checkpoint=antiberty_checkpoint(), name="antiberty",
                                      out=base, backend="python"))
        targets = [Target(model="antiberty_embeddings", label=label,
                          repository=variant(base, Path(work) / label, *settings))
                   for label, settings in VARIANTS.items()]
        results = run_benchmarks(targets, [1, 8, 32], InputSpec(lengths="antibody", count=256, seed=0),
                                 args.window, out_dir=args.out)
        write_report(results, args.out, command=" ".join(["python", *sys.argv]))
    lines = ["# Encoder instances x threads", "", f"Command: `python {' '.join(sys.argv)}`; "
             "details, machine and versions: encoder_instances/report.md", "",
             "| variant (instances x threads) | c1 seq/s | c1 p50 ms | c8 seq/s | c8 batch | c32 seq/s | c32 batch |",
             "|---|---|---|---|---|---|---|"]
    for result in results:
        by = {r.concurrency: r for r in result.results}
        lines.append(f"| {result.label} | {by[1].sequences_per_s:.1f} | {by[1].p50_ms:.1f} | "
                     f"{by[8].sequences_per_s:.1f} | {by[8].server_batch_size or 0:.2f} | "
                     f"{by[32].sequences_per_s:.1f} | {by[32].server_batch_size or 0:.2f} |")
    (RESULTS / "encoder_instances.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
