"""Issue 47's graph levers, each measured side by side in one run: ESM-2's encoder graph in process
on this CPU, every variant written from the same plain export by the build's own optimizer, timed
interleaved on the same padded batches, its accuracy against the plain fp32 export beside its speed.

    .venv/bin/python benchmarks/cpu_levers.py                       # ESM-2 150M shape, results/cpu_levers.*
    .venv/bin/python benchmarks/cpu_levers.py --shape esm2_t6_8M --rounds 3 --out /tmp/levers   # smoke

Variants (exporters/optimize/candidates.optimize_onnx, as a build calls it):

- `fp32`: the fused graph a build stores (attention, rotary and transformer fusions; the key-padding
  mask folded into the attention heads: padding_mask.py), and `fp32 unfolded`: the same with the
  attention's padding bias left as it is (`fold_padding=False`);
- `int8`: dynamic quantization with the weights this CPU computes exactly (u8s8 with VNNI or AMX,
  u8u8 without: quantization.py), no feed-forward product kept fp32, folded; `int8 unfolded`;
- `int8w acc4`, `int4 acc4`: weight-only MatMulNBits, block 32, accuracy level 4 (8-bit activations,
  int8 dot products: weight_only.py), folded;
- `int8, 1 thread`: the int8 graph with one intra-op thread instead of the host's cores (what an
  instance per core would give each instance).

Sessions are opened as a served model opens them (the stored graph's serving optimization level,
idle threads asleep, no memory arena, weights prepacked). Batches: random proteins whose lengths
fill 75-100 % of each shape's tokens (so there is padding to mask), tokenized by ESM-2's tokenizer:
`--shapes` rows x tokens (default 8x128 antibody-like, 8x256 uniform-like, 4x512 UniProt-like).
Each round runs every variant once on every batch, the variants interleaved; figures are the
median of `--rounds`. Accuracy: the embeddings output's min cosine over the batch's proteins
against the plain fp32 export's on the same batch (the build checks against PyTorch; this compares
variants with each other). Results: `--out`.json and .md, with the command, host and versions.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from bionemo_export.bench.inputs import random_proteins
from bionemo_export.exporters import export_onnx
from bionemo_export.exporters.optimize import optimize_onnx
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.serving.host import available_cores, cpu_description, describe_cpu
from bionemo_export.testing.large_checkpoints import ESM2_SHAPES, write_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SHAPES = ("8x128", "8x256", "4x512")
SINGLE_THREAD = "int8, 1 thread"


def variants(vnni: bool) -> dict[str, dict[str, Any]]:
    """Name -> optimize_onnx's settings."""
    int8 = {"precision": "int8", "int8_weights": "int8" if vnni else "uint8"}
    return {
        "fp32": {"precision": "fp32"},
        "fp32 unfolded": {"precision": "fp32", "fold_padding": False},
        "int8": int8,
        "int8 unfolded": {**int8, "fold_padding": False},
        "int8w acc4": {"precision": "int8w", "accuracy_level": 4},
        "int4 acc4": {"precision": "int4", "accuracy_level": 4},
    }


def open_session(path: Path, level: str, threads: int) -> ort.InferenceSession:
    """The session a served model opens (serving/onnx_session.create_session's options)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.enable_cpu_mem_arena = False
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def batch(tokenizer, rows: int, tokens: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """`rows` random proteins whose tokens (with BOS and EOS) fill 75-100 % of `tokens`, padded to it."""
    lengths = rng.integers(int(0.75 * tokens) - 2, tokens - 1, size=rows)
    lengths[0] = tokens - 2  # the longest fills the shape
    encoded = tokenizer.encode(random_proteins(lengths, rng))
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def min_cosine(answer: np.ndarray, reference: np.ndarray) -> float:
    a, b = answer.reshape(len(answer), -1), reference.reshape(len(reference), -1)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def measure(args) -> dict:
    work = args.work
    checkpoint = work / args.shape
    if not (checkpoint / "model.safetensors").exists():
        write_random_checkpoint("esm2", checkpoint, args.shape)
    loaded = get_family("esm2").load(checkpoint)
    rng = np.random.default_rng(args.seed)
    shapes = [tuple(int(n) for n in text.split("x")) for text in args.shapes]
    batches = {f"{rows}x{tokens}": batch(loaded.tokenizer, rows, tokens, rng) for rows, tokens in shapes}
    plain_path = work / f"{args.shape}-plain" / "model.onnx"
    if not plain_path.exists():
        print(f"[cpu_levers] exporting {args.shape}", flush=True)
        first = next(iter(batches.values()))
        export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, first, plain_path)
    cpu = cpu_description()
    built: dict[str, Any] = {}
    for name, settings in variants(bool(cpu["vnni"])).items():
        path = work / f"{args.shape}-{name.replace(' ', '-')}" / "model.onnx"
        print(f"[cpu_levers] writing {name}", flush=True)
        built[name] = optimize_onnx(plain_path, path, num_heads=loaded.description.get("heads"),
                                    hidden_size=loaded.hidden_size, **settings)
    del loaded
    cores = available_cores()
    sessions = {name: open_session(result.path, result.serving_graph_optimization_level, cores)
                for name, result in built.items()}
    sessions[SINGLE_THREAD] = open_session(built["int8"].path, built["int8"].serving_graph_optimization_level, 1)
    plain = open_session(plain_path, "ORT_ENABLE_ALL", cores)
    output = plain.get_outputs()[0].name

    def feed(session, inputs):
        return {value.name: inputs[value.name] for value in session.get_inputs()}

    reference = {shape: plain.run([output], feed(plain, inputs))[0] for shape, inputs in batches.items()}
    del plain
    accuracy = {name: {shape: min_cosine(session.run([output], feed(session, inputs))[0], reference[shape])
                       for shape, inputs in batches.items()} for name, session in sessions.items()}
    seconds: dict[str, dict[str, list[float]]] = {name: {shape: [] for shape in batches} for name in sessions}
    for round_ in range(args.rounds):
        for shape, inputs in batches.items():
            for name, session in sessions.items():
                feeds = feed(session, inputs)
                began = time.perf_counter()
                session.run([output], feeds)
                seconds[name][shape].append(time.perf_counter() - began)
        print(f"[cpu_levers] round {round_ + 1}/{args.rounds} done", flush=True)
    rows = {shape: len(next(iter(inputs.values()))) for shape, inputs in batches.items()}
    return {
        "command": " ".join(["python", *sys.argv]), "shape": args.shape, "sizes": ESM2_SHAPES[args.shape],
        "host": {"platform": platform.platform(), "cpu": describe_cpu(cpu), "cores": cores,
                 "versions": {k: v for k, v in sorted(package_versions().items()) if v}},
        "rounds": args.rounds,
        "variants": {name: {"applied": list(result.applied),
                            "quantization": result.quantization.to_dict() if result.quantization else None}
                     for name, result in built.items()},
        "median_ms": {name: {shape: 1000 * statistics.median(times) for shape, times in per.items()}
                      for name, per in seconds.items()},
        "seq_per_s": {name: {shape: rows[shape] / statistics.median(times) for shape, times in per.items()}
                      for name, per in seconds.items()},
        "min_cosine_vs_plain_fp32": accuracy,
    }


def summary(results: dict) -> str:
    shapes = list(next(iter(results["seq_per_s"].values())))
    speed, cosine = results["seq_per_s"], results["min_cosine_vs_plain_fp32"]
    lines = [f"# CPU levers, {results['shape']} ({results['sizes']['num_layers']} layers, width "
             f"{results['sizes']['hidden_size']}), in process", "",
             f"Command: `{results['command']}`  ",
             f"Host: {results['host']['cpu']}, {results['host']['cores']} cores; {results['host']['platform']}  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in results["host"]["versions"].items()), "",
             f"Sequences/s, median of {results['rounds']} interleaved rounds; in brackets the ratio to the row the "
             "lever changes (`unfolded`: its folded graph over it; the precisions and `1 thread`: over int8 "
             "folded, the build's CPU throughput graph); min cosine of the embeddings against the plain fp32 "
             "export on the same batch.", "",
             "| variant | " + " | ".join(f"{s} seq/s" for s in shapes) + " | " + " | ".join(
                 f"{s} min cos" for s in shapes) + " |", "|---|" + "---|" * (2 * len(shapes))]
    for name in speed:
        base = name.replace(" unfolded", "") if name.endswith("unfolded") else None if name == "int8" else "int8"
        cells = []
        for shape in shapes:
            cell = f"{speed[name][shape]:.2f}"
            if base is not None:
                ratio = speed[base][shape] / speed[name][shape] if name.endswith("unfolded") else \
                    speed[name][shape] / speed[base][shape]
                cell += f" ({ratio:.2f}x{' folding' if name.endswith('unfolded') else ''})"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " | "
                     + " | ".join(f"{cosine[name][shape]:.5f}" for shape in shapes) + " |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shape", default="esm2_t30_150M", choices=sorted(ESM2_SHAPES))
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="rows x tokens batches")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=None,
                        help="checkpoint, plain export and variants (the checkpoint and export are reused)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_levers")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cpu-levers-") as temporary:
        args.work = args.work or Path(temporary)
        results = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    text = summary(results)
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
