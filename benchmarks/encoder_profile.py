"""Where a served encoder's time goes, in process: the served code path (serving/encoding.py's
GraphEncoder on the repository's own stored graph and session options) timed part by part on the
batches the dynamic batcher hands over, and the same rows cut into sub-batches of each size.

    .venv/bin/python benchmarks/encoder_profile.py [--rows 11] [--repeats 20]

The real AntiBERTy (antiberty wheel), 120-residue antibody-like sequences. Parts: tokenizing
(the fused layout tokenizes inside the encoder model), joining and planning the rows, ONNX Runtime
(`session.run`), and copying the outputs into each request's answer. Then rows/s of ONNX Runtime
per sub-batch size (`max_sub_batch`) for the same batch: the server's best sub-batch on this CPU.
Results: benchmarks/results/encoder_profile.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from bionemo_export.bench.in_process import TimedSession, served_session
from bionemo_export.bench.inputs import random_proteins
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.serving.encoding import GraphEncoder
from bionemo_export.serving.host import available_cores
from bionemo_export.serving.responses import Responder

RESULTS = Path(__file__).resolve().parent / "results"
SUB_BATCHES = (1, 2, 3, 4, 6, 0)


def profile(encoder: GraphEncoder, session: TimedSession, tokenizer, sequences: list[str], repeats: int) -> dict:
    """Milliseconds per handed-over batch of `sequences` (one request per sequence, as perf_analyzer
    sends them): tokenizing, ONNX Runtime, and the rest of GraphEncoder.run (joining, planning,
    copying outputs); medians over `repeats`."""
    parts: dict[str, list[float]] = {"tokenize": [], "onnxruntime": [], "join, plan, copy": [], "total": []}
    for _ in range(repeats):
        began = time.perf_counter()
        inputs = []
        for sequence in sequences:
            encoded = tokenizer.encode([sequence])
            inputs.append((encoded.input_ids, encoded.attention_mask, encoded.residue_mask))
        tokenized = time.perf_counter()
        session.seconds = 0.0
        encoder.run(inputs, {"embeddings"})
        done = time.perf_counter()
        parts["tokenize"].append(tokenized - began)
        parts["onnxruntime"].append(session.seconds)
        parts["join, plan, copy"].append(done - tokenized - session.seconds)
        parts["total"].append(done - began)
    return {name: 1000 * statistics.median(values) for name, values in parts.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", default="4,11", help="batches the dynamic batcher hands over (rows)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "encoder_profile.md")
    args = parser.parse_args()
    loaded = get_family("bert").load(antiberty_checkpoint())
    tokenizer = loaded.tokenizer
    rng = np.random.default_rng(0)
    sizes = [int(r) for r in args.rows.split(",")]
    lines = ["# Where a served encoder's time goes (in process)", "",
             f"Command: `python {' '.join(sys.argv)}`  ",
             f"Machine: {platform.platform()}, {available_cores()} usable cores  ",
             "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(package_versions().items()) if v), "",
             "The real AntiBERTy's repository (fp32, as built), its stored graph opened as the served model "
             "opens it; GraphEncoder.run (serving/encoding.py) on batches of 120-residue sequences, one request "
             "each, as the dynamic batcher hands them over. Medians of "
             f"{args.repeats} runs.", ""]
    with tempfile.TemporaryDirectory(prefix="encoder-profile-") as work:
        repo = Path(work) / "repo"
        build_repository(BuildRequest(family="bert", checkpoint=antiberty_checkpoint(), name="antiberty", out=repo,
                                      backend="python"))
        session = TimedSession(served_session(repo / "antiberty_encoder")[0])
        encoder = GraphEncoder(session, lambda request: request, outputs=("embeddings",), pad_id=tokenizer.pad_id,
                               length_bucket=16, token_budget=8192, responder=Responder("antiberty_encoder"),
                               input_prefix="antiberty")
        encoder.warm_up()
        lines += ["| rows handed over | tokenize ms | ONNX Runtime ms | join, plan, copy ms | total ms | "
                  "ONNX Runtime share |", "|---|---|---|---|---|---|"]
        for rows in sizes:
            sequences = random_proteins(np.full(rows, 120), rng)
            parts = profile(encoder, session, tokenizer, sequences, args.repeats)
            lines.append(f"| {rows} | {parts['tokenize']:.2f} | {parts['onnxruntime']:.1f} | "
                         f"{parts['join, plan, copy']:.2f} | {parts['total']:.1f} | "
                         f"{100 * parts['onnxruntime'] / parts['total']:.1f}% |")
        lines += ["", "The same batches cut into sub-batches of at most `max_sub_batch` rows (rows/s of the whole "
                  "GraphEncoder.run; 0: no row limit, the token budget alone):", "",
                  "| rows handed over | " + " | ".join(f"max_sub_batch {m}" for m in SUB_BATCHES) + " |",
                  "|---|" + "---|" * len(SUB_BATCHES)]
        for rows in sizes:
            sequences = random_proteins(np.full(rows, 120), rng)
            cells = []
            for most in SUB_BATCHES:
                encoder.max_sub_batch = most
                total = profile(encoder, session, tokenizer, sequences, args.repeats)["total"]
                cells.append(f"{1000 * rows / total:.1f}")
            encoder.max_sub_batch = 0
            lines.append(f"| {rows} | " + " | ".join(cells) + " |")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
