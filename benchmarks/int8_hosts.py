"""int8 across CPU kinds: the real AntiBERTy built in fp32 and int8, each stored graph's accuracy on
its golden answers (the build's verified batch, PyTorch fp32 outputs) on this host and on an
emulated AVX2-only CPU (`qemu-x86_64 -cpu Haswell`: ONNX Runtime's AVX2 kernels, no VNNI), and
each graph's speed on this host, interleaved round by round.

    python benchmarks/int8_hosts.py [--rounds 7] [--batch 8] [--no-emulation] [--out benchmarks/results]

Speed under emulation means nothing (qemu's code translation dominates), so the AVX2-only column is
accuracy only; speed on a real AVX2-only host needs that host (`--no-emulation` there).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

EMULATED_CHECK = """
import dataclasses, json, sys
sys.path.insert(0, sys.argv[1])
import onnxruntime as ort
from golden import read_golden
from host import cpu_description
golden = read_golden(sys.argv[2])
rows = int(sys.argv[3])  # the first rows of the golden batch (emulation runs ~1000x slower)
golden = dataclasses.replace(golden, inputs={k: v[:rows] for k, v in golden.inputs.items()},
                             references={k: v[:rows] for k, v in golden.references.items()})
out = {"cpu": cpu_description(), "rows": rows, "graphs": {}}
for graph in sys.argv[4:]:
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    checks = golden.run(session)
    out["graphs"][graph] = {c.name: [c.figures.min_cosine, c.figures.max_abs_error, c.passed] for c in checks}
print(json.dumps(out))
"""


def build(precision: str, out: Path) -> Path:
    from bionemo_export.build import BuildRequest, build_repository
    from bionemo_export.models.bert import antiberty_checkpoint

    build_repository(BuildRequest(family="bert", checkpoint=antiberty_checkpoint(), name="antiberty", out=out,
                                  backend="python", precision=precision, tasks=("embeddings", "hiddens")))
    return out / "antiberty_encoder" / "1"


def golden_figures(version: Path, graphs: dict[str, Path], emulate: str | None, rows: int) -> dict:
    command = [sys.executable, "-c", EMULATED_CHECK, str(version), str(version / "golden.npz"), str(rows),
               *map(str, graphs.values())]
    if emulate:
        command = ["qemu-x86_64", "-cpu", emulate, *command]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    by_path = {str(path): name for name, path in graphs.items()}
    figures = {by_path[path]: found for path, found in result["graphs"].items()}
    return {"cpu": result["cpu"], "rows": rows, "graphs": figures}


def speeds(graphs: dict[str, Path], golden: Path, rounds: int, batch: int) -> dict[str, float]:
    """Median ms per run of `batch` copies of the golden batch's longest sequence, graphs interleaved
    (the build's own timing, exporters/optimize/pipeline.time_graphs)."""
    from bionemo_export.exporters.optimize.pipeline import time_graphs
    from bionemo_export.serving.golden import read_golden

    inputs = read_golden(str(golden)).inputs
    longest = int(np.argmax(inputs["attention_mask"].sum(1)))
    feed = {name: np.repeat(value[longest:longest + 1], batch, axis=0) for name, value in inputs.items()}
    return time_graphs(graphs, feed, rounds=rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--no-emulation", action="store_true", help="skip the emulated AVX2-only accuracy check")
    parser.add_argument("--emulated-rows", type=int, default=2,
                        help="rows of the golden batch checked under emulation (all of them on this host)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args()

    import onnxruntime

    from bionemo_export.serving.host import cpu_description, describe_cpu

    with tempfile.TemporaryDirectory(prefix="int8-hosts-") as work:
        fp32 = build("fp32", Path(work) / "fp32")
        int8 = build("int8", Path(work) / "int8")
        graphs = {"fp32": fp32 / "model.onnx", "int8 u8s8 (model.onnx)": int8 / "model.onnx",
                  "int8 u8u8 (no-vnni/model.onnx)": int8 / "no-vnni" / "model.onnx"}
        timed = speeds(graphs, int8 / "golden.npz", args.rounds, args.batch)
        quantized = {k: v for k, v in graphs.items() if k != "fp32"}
        accuracy = {"this host": golden_figures(int8, quantized, None, 1 << 30)}
        if not args.no_emulation:
            accuracy["this host, same rows as emulated"] = golden_figures(int8, quantized, None, args.emulated_rows)
            accuracy["emulated Haswell"] = golden_figures(int8, quantized, "Haswell", args.emulated_rows)
    result = {"command": "python benchmarks/int8_hosts.py " + " ".join(sys.argv[1:]), "host": describe_cpu(),
              "cpu": cpu_description(), "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
              "batch": f"{args.batch} x the golden batch's longest AntiBERTy sequence", "ms": timed,
              "accuracy": accuracy}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "int8_hosts.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# int8 across CPU kinds (real AntiBERTy)\n", f"Command: `{result['command']}`  ",
             f"Host: {result['host']}; onnxruntime {result['onnxruntime']}, Python {result['python']}\n",
             f"## Speed on this host ({result['batch']}, median of {args.rounds}, interleaved)\n",
             "| graph | ms | vs fp32 |", "|---|---|---|"]
    lines += [f"| {name} | {ms} | {timed['fp32'] / ms:.2f}x |" for name, ms in timed.items()]
    lines += ["", "## Accuracy on the golden answers (min cosine vs PyTorch fp32; passes int8's tolerance?)\n",
              "| CPU | graph | embeddings | hiddens |", "|---|---|---|---|"]
    for where, found in accuracy.items():
        for graph, figures in found["graphs"].items():
            cells = [f"{figures[o][0]:.6f} ({'pass' if figures[o][2] else 'FAIL'})" for o in ("embeddings", "hiddens")]
            rows = "all rows" if found["rows"] > 1000 else f"first {found['rows']} rows"
            lines.append(f"| {where} ({rows}): {describe_cpu(found['cpu'])} | {graph} | {cells[0]} | {cells[1]} |")
    (args.out / "int8_hosts.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
