"""Weight-only quantization on the real AntiBERTy: fp32, int8 (dynamic), int8w and int4 side by side
in one run (exporters/optimize/weight_only.py, docs/building.md).

    .venv/bin/python benchmarks/weight_only.py [--sequences 16] [--pll 8] [--rounds 5] [--out DIR]
    .venv/bin/python benchmarks/weight_only.py --smoke     # fewer sequences, to a temporary folder

Each precision is built as a user builds it (`build_repository`, python backend, tasks embeddings
and logits: the encoder graph in that precision, the masked-LM head in fp32) and its stored graphs
are run in-process with ONNX Runtime as its served model opens them (serving/onnx_session.py: the
graph this host's served model picks, at the serving level, idle threads asleep, no arena).

- accuracy against PyTorch fp32 (transformers' BertModel on AntiBERTy's weights, the runner the
  project's build checks against): embeddings min cosine over `--sequences` antibody heavy chains
  (111-130 residues; targets int8w >= 0.9995, int4 >= 0.99), hidden states min cosine per residue;
- PLL drift: each of `--pll` sequences' pseudo-log-likelihood (AntiBERTy's: the mean over residues
  of log p(residue) with it masked, the special tokens out of the softmax) against fp32's graph;
- a saturation scan: every substitution of one heavy chain scored by masked marginals (position
  masked, log p(mutant) - log p(wild type)), Spearman with fp32's graph (target >= 0.99);
- weight bytes on disk (the encoder graph's files), a fresh process's resident memory after
  opening the encoder session and running one batch, and sequences/s (median of `--rounds`
  interleaved rounds over the same batch, the precisions alternating, so a busy moment of a shared
  host falls on all of them);
- the session spread the build's margin covers: each quantized graph's golden batch in fresh
  sessions at 1-4 intra-op threads and at ONNX Runtime's four optimization levels;
- a grid of the weight-only settings: 8 and 4 bits at block sizes 32, 64, 128 and accuracy levels
  0 and 4, each graph's embeddings min cosine and speed (what chose the defaults).

Results: results/weight_only.json (with --smoke: a temporary folder), with the command, the
machine (CPU model and vector units) and package versions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _scoring_bench import RESULTS, SMOKE_RESULTS, bench_environment, heavy_chains, spearman  # noqa: E402

PRECISIONS = ("fp32", "int8", "int8w", "int4")
TARGETS = {"int8w": 0.9995, "int4": 0.99}
"""The issue's embeddings min cosine targets against fp32."""
LEVELS = ("ORT_DISABLE_ALL", "ORT_ENABLE_BASIC", "ORT_ENABLE_EXTENDED", "ORT_ENABLE_ALL")

RSS_PROBE = """
import json, sys
import numpy as np, onnxruntime as ort
def rss(field="VmRSS:"):  # VmHWM: this process's peak (ru_maxrss carries the parent's across fork/exec)
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
before = rss()
options = ort.SessionOptions()
options.intra_op_num_threads = int(sys.argv[3]); options.inter_op_num_threads = 1
options.enable_cpu_mem_arena = False
options.add_session_config_entry("session.intra_op.allow_spinning", "0")
options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, sys.argv[2])
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
opened = rss()
feed = dict(np.load(sys.argv[4]))
session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
print(json.dumps({"before": before, "opened": opened, "after_run": rss(), "peak": rss("VmHWM:")}))
"""


def build(precision: str, out: Path) -> dict[str, Any]:
    """The repository of `precision` (python backend, embeddings + logits), its build seconds and
    manifest; or, when the build refuses it (no graph within the tolerance and its margin), the
    refusal's message."""
    from bionemo_export.build import BuildError, BuildRequest, build_repository
    from bionemo_export.models.bert import antiberty_checkpoint

    start = time.perf_counter()
    try:
        result = build_repository(BuildRequest(family="bert", checkpoint=antiberty_checkpoint(), name="ab", out=out,
                                               backend="python", precision=precision, tasks=("embeddings", "logits")))
    except BuildError as err:
        return {"seconds": round(time.perf_counter() - start, 1), "refused": str(err)}
    return {"seconds": round(time.perf_counter() - start, 1), "manifest": result.manifest}


def unbuilt_graph(loaded, precision: str, work: Path, batch: dict[str, np.ndarray]) -> Path:
    """The graph a refused build's first candidate stores (optimize_onnx with the build's defaults)."""
    from bionemo_export.exporters import export_onnx
    from bionemo_export.exporters.optimize.candidates import optimize_onnx

    plain = work / "plain" / "model.onnx"
    if not plain.exists():
        plain.parent.mkdir(parents=True)
        export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, batch, plain)
    return optimize_onnx(plain, work / f"{precision}-unbuilt" / "model.onnx", num_heads=loaded.description["heads"],
                         hidden_size=loaded.hidden_size, precision=precision).path


def served_graph(repo: Path) -> tuple[Path, str]:
    """The encoder graph this host's served model opens, and the session level its config names."""
    from bionemo_export.serving.onnx_session import graph_for_this_host

    version = repo / "ab_encoder" / "1"
    config = (repo / "ab_encoder" / "config.pbtxt").read_text()
    level = next((name for name in LEVELS if f'"{name}"' in config), "ORT_ENABLE_ALL")
    return Path(graph_for_this_host(str(version), ["CPUExecutionProvider"])), level


def session(path: Path, level: str, threads: int):
    import onnxruntime as ort

    from bionemo_export.exporters.runtime_session import served_session_options

    return ort.InferenceSession(str(path), served_session_options(level, threads), providers=["CPUExecutionProvider"])


def encode(loaded, sequences: list[str]) -> dict[str, np.ndarray]:
    encoded = loaded.tokenizer.encode(sequences)
    return {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
            "residue_mask": encoded.residue_mask}


def run(sess, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [value.name for value in sess.get_inputs()]
    outputs = [value.name for value in sess.get_outputs()]
    return {name: np.asarray(value) for name, value in zip(outputs, sess.run(None, {n: batch[n] for n in names}))}


def masked_log_probs(loaded, encoder, head, sequence: str, positions: list[int], chunk: int = 32) -> np.ndarray:
    """[len(positions), alphabet]: log-probabilities at each position of the copy that masks it."""
    mask = loaded.tokenizer.mask_char
    rows = []
    for start in range(0, len(positions), chunk):
        part = positions[start:start + chunk]
        copies = [sequence[:i] + mask + sequence[i + 1:] for i in part]
        hiddens = run(encoder, encode(loaded, copies))["hiddens"]
        log_probs = run(head, {"hiddens": hiddens})["log_probs"]
        rows += [log_probs[row, 1 + i] for row, i in enumerate(part)]
    return np.stack(rows)


def pll(loaded, encoder, head, sequence: str) -> float:
    alphabet = list(loaded.alphabet)
    rows = masked_log_probs(loaded, encoder, head, sequence, list(range(len(sequence))))
    return float(np.mean([rows[i, alphabet.index(residue)] for i, residue in enumerate(sequence)]))


def saturation_scan(loaded, encoder, head, sequence: str) -> np.ndarray:
    """Every substitution's masked-marginal score, position by position, in alphabet order."""
    alphabet = list(loaded.alphabet)
    rows = masked_log_probs(loaded, encoder, head, sequence, list(range(len(sequence))))
    return np.array([rows[i, alphabet.index(m)] - rows[i, alphabet.index(w)]
                     for i, w in enumerate(sequence) for m in alphabet if m != w])


def graph_bytes(path: Path) -> int:
    data = path.with_name(path.name + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def resident(path: Path, level: str, threads: int, feed: Path) -> dict[str, int]:
    done = subprocess.run([sys.executable, "-c", RSS_PROBE, str(path), level, str(threads), str(feed)],
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def cosine_figures(answers: dict[str, np.ndarray], reference: dict[str, np.ndarray], mask: np.ndarray) -> dict:
    from bionemo_export.serving.golden import compare

    return {name: {"min_cosine": compare(answers[name], reference[name], mask).min_cosine,
                   "max_abs_error": compare(answers[name], reference[name], mask).max_abs_error}
            for name in ("embeddings", "hiddens")}


def spread(path: Path, golden: Path) -> dict[str, Any]:
    """The golden batch's embeddings/hiddens min cosine in fresh sessions: threads x levels."""
    from bionemo_export.serving.golden import read_golden

    stored = read_golden(str(golden))
    found = {}
    for level, threads in itertools.product(LEVELS, (1, 2, 3, 4)):
        checks = stored.run(session(path, level, threads))
        found[f"{level}, {threads} threads"] = {c.name: c.figures.min_cosine for c in checks}
    values = {name: [figures[name] for figures in found.values()] for name in next(iter(found.values()))}
    return {"sessions": found, "min": {n: min(v) for n, v in values.items()},
            "max": {n: max(v) for n, v in values.items()}, "spread": {n: max(v) - min(v) for n, v in values.items()}}


def grid(loaded, plain: Path, work: Path, batch: dict[str, np.ndarray], reference: dict[str, np.ndarray],
         rounds: int) -> list[dict[str, Any]]:
    """Weight-only settings on one plain export: each graph's accuracy and speed, side by side."""
    from bionemo_export.exporters.optimize.candidates import optimize_onnx
    from bionemo_export.exporters.optimize.pipeline import FusedGraphs, time_graphs

    fused = FusedGraphs(plain, loaded.description["heads"], loaded.hidden_size).get(True)
    rows, graphs = [], {}
    for precision, block, level in itertools.product(("int8w", "int4"), (32, 64, 128), (0, 4)):
        result = optimize_onnx(plain, work / f"{precision}-{block}-{level}" / "model.onnx",
                               num_heads=loaded.description["heads"], hidden_size=loaded.hidden_size,
                               precision=precision, block_size=block, accuracy_level=level, fused=fused)
        answers = run(session(result.path, "ORT_ENABLE_BASIC", 2), batch)
        label = f"{precision} block {block} level {level}"
        graphs[label] = result.path
        rows.append({"label": label, "precision": precision, "block_size": block, "accuracy_level": level,
                     "bytes": graph_bytes(result.path),
                     **{f"{name}_min_cosine": figures["min_cosine"]
                        for name, figures in cosine_figures(answers, reference, batch["attention_mask"] != 0).items()}})
    fp32 = optimize_onnx(plain, work / "fp32" / "model.onnx", num_heads=loaded.description["heads"],
                         hidden_size=loaded.hidden_size, fused=fused).path
    ms = time_graphs({"fp32": fp32, **graphs}, batch, rounds=rounds)
    for row in rows:
        row["ms"], row["speed_vs_fp32"] = ms[row["label"]], round(ms["fp32"] / ms[row["label"]], 3)
    return [{"label": "fp32", "ms": ms["fp32"]}, *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--pll", type=int, default=8, help="sequences whose PLL is compared")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-grid", action="store_true", help="skip the grid of block sizes and levels")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--shared", default="", help="a note that other work ran on the machine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.sequences, args.pll, args.rounds = 4, 1, 2
    out = args.out or (SMOKE_RESULTS if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from bionemo_export.models import get_family
    from bionemo_export.models.bert import antiberty_checkpoint

    loaded = get_family("bert").load(antiberty_checkpoint())
    rng = np.random.default_rng(0)
    sequences = heavy_chains(args.sequences, rng)
    batch = encode(loaded, sequences)
    names = [spec.name for spec in loaded.inputs]
    with torch.inference_mode():
        outputs = loaded.encoder(*(torch.from_numpy(batch[n]) for n in names))
    reference = {spec.name: value.numpy() for spec, value in zip(loaded.outputs, outputs)}
    valid = batch["attention_mask"] != 0
    cores = len(__import__("os").sched_getaffinity(0))

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="weight-only-") as work:
        work_dir = Path(work)
        feed = work_dir / "batch.npz"
        np.savez(feed, **batch)
        sessions, heads = {}, {}
        for precision in PRECISIONS:
            print(f"building {precision}", flush=True)
            built = build(precision, work_dir / precision)
            if "refused" in built:  # measured all the same: the graph its first candidate is
                graph, level = unbuilt_graph(loaded, precision, work_dir, batch), "ORT_ENABLE_BASIC"
                record: dict[str, Any] = {"build_refused": built["refused"], "graph": "the first candidate (refused)"}
                head = work_dir / "fp32" / "ab_lm_head" / "1" / "model.onnx"
            else:
                graph, level = served_graph(work_dir / precision)
                manifest = built["manifest"]
                optimization = manifest.export["encoder"]["optimization"]
                record = {"graph": str(graph.relative_to(work_dir / precision)), "build_accuracy": manifest.accuracy,
                          "applied": optimization.get("applied"),
                          "rejected": [r.get("options") for r in optimization.get("rejected", [])]}
                head = work_dir / precision / "ab_lm_head" / "1" / "model.onnx"
            sessions[precision] = session(graph, level, cores)
            heads[precision] = session(head, "ORT_ENABLE_ALL", cores)
            answers = run(sessions[precision], batch)
            results[precision] = {
                **record, "serving_level": level, "build_seconds": built["seconds"],
                "vs_pytorch_fp32": cosine_figures(answers, reference, valid),
                "weight_bytes": graph_bytes(graph), "resident": resident(graph, level, cores, feed),
            }
            # A refused graph's golden batch: the build's, which every precision shares (fp32's file).
            golden = next((path for path in (graph.parent / "golden.npz", graph.parent.parent / "golden.npz",
                                             work_dir / "fp32" / "ab_encoder" / "1" / "golden.npz")
                           if path.exists()), graph.parent / "golden.npz")
            if precision != "fp32" and golden.exists():
                results[precision]["session_spread"] = spread(graph, golden)
            print(precision, results[precision]["vs_pytorch_fp32"], flush=True)

        print("speed", flush=True)
        times: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for sess in sessions.values():
            run(sess, batch)
        for _ in range(args.rounds):
            for precision, sess in sessions.items():
                start = time.perf_counter()
                run(sess, batch)
                times[precision].append(time.perf_counter() - start)
        for precision in PRECISIONS:
            seconds = float(np.median(times[precision]))
            results[precision]["sequences_per_second"] = round(len(sequences) / seconds, 2)
            results[precision]["speed_vs_fp32"] = round(float(np.median(times["fp32"])) / seconds, 3)

        print("PLL and saturation scan", flush=True)
        plls = {p: [pll(loaded, sessions[p], heads[p], s) for s in sequences[:args.pll]] for p in PRECISIONS}
        scan = {p: saturation_scan(loaded, sessions[p], heads[p], sequences[0]) for p in PRECISIONS}
        for precision in PRECISIONS:
            drift = np.array(plls[precision]) - np.array(plls["fp32"])
            results[precision]["pll"] = {"values": plls[precision], "drift": drift.tolist(),
                                         "max_abs_drift": float(np.abs(drift).max())}
            results[precision]["saturation_scan"] = {
                "variants": int(scan[precision].size),
                "spearman_with_fp32": spearman(scan[precision], scan["fp32"]),
                "max_abs_difference": float(np.abs(scan[precision] - scan["fp32"]).max())}
        for precision, target in TARGETS.items():
            results[precision]["target_embeddings_min_cosine"] = target
            measured = results[precision]["vs_pytorch_fp32"]["embeddings"]["min_cosine"]
            results[precision]["target_met"] = measured >= target
        fp32_bytes = results["fp32"]["weight_bytes"]
        for precision in PRECISIONS:
            results[precision]["weight_bytes_vs_fp32"] = round(results[precision]["weight_bytes"] / fp32_bytes, 4)

        grid_rows = None
        if not args.no_grid:
            print("grid", flush=True)
            plain = work_dir / "plain" / "model.onnx"
            if not plain.exists():
                from bionemo_export.exporters import export_onnx

                plain.parent.mkdir()
                export_onnx(loaded.encoder, loaded.inputs, loaded.outputs, batch, plain)
            grid_rows = grid(loaded, plain, work_dir / "grid", batch, reference, args.rounds)

    env = bench_environment()
    document = {
        "command": " ".join(["python", "benchmarks/weight_only.py", *sys.argv[1:]]),
        "machine": {"cpu": env["processor"], "cores": cores, "cpu_flags": env["cpu_flags"],
                    "shared": args.shared or "no other work noted"},
        "versions": {key: env[key] for key in ("python", "onnxruntime", "torch", "transformers") if key in env},
        "sequences": len(sequences), "lengths": [len(s) for s in sequences], "pll_sequences": args.pll,
        "scan_sequence_length": len(sequences[0]), "results": results, "grid": grid_rows,
    }
    path = out / "weight_only.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    print(f"wrote {path}")
    for precision in PRECISIONS:
        r = results[precision]
        accuracy, rss = r["vs_pytorch_fp32"], r["resident"]["after_run"] / 2**20
        print(f"{precision}: embeddings {accuracy['embeddings']['min_cosine']:.6f} hiddens "
              f"{accuracy['hiddens']['min_cosine']:.6f} bytes {r['weight_bytes_vs_fp32']}x seq/s "
              f"{r['sequences_per_second']} ({r['speed_vs_fp32']}x) RSS {rss:.0f} MiB PLL max drift "
              f"{r['pll']['max_abs_drift']:.2e} scan rho {r['saturation_scan']['spearman_with_fp32']:.4f}")


if __name__ == "__main__":
    main()
