"""Why two BioNeMo-style baselines on the real AntiBERTy can differ: the PyTorch forward a PyTriton
inference callable runs, measured in one process under each condition that differs between
plausible implementations of BioNeMo's way.

    .venv/bin/python benchmarks/bionemo_baselines.py [--rounds 20] [--sequences 10]

Every condition runs the same seeded antibody-like sequences (110-130 residues) through the real
AntiBERTy (the `antiberty==0.1.3` wheel, loaded by the package's bert family: a transformers
BertModel plus masked-mean pooling, as the dev server runs it), at batch 10 (BioNeMo's
max_batch_size) unless the condition says otherwise. Conditions take short turns, round after
round; each round records how many cores the rest of the machine used meanwhile (/proc/stat).
The report gives each condition's best round (its speed when nothing else took a core: on a shared
machine whose load comes and goes, a condition's rounds split between "had both cores" and "had
one") and its median, as ratios to `worker, inference_mode`:

- `worker, inference_mode`: what bionemo_export/dev_server.py computes per batch, in one
  long-lived thread, as PyTriton calls every inference callable (pytriton/proxy/inference.py:
  InferenceHandler is a Thread running an asyncio loop); torch.get_num_threads() is read there;
- `main thread` / `new thread per call`: the same in the main thread (a plain in-process loop),
  or in a thread started for each call;
- `no_grad` / `grad enabled`: the forward under torch.no_grad, or with autograd recording;
- `batch 1 per request`: each request of the batch run alone (a callable without @batch that
  loops over PyTriton's requests);
- `HF tokenizer per batch`: a transformers tokenizer on every batch (residues joined by spaces,
  as AntiBERTyRunner does) instead of the package's numpy tokenizer: BertTokenizer (Rust, the
  transformers 5 class) and BertTokenizerLegacy (pure Python: what AntiBERTyRunner's
  BertTokenizer was under transformers 4);
- `eager attention`: transformers' eager attention instead of its default SDPA;
- `torch.set_num_threads(1) in the worker / in the main thread`: a server that limits torch's
  threads (to leave cores to Triton), inside the callable or in the main thread once the worker
  runs: does the worker follow (the threads column), and what one thread costs;
- `+ busy Python thread`: a neighbour thread running pure Python (holds the GIL between its
  switch intervals), which every torch op of the forward must reacquire the GIL against.

Results: benchmarks/results/bionemo_baselines.md (+ .json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bionemo_export.bench import InputSpec
from bionemo_export.bench.inputs import TensorSpec, generate_inputs
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 10
REFERENCE = "worker, inference_mode"
QUIET = 0.25
"""A round is quiet when other processes used less than this many cores meanwhile."""


def busy_seconds() -> float:
    """CPU seconds every process of the machine has spent so far (/proc/stat: all but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def sequences(count: int) -> list[str]:
    data = generate_inputs([TensorSpec("sequences", "BYTES", (1,))], InputSpec(lengths="antibody", count=count))
    return [entry["sequences"]["content"][0] for entry in data.entries]


class Forward:
    """The encoder's forward over token rows, under a grad mode, with one tokenizer."""

    def __init__(self, loaded, encoder: torch.nn.Module, hf_tokenizer=None) -> None:
        self.loaded, self.encoder, self.hf_tokenizer = loaded, encoder, hf_tokenizer

    def __call__(self, batch: list[str], grad: str) -> np.ndarray:
        if self.hf_tokenizer is not None:  # AntiBERTyRunner's way: residues joined by spaces
            out = self.hf_tokenizer([" ".join(s) for s in batch], return_tensors="np", padding=True)
            ids = out["input_ids"].astype(np.int64)
            attention = out["attention_mask"].astype(np.int64)
            residues = attention.astype(bool)
            residues[:, 0] = False
            residues[np.arange(len(batch)), attention.sum(1) - 1] = False
            arrays = (ids, attention, residues)
        else:
            e = self.loaded.tokenizer.encode(batch)
            arrays = (e.input_ids, e.attention_mask, e.residue_mask)
        tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        if grad == "inference_mode":
            with torch.inference_mode():
                return self.encoder(*tensors)[1].numpy()
        if grad == "no_grad":
            with torch.no_grad():
                return self.encoder(*tensors)[1].numpy()
        return self.encoder(*tensors)[1].detach().numpy()


WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inference_handler")
"""One long-lived thread that runs every `worker` condition, as PyTriton's InferenceHandler runs
every batch of a model."""


def run(forward: Forward, data: list[str], *, grad: str = "inference_mode", batch: int = BATCH,
        where: str = "worker", busy_neighbour: bool = False, threads: int | None = None,
        main_threads: int | None = None) -> tuple[float, float, int]:
    """(sequences/s over `data` in batches of BATCH, each run as `batch`-sized calls; cores the
    process used meanwhile (CPU time / wall time, the busy neighbour's included); torch's intra-op
    threads where it ran). `where`: "worker" (WORKER's long-lived thread), "new thread" (a thread
    started for this call) or "main". `threads`: torch.set_num_threads where it runs;
    `main_threads`: torch.set_num_threads in the main thread, to see whether a running worker
    follows (both restored after)."""
    defaults = torch.get_num_threads()

    def work() -> tuple[float, float, int]:
        restore = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            used = torch.get_num_threads()
            began, cpu = time.perf_counter(), time.process_time()
            for start in range(0, len(data), BATCH):
                chunk = data[start:start + BATCH]
                for sub in range(0, len(chunk), batch):
                    forward(chunk[sub:sub + batch], grad)
            wall = time.perf_counter() - began
            return len(data) / wall, (time.process_time() - cpu) / wall, used
        finally:
            torch.set_num_threads(restore)

    stop = threading.Event()
    neighbour = None
    if busy_neighbour:
        def spin() -> None:
            x = 0
            while not stop.is_set():
                x = (x + 1) % 1000003
        neighbour = threading.Thread(target=spin, daemon=True)
        neighbour.start()
    if main_threads is not None:
        torch.set_num_threads(main_threads)
    try:
        if where == "worker":
            return WORKER.submit(work).result()
        if where == "new thread":
            result: list[tuple[float, float, int]] = []
            thread = threading.Thread(target=lambda: result.append(work()))
            thread.start()
            thread.join()
            return result[0]
        return work()
    finally:
        stop.set()
        if neighbour is not None:
            neighbour.join()
        torch.set_num_threads(defaults)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sequences", type=int, default=10, help="sequences per condition and round (short "
                        "turns, many rounds: a loaded machine's drift reaches every condition alike)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bionemo_baselines")
    args = parser.parse_args()

    from transformers import BertTokenizer
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    checkpoint = antiberty_checkpoint()
    family = get_family("bert")
    loaded = family.load(checkpoint)
    loaded.encoder.eval()
    eager = family.load(checkpoint).encoder.eval()
    backbone: Any = eager.backbone  # a transformers BertModel
    backbone.config._attn_implementation = "eager"  # transformers reads it per call
    vocab = str(checkpoint.parent / "vocab.txt")  # the wheel's trained_models/vocab.txt
    plain, eager_fwd = Forward(loaded, loaded.encoder), Forward(loaded, eager)
    rust = Forward(loaded, loaded.encoder, BertTokenizer(vocab=vocab, do_lower_case=False))
    python = Forward(loaded, loaded.encoder, BertTokenizerLegacy(vocab_file=vocab, do_lower_case=False))
    data = sequences(args.sequences)
    # The tokenizers agree on the ids, so every condition computes the same embeddings.
    for other in (rust, python):
        if not np.allclose(plain(data[:4], "inference_mode"), other(data[:4], "inference_mode"), atol=1e-4):
            raise SystemExit(f"{vocab}: the transformers tokenizer's ids differ from the package's")

    conditions: dict[str, Callable[[], tuple[float, float, int]]] = {
        REFERENCE: lambda: run(plain, data),
        "main thread, inference_mode": lambda: run(plain, data, where="main"),
        "new thread per call, inference_mode": lambda: run(plain, data, where="new thread"),
        "worker, no_grad": lambda: run(plain, data, grad="no_grad"),
        "worker, grad enabled": lambda: run(plain, data, grad="enabled"),
        "main thread, grad enabled": lambda: run(plain, data, grad="enabled", where="main"),
        "worker, batch 1 per request": lambda: run(plain, data, batch=1),
        "worker, HF BertTokenizer (Rust) per batch": lambda: run(rust, data),
        "worker, HF BertTokenizerLegacy (Python) per batch": lambda: run(python, data),
        "worker, eager attention": lambda: run(eager_fwd, data),
        "worker, torch.set_num_threads(1) in the worker": lambda: run(plain, data, threads=1),
        "worker, torch.set_num_threads(1) in the main thread": lambda: run(plain, data, main_threads=1),
        "worker + busy Python thread": lambda: run(plain, data, busy_neighbour=True),
    }
    run(plain, data[:BATCH], where="main")  # warm-up, both threads
    run(plain, data[:BATCH])
    rates: dict[str, list[float]] = {name: [] for name in conditions}
    cores: dict[str, list[float]] = {name: [] for name in conditions}
    others: list[float] = []
    threads: dict[str, int] = {}
    for round_ in range(args.rounds):
        busy, own, began = busy_seconds(), os.times(), time.perf_counter()
        for name, condition in conditions.items():
            rate, used, threads[name] = condition()
            rates[name].append(rate)
            cores[name].append(used)
        mine = sum(os.times()[:2]) - sum(own[:2])
        others.append(max(0.0, busy_seconds() - busy - mine) / (time.perf_counter() - began))
        print(f"round {round_ + 1}/{args.rounds} (other processes: {others[-1]:.2f} cores): "
              + ", ".join(f"{rates[n][-1]:.1f}" for n in conditions), flush=True)

    record = {"command": " ".join(["python", *sys.argv]), "machine": platform.platform(), "cores": os.cpu_count(),
              "versions": package_versions(), "torch_parallel_info": torch.__config__.parallel_info(),
              "rates": rates, "cores_used": cores, "other_processes_cores": others, "threads": threads}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    best = {name: max(range(args.rounds), key=lambda i, name=name: rates[name][i]) for name in conditions}
    lines = ["# BioNeMo-style baselines: where a PyTorch PyTriton callable's time goes", "",
             f"Command: `{record['command']}`  ", f"Machine: {record['machine']}, {record['cores']} cores  ",
             f"torch {torch.__version__}; real AntiBERTy, batch {BATCH}, {args.sequences} antibody-like sequences "
             f"per condition and round, {args.rounds} rounds, conditions interleaved; the rest of the machine used "
             f"{statistics.median(others):.2f} cores (median of the rounds; {sum(o < QUIET for o in others)} rounds "
             f"under {QUIET}). Best round: the condition's speed when it had the cores (the load here comes and "
             f"goes, so each condition's rounds split between all cores and one); ratios to `{REFERENCE}`, what a "
             "PyTriton callable (the dev server's) runs.", "",
             "| condition | torch threads | best round seq/s | ratio | cores used then | median seq/s | ratio |",
             "|---|---|---|---|---|---|---|"]
    top, middle = rates[REFERENCE][best[REFERENCE]], statistics.median(rates[REFERENCE])
    for name in conditions:
        i, median = best[name], statistics.median(rates[name])
        lines.append(f"| {name} | {threads[name]} | {rates[name][i]:.1f} | {rates[name][i] / top:.2f}x | "
                     f"{cores[name][i]:.2f} | {median:.1f} | {median / middle:.2f}x |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
