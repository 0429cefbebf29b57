"""The serving suite: generated repositories against the baselines, side by side in one run.

    .venv/bin/python benchmarks/serving.py [--parts antiberty,mixed,decodes,esmc] [--window 5] [--out DIR]
    .venv/bin/python benchmarks/serving.py --parts mixed --quick     # smoke: tiny sizes, results in a temp folder
    .venv/bin/python benchmarks/serving.py --summary-only            # rewrite serving.md from serving.json

Parts (each measures its targets interleaved by concurrency, with the real perf_analyzer over gRPC
through `bionemo_export.bench`, on the same seeded inputs):

- `antiberty`: the real AntiBERTy (`antiberty==0.1.3` wheel), 256 antibody-like proteins of
  110-130 residues. Targets: the generated fp32 repository as built, the same repository and the
  `--precision int8` one after `bionemo-export tune` on this host (--tune-minutes each; tune's
  reports kept under results/serving/antiberty_tune_*), BioNeMo's way of serving
  (benchmarks/dev_server.py: PyTriton, PyTorch inside, max_batch_size 10), and in-process ONNX
  Runtime at batch sizes 1..32 over the same sequences, on the repository's own stored graph (the
  serving-overhead limit) and on a plain `torch.onnx.export` (TorchScript exporter) of the same
  model (each one's best batch is a throughput anchor; batch 1's median latency a latency anchor).
- `mixed`: the realistic protein workload: a random ESM-2 of the 35M size (12 layers, hidden 480,
  20 heads), 192 proteins with UniProt-like lengths (log-normal, median 275, sigma 0.6, clipped to
  30-1000 residues; MIXED_LENGTHS). Targets: the repository built with default options (length
  buckets + token budget), the same repository with plain dynamic batching (every batch padded to
  its longest request), and BioNeMo's way (benchmarks/dev_server.py: PyTriton, PyTorch inside, each
  batch padded to its longest row, max_batch_size 10). The throughput anchor is the in-process
  limit: ONNX Runtime in this process running the repository's own stored encoder graph
  (N_encoder/1/model.onnx, session options as the served model's: intra-op threads on every core,
  no spinning), on the same proteins sorted by length and split by the repository's own planner
  (serving/batching.plan_sub_batches with its length bucket and token budget), sequences/s over
  the whole set including tokenization, best of --repeats, measured before and after the served
  targets: the best any server can do on this CPU.
- `esmc`: ESM C at the 300M size (960 wide, 30 layers, 15 heads, SwiGLU 2560; random weights) on
  the `mixed` proteins: the repository built with default options against PyTorch (transformers'
  EsmcModel) served BioNeMo's way (benchmarks/dev_server.py), and the in-process limit as in `mixed`.
- `decodes`: a MegaMolBART-sized model (hidden 512, 6 + 6 layers, 8 heads, random weights, so every
  decode runs to --max-decode tokens): served `N_decodes` against in-process cached decoding
  (ONNX Runtime, the same cross_kv / decoder_step graphs, the same search code) on hidden states of
  the same lengths, at batch 1 and 8.

Results go to benchmarks/results/serving.md (+ .json, and each part's bench report with CSVs and a
PNG under benchmarks/results/serving/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from bionemo_export.bench import InputSpec, Target, run_benchmarks, write_report
from bionemo_export.bench.in_process import served_session
from bionemo_export.bench.inputs import TensorSpec, generate_inputs
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.model_repository.manifest import Manifest, package_versions
from bionemo_export.model_repository.pbtxt import read_config, write_config
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.runtime.server import free_ports
from bionemo_export.serving.batching import padding_counts, plan_sub_batches
from bionemo_export.serving.host import available_cores
from bionemo_export.testing.checkpoints import ESM2_35M_SIZES, ESMC_300M_SIZES, save_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------ baselines
def start_dev_server(checkpoint: Path, family: str, name: str, log: Path) -> tuple[subprocess.Popen, str]:
    """benchmarks/dev_server.py in its own process (so that it competes for the cores as a server
    would); returns (process, grpc url) once every model it serves answers (it says so in `log`)."""
    http, grpc, metrics = free_ports(3)
    process = subprocess.Popen(
        [sys.executable, str(HERE / "dev_server.py"), "--checkpoint", str(checkpoint), "--family", family,
         "--name", name, "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the dev server exited; see {log}")
        if "dev server ready" in log.read_text(errors="replace"):
            return process, f"grpc://127.0.0.1:{grpc}"
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"the dev server did not become ready; see {log}")


def stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGKILL)


def plain_onnx(loaded, path: Path) -> Path:
    """A plain `torch.onnx.export` (TorchScript exporter) of the pooled encoder: the anchor the issue
    names, independent of the project's export pipeline."""
    encoded = loaded.tokenizer.encode(loaded.family.sample_sequences()[:2])
    args = tuple(torch.from_numpy(a) for a in (encoded.input_ids, encoded.attention_mask, encoded.residue_mask))
    axes = {"input_ids": {0: "batch", 1: "length"}, "attention_mask": {0: "batch", 1: "length"},
            "residue_mask": {0: "batch", 1: "length"}, "hiddens": {0: "batch", 1: "length"},
            "embeddings": {0: "batch"}}
    torch.onnx.export(loaded.encoder, args, str(path), input_names=list(axes)[:3],
                      output_names=["hiddens", "embeddings"], dynamic_axes=axes, opset_version=17, dynamo=False)
    return path


def in_process(loaded, onnx_path: Path, sequences: list[str], batches: list[int], repeats: int = 3) -> dict:
    """ONNX Runtime in this process: sequences/s over all `sequences` in order, per batch size
    (each batch padded to its longest), median of `repeats`; and batch 1's median latency."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    feeds = {}
    for batch in batches:
        feeds[batch] = []
        for start in range(0, len(sequences), batch):
            e = loaded.tokenizer.encode(sequences[start:start + batch])
            feeds[batch].append({"input_ids": e.input_ids, "attention_mask": e.attention_mask,
                                 "residue_mask": e.residue_mask})
    session.run(["embeddings"], feeds[batches[0]][0])  # warm-up
    throughput, latencies = {}, []
    for batch in batches:
        runs = []
        for _ in range(repeats):
            began = time.perf_counter()
            for feed in feeds[batch]:
                t = time.perf_counter()
                session.run(["embeddings"], feed)
                if batch == 1:
                    latencies.append(time.perf_counter() - t)
            runs.append(len(sequences) / (time.perf_counter() - began))
        throughput[batch] = statistics.median(runs)
    best = max(throughput, key=lambda b: throughput[b])
    return {"throughput": throughput, "best_batch": best, "best_throughput": throughput[best],
            "p50_batch1_ms": 1000 * statistics.median(latencies) if latencies else None}


def sequences_of(spec: InputSpec) -> list[str]:
    data = generate_inputs([TensorSpec("sequences", "BYTES", (1,))], spec)
    return [entry["sequences"]["content"][0] for entry in data.entries]


# ------------------------------------------------------------------------------ parts
def tune_copy(source: Path, out: Path, report: Path, args) -> Path:
    """A copy of repository `source` tuned on this host by `bionemo-export tune` (its report kept
    under `report`): what a user does on the serving host before serving."""
    shutil.copytree(source, out)
    command = [sys.executable, "-m", "bionemo_export.cli.main", "tune", str(out), "--budget-minutes",
               f"{args.tune_minutes:g}", "--concurrency", "8,32", "--lengths", "antibody", "--report", str(report)]
    subprocess.run(command, check=True)
    shutil.rmtree(report / "work", ignore_errors=True)
    for name in ("input_data.json", "perf_tune_c8.csv", "perf_tune_c32.csv"):
        (report / name).unlink(missing_ok=True)
    return out


def part_antiberty(work: Path, args) -> dict:
    checkpoint = antiberty_checkpoint()
    family = get_family("bert")
    loaded = family.load(checkpoint)
    spec = InputSpec(lengths="antibody", count=256, seed=0)
    sequences = sequences_of(spec)
    built = {"fp32": work / "antiberty_fp32", "int8": work / "antiberty_int8"}
    for precision, path in built.items():
        build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="antiberty", out=path,
                                      backend="python", precision=precision))
    # Tuned on this host, as a user would before serving (tune's reports are committed beside the results).
    tuned = {precision: tune_copy(path, work / f"{path.name}_tuned", args.out / f"antiberty_tune_{precision}", args)
             for precision, path in built.items()}
    plain = plain_onnx(loaded, work / "antiberty_plain.onnx")
    stored = built["fp32"] / "antiberty_encoder" / "1" / "model.onnx"  # the repository's own optimized graph
    batches = [1, 2, 4, 8, 16, 32]
    graphs = {"stored": stored, "plain": plain}
    before = {graph: in_process(loaded, path, sequences, batches) for graph, path in graphs.items()}
    dev, dev_url = start_dev_server(checkpoint, "bert", "antiberty", work / "dev_server.log")
    try:
        targets = [Target(model="antiberty_embeddings", repository=built["fp32"], label="repository fp32 (as built)"),
                   Target(model="antiberty_embeddings", repository=tuned["fp32"], label="repository fp32 tuned"),
                   Target(model="antiberty_embeddings", repository=tuned["int8"], label="repository int8 tuned"),
                   Target(model="antiberty_embeddings", url=dev_url, label="dev server (PyTriton, PyTorch)")]
        results = run_benchmarks(targets, args.concurrency, spec, args.window, out_dir=args.out / "antiberty")
    finally:
        stop(dev)
    after = {graph: in_process(loaded, path, sequences, batches) for graph, path in graphs.items()}
    write_report(results, args.out / "antiberty", command=" ".join(sys.argv))
    anchors = {}
    for graph in ("stored", "plain"):
        anchors[graph] = {"best_throughput": statistics.mean([before[graph]["best_throughput"],
                                                              after[graph]["best_throughput"]]),
                          "p50_batch1_ms": statistics.mean([before[graph]["p50_batch1_ms"],
                                                            after[graph]["p50_batch1_ms"]]),
                          "before": before[graph], "after": after[graph]}
    int8_cosine = Manifest.read(built["int8"]).accuracy["outputs"]["embeddings"]["min_cosine"]
    tunings = {precision: Manifest.read(path).tuning for precision, path in tuned.items()}
    return {"in_process": anchors, "served": [r.to_dict() for r in results], "int8_min_cosine": int8_cosine,
            "tuning": {p: {"settings": t["settings"] if t else None, "figures": t["figures"] if t else None}
                       for p, t in tunings.items()}}


def padding_fraction(metrics_url: str) -> float | None:
    """Padded / all tokens the encoder ran, from its Triton metric (see templates/encoder_model.py.j2)."""
    import urllib.request

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("bionemo_export_encoder_tokens_total{"):
            kind = "padding" if 'kind="padding"' in line else "real"
            totals[kind] = totals.get(kind, 0.0) + float(line.rsplit(" ", 1)[-1])
    if not totals:
        return None
    return totals.get("padding", 0.0) / max(1.0, sum(totals.values()))


MIXED_LENGTHS = "lognormal:275,0.6,30-1000"
"""UniProt-like protein lengths: log-normal with median 275 residues and sigma 0.6 (5-95% about
100-740), clipped to 30-1000 so that every protein fits ESM-2's 1022 residues in one pass."""
DEV_LABEL = "BioNeMo way (PyTriton, PyTorch, max batch 10)"


def in_process_limit(repository: Path, name: str, tokenizer, sequences: list[str], repeats: int) -> dict:
    """The best any server can do with this repository on this CPU: ONNX Runtime in this process
    running the repository's own stored encoder graph in the session the served model opens
    (bench/in_process.served_session: its threads, memory arena and optimization level),
    over all `sequences` sorted by length and split by the served planner with the repository's own
    length bucket and token budget. Sequences/s over the whole set, tokenization included (a server
    tokenizes too), best of `repeats` (the fastest run is the one least disturbed by the machine)."""
    session, parameters = served_session(repository / f"{name}_encoder")
    bucket, budget = int(parameters.get("length_bucket", "0")), int(parameters.get("token_budget", "0"))

    def once() -> tuple[int, int]:
        """Every sequence's embedding, as the served encoder computes it; (real, padding) tokens."""
        encoded = tokenizer.encode(sequences)
        arrays = (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)
        lengths = encoded.attention_mask.sum(axis=1)
        batches = plan_sub_batches(lengths, bucket=bucket, token_budget=budget, limit=encoded.input_ids.shape[1])
        for batch in batches:
            session.run(["embeddings"], {key: array[batch.rows, :batch.length] for key, array in
                                         zip(("input_ids", "attention_mask", "residue_mask"), arrays)})
        return padding_counts(lengths, batches)

    real, padding = once()  # warm-up: the first calls of each shape allocate
    runs = []
    for _ in range(max(1, repeats)):
        began = time.perf_counter()
        once()
        runs.append(len(sequences) / (time.perf_counter() - began))
    return {"runs": runs, "best": max(runs), "length_bucket": bucket, "token_budget": budget,
            "threads": available_cores(), "padding_fraction": padding / (real + padding)}


def part_mixed(work: Path, args) -> dict:
    """The realistic protein workload: length buckets + token budget against plain dynamic batching
    (every batch padded to its longest request) and BioNeMo's way, same model, same inputs, with
    the in-process limit measured before and after."""
    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.runtime import TritonServer, find_tritonserver

    checkpoint = save_random_checkpoint("esm2", work / "esm2_35m", seed=0, **ESM2_35M_SIZES)
    repos = {"buckets + token budget": (work / "esm2_buckets", ServingOptions()),
             "plain dynamic batching": (work / "esm2_plain", ServingOptions(length_bucket=0, token_budget=0))}
    for path, options in repos.values():
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2", out=path,
                                      backend="python", serving=options))
    spec = InputSpec(lengths=MIXED_LENGTHS, count=args.proteins, seed=0)
    sequences = sequences_of(spec)
    lengths = np.array([len(s) for s in sequences])
    tokenizer = get_family("esm2").load(checkpoint).tokenizer
    default_repo = repos["buckets + token budget"][0]
    before = in_process_limit(default_repo, "esm2", tokenizer, sequences, args.repeats)
    dev, dev_url = start_dev_server(checkpoint, "esm2", "esm2", work / "dev_server.log")
    try:
        targets = [Target(model="esm2_embeddings", repository=path, label=label) for label, (path, _) in repos.items()]
        targets.append(Target(model="esm2_embeddings", url=dev_url, label=DEV_LABEL))
        results = run_benchmarks(targets, args.mixed_concurrency, spec, args.mixed_window, out_dir=args.out / "mixed",
                                 max_trials=args.max_trials)
    finally:
        stop(dev)
    after = in_process_limit(default_repo, "esm2", tokenizer, sequences, args.repeats)
    write_report(results, args.out / "mixed", command=" ".join(sys.argv))
    # The padding each layout pays on the same requests: a short run per repository, read from its metric.
    padding = {}
    for label, (path, _) in repos.items():
        with TritonServer(path, install=find_tritonserver()) as server:
            run_benchmarks([Target(model="esm2_embeddings", url=f"grpc://{server.endpoints.grpc_url}", label=label)],
                           [8], spec, 2.0, out_dir=work / f"padding_{len(padding)}", max_trials=args.max_trials)
            padding[label] = padding_fraction(server.endpoints.metrics_url)
    return {"served": [r.to_dict() for r in results], "padding_fraction": padding,
            "in_process": {"before": before, "after": after, "best": max(before["best"], after["best"])},
            "proteins": {"count": len(sequences), "lengths": MIXED_LENGTHS, "median": float(np.median(lengths)),
                         "mean": float(lengths.mean()), "min": int(lengths.min()), "max": int(lengths.max())}}


def part_decodes(work: Path, args) -> dict:
    from bionemo_export.serving.kv_decoder import OnnxRuntimeDecoder
    from bionemo_export.serving.search import greedy

    checkpoint = save_random_checkpoint("megamolbart", work / "mmb_ckpt", seed=0, hidden_size=512, num_layers=6,
                                        num_heads=8)
    repo = work / "mmb_repo"
    build_repository(BuildRequest(family="megamolbart", checkpoint=checkpoint, name="mmb", out=repo,
                                  backend="python", max_decode_length=args.max_decode, tasks=("hiddens", "decodes")))
    # The default (one decode-loop instance: the batcher hands it every queued request) against
    # the same repository with two instances, which split the queue but leave headroom for long requests.
    double = work / "mmb_repo_2"
    shutil.copytree(repo, double)
    config = read_config(double / "mmb_decodes")
    config.instance_group[0].count = 2
    write_config(double / "mmb_decodes", config)
    spec = InputSpec(lengths="smiles", count=64, seed=0)
    default = read_config(repo / "mmb_decodes").instance_group[0].count
    results = run_benchmarks([Target(model="mmb_decodes", repository=repo,
                                     label=f"served N_decodes, {default} instance{'s' * (default > 1)}"),
                              Target(model="mmb_decodes", repository=double, label="served N_decodes, 2 instances")],
                             [1, 8], spec, args.window, out_dir=args.out / "decodes")
    write_report(results, args.out / "decodes", command=" ".join(sys.argv))
    # In process: the repository's own graphs, the same search code, same hidden-state lengths.
    data = generate_inputs([TensorSpec("hiddens", "FP32", (-1, 512)), TensorSpec("mask", "BOOL", (-1,))], spec)
    graphs = repo / "mmb_decodes" / "1"  # the fused layout: the decode loop's own copies of the graphs
    sessions = {name: ort.InferenceSession(str(graphs / name / "model.onnx"), providers=["CPUExecutionProvider"])
                for name in ("cross_kv", "decoder_step")}
    decoder = OnnxRuntimeDecoder(sessions)
    rng = np.random.default_rng(0)
    lengths = data.lengths
    timings = {}
    for batch in (1, 8):
        began = time.perf_counter()
        for start in range(0, len(lengths), batch):
            chunk = lengths[start:start + batch]
            hiddens = rng.standard_normal((len(chunk), max(chunk), 512), dtype=np.float32)
            mask = np.arange(max(chunk))[None, :] < np.array(chunk)[:, None]
            greedy(decoder, hiddens, mask, begin_id=2, end_id=-1, max_length=args.max_decode)
        timings[batch] = len(lengths) / (time.perf_counter() - began)
    return {"in_process_decodes_per_s": timings, "served": [r.to_dict() for r in results],
            "max_decode": args.max_decode}


def part_esmc(work: Path, args) -> dict:
    """ESM C 300M-sized (random weights) on the mixed protein workload: the repository built with
    default options against PyTorch serving the same requests (benchmarks/dev_server.py: PyTriton,
    transformers' EsmcModel inside, max_batch_size 10), with the in-process limit (ONNX Runtime on
    the repository's own encoder graph) measured before and after."""
    sizes = ({"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128} if args.quick
             else ESMC_300M_SIZES)
    checkpoint = save_random_checkpoint("esmc", work / "esmc_300m", seed=0, **sizes)
    repository = work / "esmc_repo"
    build_repository(BuildRequest(family="esmc", checkpoint=checkpoint, name="esmc", out=repository,
                                  backend="python", tasks=("embeddings",)))
    spec = InputSpec(lengths=MIXED_LENGTHS, count=args.proteins, seed=0)
    sequences = sequences_of(spec)
    tokenizer = get_family("esmc").load(checkpoint).tokenizer
    before = in_process_limit(repository, "esmc", tokenizer, sequences, args.repeats)
    dev, dev_url = start_dev_server(checkpoint, "esmc", "esmc", work / "dev_server.log")
    try:
        targets = [Target(model="esmc_embeddings", repository=repository, label="repository (as built)"),
                   Target(model="esmc_embeddings", url=dev_url, label=DEV_LABEL)]
        results = run_benchmarks(targets, args.mixed_concurrency, spec, args.mixed_window, out_dir=args.out / "esmc",
                                 max_trials=args.max_trials)
    finally:
        stop(dev)
    after = in_process_limit(repository, "esmc", tokenizer, sequences, args.repeats)
    write_report(results, args.out / "esmc", command=" ".join(sys.argv))
    return {"served": [r.to_dict() for r in results], "sizes": sizes,
            "in_process": {"before": before, "after": after, "best": max(before["best"], after["best"])}}


PARTS = {"antiberty": part_antiberty, "mixed": part_mixed, "decodes": part_decodes, "esmc": part_esmc}


# ------------------------------------------------------------------------------ summary
def _served(part: dict, label_start: str) -> dict[int, dict]:
    """concurrency -> that target's figures, for the first served target whose label starts so."""
    for target in part.get("served", []):
        if target["label"].startswith(label_start):
            return {row["concurrency"]: row for row in target["results"]}
    return {}


def _check(value: float | None, target: float, higher_is_better: bool = True) -> str:
    if value is None:
        return "not measured"
    met = value >= target if higher_is_better else value <= target
    return "met" if met else "**not met**"


def targets(results: dict) -> list[tuple[str, str, str, str]]:
    """(target, required, measured, verdict) for every figure the speed issue names."""
    rows = []
    if "antiberty" in results:
        part = results["antiberty"]
        stored, plain = part["in_process"]["stored"], part["in_process"]["plain"]
        untuned, fp32, int8, dev = (_served(part, label) for label in (
            "repository fp32 (as built)", "repository fp32 tuned", "repository int8 tuned", "dev server"))
        for c in (8, 32):
            for graph, what in ((stored, "the repository's own graph"), (plain, "a plain export")):
                if c in fp32:
                    ratio = fp32[c]["sequences_per_s"] / graph["best_throughput"]
                    rows.append((f"fp32 tuned c{c} vs in-process ONNX Runtime on {what}, best batch "
                                 f"({graph['best_throughput']:.1f} seq/s)", ">= 1.0x", f"{ratio:.2f}x",
                                 _check(ratio, 1.0)))
            if c in fp32 and c in untuned:
                ratio = fp32[c]["sequences_per_s"] / untuned[c]["sequences_per_s"]
                rows.append((f"fp32 c{c}: tuned vs as built", "> 1.0x", f"{ratio:.2f}x", _check(ratio, 1.0)))
        if 1 in fp32:
            for graph, what in ((stored, "the repository's own graph"), (plain, "a plain export")):
                ratio = fp32[1]["p50_ms"] / graph["p50_batch1_ms"]
                rows.append((f"fp32 tuned p50 c1 vs in-process batch 1 on {what} ({graph['p50_batch1_ms']:.1f} ms)",
                             "<= 1.1x", f"{ratio:.2f}x", _check(ratio, 1.1, higher_is_better=False)))
        if 32 in int8 and 32 in dev:
            ratio = int8[32]["sequences_per_s"] / dev[32]["sequences_per_s"]
            rows.append(("int8 tuned c32 vs dev server", ">= 3x", f"{ratio:.2f}x", _check(ratio, 3.0)))
        if part.get("int8_min_cosine") is not None:
            rows.append(("int8 min cosine vs fp32 PyTorch (embeddings)", ">= 0.999", f"{part['int8_min_cosine']:.5f}",
                         _check(part["int8_min_cosine"], 0.999)))
    if "mixed" in results:
        part = results["mixed"]
        buckets, plain = _served(part, "buckets"), _served(part, "plain")
        for c in sorted(set(buckets) & set(plain)):
            ratio = buckets[c]["sequences_per_s"] / plain[c]["sequences_per_s"]
            rows.append((f"mixed lengths c{c}: buckets + budget vs plain dynamic batching", ">= 1.5x",
                         f"{ratio:.2f}x", _check(ratio, 1.5)))
        waste = part.get("padding_fraction", {}).get("buckets + token budget")
        rows.append(("mixed lengths: padding fraction (buckets + budget)", "< 15%",
                     "-" if waste is None else f"{100 * waste:.1f}%",
                     _check(None if waste is None else -waste, -0.15)))
        bionemo = _served(part, "BioNeMo")
        for c in (8, 32):
            if c in buckets and c in bionemo:
                ratio = buckets[c]["sequences_per_s"] / bionemo[c]["sequences_per_s"]
                rows.append((f"mixed lengths c{c}: buckets + budget vs BioNeMo's way", ">= 5x", f"{ratio:.2f}x",
                             _check(ratio, 5.0)))
        if 8 in buckets and 8 in bionemo:
            ratio = buckets[8]["p50_ms"] / bionemo[8]["p50_ms"]
            rows.append(("mixed lengths p50 c8: buckets + budget vs BioNeMo's way", "<= 0.25x", f"{ratio:.2f}x",
                         _check(ratio, 0.25, higher_is_better=False)))
        limit = part.get("in_process", {}).get("best")
        for c in (8, 32):
            if c in buckets and limit:
                ratio = buckets[c]["sequences_per_s"] / limit
                rows.append((f"mixed lengths c{c}: buckets + budget vs the in-process limit ({limit:.1f} seq/s)",
                             ">= 0.9x", f"{ratio:.2f}x", _check(ratio, 0.9)))
    if "esmc" in results:
        part = results["esmc"]
        served, bionemo = _served(part, "repository"), _served(part, "BioNeMo")
        limit = part.get("in_process", {}).get("best")
        for c in (8, 32):
            if c in served and limit:
                ratio = served[c]["sequences_per_s"] / limit
                rows.append((f"ESM C 300M-sized c{c}: repository vs the in-process limit ({limit:.1f} seq/s)",
                             ">= 0.9x", f"{ratio:.2f}x", _check(ratio, 0.9)))
            if c in served and c in bionemo:
                ratio = served[c]["sequences_per_s"] / bionemo[c]["sequences_per_s"]
                rows.append((f"ESM C 300M-sized c{c}: repository vs PyTorch (transformers) in PyTriton", "> 1x",
                             f"{ratio:.2f}x", _check(ratio, 1.0)))
    if "decodes" in results:
        part = results["decodes"]
        in_process = part["in_process_decodes_per_s"]
        batch8 = in_process.get("8", in_process.get(8))
        for target in part.get("served", []):
            served = {row["concurrency"]: row for row in target["results"]}
            if 8 in served and batch8:
                ratio = served[8]["sequences_per_s"] / batch8
                variant = target["label"].removeprefix("served N_decodes")
                rows.append((f"decodes{variant} c8 vs in-process cached decoding batch 8 ({batch8:.1f}/s)",
                             ">= 0.8x", f"{ratio:.2f}x", _check(ratio, 0.8)))
    return rows


def summary(results: dict) -> str:
    """benchmarks/results/serving.md: the targets, then every figure of each part."""
    lines = ["# Serving suite", "",
             f"Command: `{results['command']}`  ", f"Machine: {results['machine']}, {results['cores']} cores  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(results.get("versions", {}).items())), "",
             "Each part measures its targets side by side in one run, interleaved by concurrency (real "
             "perf_analyzer over gRPC). Ratios hold; absolute numbers on a shared machine do not.", "",
             "## Targets", "", "| target | required | measured | |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in targets(results)]
    for name in PARTS:
        if name not in results:
            continue
        part = results[name]
        lines += ["", f"## {name} ({part.get('seconds', '?')} s)", "",
                  "| target | concurrency | seq/s | p50 ms | p99 ms | server batch |", "|---|---|---|---|---|---|"]
        for target in part.get("served", []):
            for row in target["results"]:
                batch = "-" if row["server_batch_size"] is None else f"{row['server_batch_size']:.2f}"
                lines.append(f"| {target['label']} | {row['concurrency']} | {row['sequences_per_s']:.1f} | "
                             f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {batch} |")
        lines += ["", "Where the time goes (perf_analyzer's server-side breakdown per request, ms):", "",
                  "| target | concurrency | client + network | queue | compute input | compute infer "
                  "| compute output |",
                  "|---|---|---|---|---|---|---|"]
        for target in part.get("served", []):
            for row in target["results"]:
                pa = {key: float(value) / 1000 for key, value in row.get("perf_analyzer", {}).items()
                      if key != "Concurrency" and value not in ("", None)}
                if not pa:
                    continue
                network = sum(pa.get(key, 0.0) for key in ("Client Send", "Network+Server Send/Recv", "Client Recv"))
                lines.append(f"| {target['label']} | {row['concurrency']} | {network:.1f} | "
                             f"{pa.get('Server Queue', 0):.1f} | {pa.get('Server Compute Input', 0):.1f} | "
                             f"{pa.get('Server Compute Infer', 0):.1f} | {pa.get('Server Compute Output', 0):.1f} |")
        if name == "antiberty":
            ip = part["in_process"]
            lines += ["", "In-process ONNX Runtime, sequences/s per batch size, measured before and after the served "
                          "targets, on the repository's own stored graph and on a plain `torch.onnx.export`:", "",
                      "| batch | stored graph, before | after | plain export, before | after |",
                      "|---|---|---|---|---|"]
            for batch, value in ip["stored"]["before"]["throughput"].items():
                lines.append(f"| {batch} | {value:.1f} | {ip['stored']['after']['throughput'][batch]:.1f} | "
                             f"{ip['plain']['before']['throughput'][batch]:.1f} | "
                             f"{ip['plain']['after']['throughput'][batch]:.1f} |")
            lines.append(f"\nBatch 1 median latency (mean of both runs): stored graph "
                         f"{ip['stored']['p50_batch1_ms']:.1f} ms, plain export {ip['plain']['p50_batch1_ms']:.1f} ms.")
            for precision, tuning in (part.get("tuning") or {}).items():
                if tuning and tuning.get("settings"):
                    settings = "; ".join(f"{model}: " + ", ".join(f"{k} {v}" for k, v in values.items())
                                         for model, values in tuning["settings"].items())
                    lines.append(f"\n`tune` chose for {precision} (report: "
                                 f"serving/antiberty_tune_{precision}/report.md): {settings}.")
        if name == "mixed" and part.get("proteins"):
            p = part["proteins"]
            lines += ["", f"Proteins: {p['count']}, lengths `{p['lengths']}` (median {p['median']:.0f}, mean "
                          f"{p['mean']:.0f}, {p['min']}-{p['max']} residues)."]
        if name in ("mixed", "esmc") and part.get("in_process"):
            ip = part["in_process"]
            runs = {when: ", ".join(f"{v:.1f}" for v in ip[when]["runs"]) for when in ("before", "after")}
            lines += ["", f"In-process limit (ONNX Runtime on the repository's own encoder graph, "
                          f"{ip['before']['threads']} threads, sorted by length, bucket "
                          f"{ip['before']['length_bucket']}, token budget {ip['before']['token_budget']}, "
                          f"tokenization included): "
                          f"**{ip['best']:.1f} seq/s** (best run); runs before the served targets: {runs['before']}; "
                          f"after: {runs['after']}; padding {100 * ip['before']['padding_fraction']:.1f}%."]
        if name == "mixed" and part.get("padding_fraction"):
            lines += [""] + [f"- padding fraction, {label}: {100 * value:.1f}%"
                             for label, value in part["padding_fraction"].items() if value is not None]
        if name == "decodes":
            lines += ["", f"In-process cached decoding ({part['max_decode']} tokens each), decodes/s: "
                      + ", ".join(f"batch {b}: {v:.1f}" for b, v in part["in_process_decodes_per_s"].items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--window", type=float, default=5.0, help="perf_analyzer measurement window (s)")
    parser.add_argument("--max-decode", type=int, default=32)
    parser.add_argument("--tune-minutes", type=float, default=5.0,
                        help="the antiberty part's `bionemo-export tune` budget per repository (fp32, int8)")
    parser.add_argument("--mixed-concurrency", default="8,32",
                        help="the mixed part's concurrencies (add 1 for latency at low load: several minutes more)")
    parser.add_argument("--mixed-window", type=float, default=20.0,
                        help="the mixed part's measurement window (s): long enough for BioNeMo's way, at a few "
                             "proteins/s, to see dozens of the random-length proteins per window")
    parser.add_argument("--proteins", type=int, default=192, help="the mixed part's proteins")
    parser.add_argument("--repeats", type=int, default=3, help="in-process limit runs (best counts), before and after")
    parser.add_argument("--max-trials", type=int, default=10, help="perf_analyzer windows before it gives up on "
                        "stability (then it measures a fixed request count)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 24 proteins, 2 s windows, concurrency 8, 1 repeat, 3 trials; results in a "
                             "temporary folder unless --out is given")
    parser.add_argument("--out", type=Path, default=None, help=f"default {RESULTS / 'serving'}")
    parser.add_argument("--summary-only", action="store_true",
                        help="rewrite serving.md from the committed serving.json without measuring")
    args = parser.parse_args()
    if args.quick:
        args.proteins, args.window, args.mixed_window, args.repeats, args.max_trials = 24, 2.0, 2.0, 1, 3
        args.tune_minutes = 1.0
        args.concurrency = args.mixed_concurrency = "8"
        args.out = args.out or Path(tempfile.mkdtemp(prefix="serving-quick-")) / "serving"
    args.out = args.out or RESULTS / "serving"
    store = args.out.parent / "serving.json"
    if args.summary_only:
        (args.out.parent / "serving.md").write_text(summary(json.loads(store.read_text())))
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.mixed_concurrency = [int(c) for c in args.mixed_concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    # Parts run separately add to the same record (each part is one side-by-side run of its own).
    results = json.loads(store.read_text()) if store.exists() else {}
    results.update({"command": " ".join(["python", *sys.argv]), "machine": platform.platform(),
                    "cores": os.cpu_count(), "versions": package_versions()})
    with tempfile.TemporaryDirectory(prefix="bionemo-serving-bench-") as work:
        for part in args.parts.split(","):
            started = time.time()
            (Path(work) / part).mkdir()
            results[part] = PARTS[part](Path(work) / part, args)
            results[part]["seconds"] = round(time.time() - started)
            results[part]["command"] = results["command"]
            store.write_text(json.dumps(results, indent=2, default=str) + "\n")
            (args.out.parent / "serving.md").write_text(summary(results))
    print(json.dumps({k: v for k, v in results.items() if k not in ("versions",)}, indent=2, default=str)[:4000])
    print(f"results: {store} and {args.out.parent / 'serving.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
