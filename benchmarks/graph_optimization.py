"""ONNX Runtime (CPU) speed of one encoder graph, exported and optimized in different ways, side by side.

For each model (the real AntiBERTy; a random ESM-2 of the 35M size: hidden 480, 12 layers, 20
heads), the same encoder (tokens, masks -> hiddens, pooled embeddings) is exported with
- `dynamo`: torch.onnx's dynamo exporter, opset 18 (the project's exporter);
- `torchscript`: the legacy TorchScript exporter (`dynamo=False`), opset 18;
and each is run as exported and after:
- `+ort_transformers`: onnxruntime.transformers.optimizer.optimize_model (model_type "bert",
  num_heads/hidden_size given, its default fusions);
- `+ort_offline_ext` / `+ort_offline_all`: ONNX Runtime's own graph optimization saved to disk
  (`SessionOptions.optimized_model_filepath`) at ORT_ENABLE_EXTENDED / ORT_ENABLE_ALL;
- `+pipeline`: bionemo_export.exporters.optimize.optimize_onnx, what `build repo` stores (attention
  fusion to MultiHeadAttention, ORT transformer fusions without SkipLayerNormalization, offline
  extended), and its `int8` variants: every MatMul int8, and what `--precision int8` stores (the
  first int8 graph within the int8 tolerance on the family's sample batches, which may keep the
  feed-forward outputs most sensitive to int8 in fp32).
Graphs stored optimized are opened at ORT_ENABLE_BASIC (what a server should use for them), the
others at ORT_ENABLE_ALL (ONNX Runtime's default, what the serving template uses today); the
pipeline's graph is also timed at ALL to show the level does not matter for it.

Every variant runs in the same process with the same inputs (random protein sequences of
--length residues, no padding), intra-op threads fixed (--threads), sequential execution.
Rounds of ~0.1 s per variant alternate between variants (the order rotates each round); the
median per-call time over rounds is reported, with the fastest round, and the ratio to the plain
TorchScript export is the median of the per-round ratios, so load from other processes (these
machines are shared) hits all variants alike. Each variant's embeddings are compared with PyTorch
(fp32) on the largest batch.

    .venv/bin/python benchmarks/graph_optimization.py [--models antiberty,esm2-35m] [--batches 1,16]
        [--length 120] [--rounds 15] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from bionemo_export import procfs
from bionemo_export.build import _sample_batches as build_sample_batches
from bionemo_export.exporters import export_onnx, optimize_and_verify, verify_onnx
from bionemo_export.exporters.optimize import fused_operators, optimize_onnx
from bionemo_export.exporters.signature import dynamic_axes
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.testing.checkpoints import ESM2_35M_SIZES, save_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
AMINO_ACIDS = "ACDEFGHIKLMNPQRSTVWY"
LEVELS = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
          "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
          "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}


def load_model(name: str, work: Path):
    if name == "antiberty":
        return get_family("bert").load(antiberty_checkpoint())
    if name == "esm2-35m":
        family = get_family("esm2")
        checkpoint = save_random_checkpoint("esm2", work / "esm2_35m", **ESM2_35M_SIZES)
        return family.load(checkpoint)
    raise SystemExit(f"unknown model {name!r}: antiberty or esm2-35m")


def encode(loaded, sequences: list[str]) -> dict[str, np.ndarray]:
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def export_torchscript(loaded, sample: dict[str, np.ndarray], path: Path) -> None:
    """The plain legacy export the issue compares with."""
    names = [spec.name for spec in loaded.inputs]
    axes = dynamic_axes([*loaded.inputs, *loaded.outputs])
    with torch.no_grad():
        torch.onnx.export(loaded.encoder.eval(), tuple(torch.from_numpy(sample[n]) for n in names), str(path),
                          dynamo=False, opset_version=18, input_names=names,
                          output_names=[spec.name for spec in loaded.outputs], dynamic_axes=axes)


def ort_transformers(src: Path, dst: Path, heads: int, hidden: int) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    optimize_model(str(src), model_type="bert", num_heads=heads, hidden_size=hidden, opt_level=0
                   ).save_model_to_file(str(dst))


def ort_offline(src: Path, dst: Path, level: str) -> None:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.optimized_model_filepath = str(dst)
    options.log_severity_level = 3
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])


def session(path: Path, level: str, threads: int) -> tuple[ort.InferenceSession, float]:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    start = time.perf_counter()
    created = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return created, time.perf_counter() - start


def build_variants(loaded, sample, folder: Path) -> list[tuple[str, Path, str, str]]:
    """(name, graph, session level, how it was made) for every variant, graphs written to folder."""
    heads, hidden = loaded.description["heads"], loaded.hidden_size
    dynamo, script = folder / "dynamo.onnx", folder / "torchscript.onnx"
    export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, sample, dynamo)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_torchscript(loaded, sample, script)
    variants = []
    for base, path in (("dynamo", dynamo), ("torchscript", script)):
        variants.append((base, path, "all", "as exported"))
        out = folder / f"{base}_ortt.onnx"
        ort_transformers(path, out, heads, hidden)
        variants.append((f"{base}+ort_transformers", out, "all", "optimize_model(bert), default fusions"))
        for level in ("extended", "all") if base == "dynamo" else ("extended",):
            out = folder / f"{base}_ort_{level}.onnx"
            ort_offline(path, out, level)
            variants.append((f"{base}+ort_offline_{level[:3]}", out, "basic", f"ORT offline {level}"))
        out = folder / f"{base}_pipeline.onnx"
        result = optimize_onnx(path, out, num_heads=heads, hidden_size=hidden)
        variants.append((f"{base}+pipeline", out, "basic", "; ".join(result.applied)))
        if base == "dynamo":
            variants.append((f"{base}+pipeline@all", out, "all", "the same graph opened at ORT_ENABLE_ALL"))
            out = folder / f"{base}_pipeline_int8.onnx"
            result = optimize_onnx(path, out, num_heads=heads, hidden_size=hidden, precision="int8")
            variants.append((f"{base}+pipeline int8 (all MatMuls)", out, "basic", "; ".join(result.applied)))
            # What `build repo --precision int8` stores: the first int8 graph within the int8
            # tolerance on the family's sample batches (some feed-forward outputs may stay fp32).
            family = loaded.family
            batches = [encode(loaded, batch) for batch in build_sample_batches(loaded)]
            report = verify_onnx(loaded.encoder, path, batches, atol=family.atol, min_cosine=family.min_cosine)
            chosen = optimize_and_verify(loaded.encoder, path, report, folder / "int8-built", batches, num_heads=heads,
                                         hidden_size=hidden, atol=family.atol, min_cosine=family.min_cosine,
                                         output_names=["hiddens", "embeddings"], mask_input="attention_mask",
                                         precision="int8", log=lambda message: None)
            kept_fp32 = chosen.record.to_dict()["quantization"]["kept_fp32"]
            variants.append((f"{base}+pipeline int8 (as built: {len(kept_fp32)} fp32)", chosen.path, "basic",
                             f"build repo --precision int8; kept fp32: {kept_fp32}"))
    return variants


def measure(loaded, variants, batches: list[int], length: int, rounds: int, threads: int) -> list[dict]:
    rng = np.random.default_rng(0)
    inputs = {b: encode(loaded, ["".join(rng.choice(list(AMINO_ACIDS), length)) for _ in range(b)])
              for b in batches}
    largest = inputs[max(batches)]
    with torch.inference_mode():
        reference = loaded.encoder(*(torch.from_numpy(largest[s.name]) for s in loaded.inputs))[1].numpy()
    sessions, rows = {}, []
    for name, path, level, how in variants:
        created, seconds = session(path, level, threads)
        created.run(None, inputs[batches[0]])  # first run allocates
        sessions[name] = created
        embeddings = created.run(["embeddings"], largest)[0]
        rows.append({"variant": name, "how": how, "level": level, "session_create_s": round(seconds, 3),
                     "fused": fused_operators(__import__("onnx").load(str(path), load_external_data=False)),
                     "max_abs_error": float(np.abs(embeddings - reference).max()),
                     "min_cosine": float(cosine_rows(embeddings, reference).min()),
                     "ms": {}, "min_ms": {}, "sequences_per_s": {}, "vs_torchscript": {}})
    for b in batches:
        calls = max(1, round(0.12 / (0.03 * b)))  # ~0.1 s of work per variant and round
        rounds_b = rounds if b > 1 else rounds * 2
        times = {name: [] for name in sessions}
        names = list(sessions)
        for round_index in range(rounds_b):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                start = time.perf_counter()
                for _ in range(calls):
                    sessions[name].run(None, inputs[b])
                times[name].append((time.perf_counter() - start) / calls)
            if (round_index + 1) % 5 == 0:
                print(f"  batch {b}: round {round_index + 1}/{rounds_b}", file=sys.stderr)
        anchor = times["torchscript"]
        for row in rows:
            mine = times[row["variant"]]
            median = statistics.median(mine)
            row["ms"][b] = round(median * 1000, 2)
            row["min_ms"][b] = round(min(mine) * 1000, 2)
            row["sequences_per_s"][b] = round(b / median, 1)
            # Paired within each round (the variants of one round ran seconds apart): robust to load
            # that comes and goes.
            row["vs_torchscript"][b] = round(statistics.median(a / m for a, m in zip(anchor, mine)), 3)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="antiberty,esm2-35m")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--length", type=int, default=120, help="residues per sequence")
    parser.add_argument("--rounds", type=int, default=15, help="rounds at batch > 1 (twice as many at batch 1)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "graph_optimization")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    batches = [int(b) for b in args.batches.split(",")]
    command = "  .venv/bin/python benchmarks/graph_optimization.py " + " ".join(sys.argv[1:])
    results = {"command": command.strip(), "machine": machine(), "versions": package_versions(),
               "threads": args.threads, "length": args.length, "batches": batches, "rounds": args.rounds,
               "models": {}}
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="bench-graph-opt-") as work:
        for model in args.models.split(","):
            print(f"{model}: exporting and optimizing", file=sys.stderr)
            loaded = load_model(model, Path(work))
            sample = encode(loaded, loaded.family.sample_sequences())
            folder = Path(work) / model
            folder.mkdir()
            variants = build_variants(loaded, sample, folder)
            rows = measure(loaded, variants, batches, args.length, args.rounds, args.threads)
            results["models"][model] = {"description": {k: loaded.description.get(k) for k in
                                                        ("architecture", "layers", "hidden", "heads", "parameters")},
                                        "variants": rows}
            loads.append(os.getloadavg()[0])
    results["load_average"] = [round(load, 2) for load in loads]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(results))
    print(report(results))
    return 0


def machine() -> str:
    cpu = procfs.cpu_model() or platform.processor()
    flags = procfs.cpu_flags()
    extensions = [f for f in ("avx512f", "avx512_vnni", "amx_int8", "amx_tile") if f in flags]
    return (f"{platform.platform()}, {os.cpu_count()} CPU cores ({cpu}; {', '.join(extensions) or 'no AVX-512'}), "
            f"shared")


def report(results: dict) -> str:
    versions = results["versions"]
    lines = [
        "# Exported graph optimization: ONNX Runtime CPU speed, side by side",
        "",
        "Command (repository root, after `make setup`):",
        "",
        "    " + results["command"],
        "",
        f"Machine: {results['machine']}. torch {versions.get('torch')}, onnxruntime {versions.get('onnxruntime')}, "
        f"onnx {versions.get('onnx')}, transformers {versions.get('transformers')}, Python {versions.get('python')}. "
        f"1-minute load average at the start and after each model: {results.get('load_average')} (other "
        "processes were running: the absolute times include their share, the ratios less so).",
        "",
        f"{results['threads']} intra-op threads, sequential execution; random protein sequences of {results['length']} "
        f"residues (no padding); median per-call time over {results['rounds']} interleaved rounds "
        f"({2 * results['rounds']} at batch 1), the fastest round in brackets. 'vs TS': the plain TorchScript "
        "export's time divided by the "
        "variant's, median of per-round ratios (above 1: faster); 'vs dynamo' likewise against the plain dynamo "
        "export. Level: the session's graph_optimization_level. Error/cosine: embeddings against PyTorch fp32 "
        "on the largest batch.",
    ]
    for model, data in results["models"].items():
        d = data["description"]
        rows = data["variants"]
        dynamo = next(r for r in rows if r["variant"] == "dynamo")
        lines += ["", f"## {model} ({d['architecture']}, {d['layers']} layers, hidden {d['hidden']}, "
                  f"{d['heads']} heads, {d['parameters'] / 1e6:.0f}M parameters)", ""]
        header = "| variant | level |"
        rule = "|---|---|"
        for b in results["batches"]:
            header += f" batch {b} ms (best) | seq/s | vs TS | vs dynamo |"
            rule += "---:|---:|---:|---:|"
        header += " session start s | max abs err | min cosine | fused |"
        rule += "---:|---:|---:|---|"
        lines += [header, rule]
        for r in rows:
            line = f"| {r['variant']} | {r['level']} |"
            for b in results["batches"]:
                key = str(b) if str(b) in r["ms"] else b
                ms = r["ms"][key]
                vs_dynamo = r["vs_torchscript"][key] / dynamo["vs_torchscript"][key]
                line += (f" {ms:.1f} ({r['min_ms'][key]:.1f}) | {r['sequences_per_s'][key]:.1f} | "
                         f"{r['vs_torchscript'][key]:.2f} | {vs_dynamo:.2f} |")
            fused = ", ".join(f"{op} {n}" for op, n in r["fused"].items() if op != "LayerNormalization") or "-"
            line += f" {r['session_create_s']:.2f} | {r['max_abs_error']:.1e} | {r['min_cosine']:.6f} | {fused} |"
            lines.append(line)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
