"""Decoding with the key/value cache vs without it: same model, same inputs, one run.

A MegaMolBART-sized model (random weights: hidden 512, 6 encoder + 6 decoder layers, 8 heads,
as in the released checkpoint; the timing does not depend on the weights) is exported to ONNX:
- with cache: `cross_kv` once per batch, then `decoder_step` per token (what N_decodes runs);
- without cache: `decoder_full` per token, recomputing every position and the cross-attention.
Both run greedy decoding with ONNX Runtime on the same hidden states for a fixed number of tokens
(random weights rarely emit the end token, so every run decodes exactly --tokens tokens), and must
produce the same tokens. Runs alternate between the two ways and the median is reported.

    .venv/bin/python benchmarks/decode_cache.py [--tokens 32,64,128] [--batch 1,8] [--repeats 3]
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

import numpy as np
import onnxruntime as ort
import torch

from bionemo_export.exporters import export_onnx
from bionemo_export.generation.reference import decoder_check_batches, encode_hiddens
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.models.base import seq2seq_graph_specs
from bionemo_export.serving.kv_decoder import OnnxRuntimeDecoder
from bionemo_export.serving.search import greedy
from bionemo_export.testing.checkpoints import save_random_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def decode_without_cache(session: ort.InferenceSession, hiddens: np.ndarray, mask: np.ndarray, begin_id: int,
                         tokens: int) -> np.ndarray:
    """Greedy decoding that recomputes the whole prefix (and the cross-attention) every step."""
    prefix = np.full((len(hiddens), 1), begin_id, dtype=np.int64)
    for _ in range(tokens):
        logits = session.run(["logits"], {"tokens": prefix, "hiddens": hiddens, "enc_mask": mask})[0]
        prefix = np.concatenate([prefix, logits[:, -1].argmax(-1)[:, None].astype(np.int64)], axis=1)
    return prefix[:, 1:]


def decode_with_cache(decoder: OnnxRuntimeDecoder, hiddens: np.ndarray, mask: np.ndarray, begin_id: int,
                      tokens: int) -> np.ndarray:
    # end_id -1: never reached, so every row decodes exactly `tokens` tokens.
    rows = greedy(decoder, hiddens, mask, begin_id=begin_id, end_id=-1, max_length=tokens)
    return np.array(rows, dtype=np.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="32,64,128")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_cache.json")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    batch_sizes = [int(b) for b in args.batch.split(",")]

    family = get_family("megamolbart")
    with tempfile.TemporaryDirectory() as work:
        work = Path(work)
        checkpoint = save_random_checkpoint("megamolbart", work / "ckpt", seed=0, hidden_size=512, num_layers=6,
                                            num_heads=8)
        loaded = family.load(checkpoint)
        seq2seq = loaded.seq2seq
        specs = seq2seq_graph_specs(seq2seq, loaded.hidden_size)
        samples = family.sample_sequences()
        hiddens, mask = encode_hiddens(loaded, (samples * 4)[: max(batch_sizes)])
        sessions = {}
        samples_for_tracing = _sample_inputs(loaded, samples[:3])
        for graph, module in (("cross_kv", seq2seq.cross_kv), ("decoder_step", seq2seq.decoder_step),
                              ("decoder_full", seq2seq.decoder_full)):
            inputs, outputs = specs[graph]
            result = export_onnx(module, inputs, outputs, samples_for_tracing[graph], work / f"{graph}.onnx")
            sessions[graph] = _session(result.path)
        cached = OnnxRuntimeDecoder({"cross_kv": sessions["cross_kv"], "decoder_step": sessions["decoder_step"]})

        rows = []
        for batch in batch_sizes:
            h, m = hiddens[:batch], mask[:batch]
            for count in token_counts:
                with_cache, without_cache = [], []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    fast = decode_with_cache(cached, h, m, seq2seq.begin_id, count)
                    with_cache.append(time.perf_counter() - start)
                    start = time.perf_counter()
                    slow = decode_without_cache(sessions["decoder_full"], h, m, seq2seq.begin_id, count)
                    without_cache.append(time.perf_counter() - start)
                    if not np.array_equal(fast, slow):
                        raise SystemExit(f"batch {batch}, {count} tokens: cached and uncached decodes differ")
                row = {"batch": batch, "tokens": count, "with_cache_s": statistics.median(with_cache),
                       "without_cache_s": statistics.median(without_cache)}
                row["speedup"] = row["without_cache_s"] / row["with_cache_s"]
                rows.append(row)
                print(f"batch {batch:2d}  {count:4d} tokens  with cache {row['with_cache_s'] * 1000:8.1f} ms  "
                      f"without {row['without_cache_s'] * 1000:8.1f} ms  speedup {row['speedup']:.2f}x", flush=True)

    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": {"family": "megamolbart", "hidden": 512, "layers": 6, "heads": 8, "weights": "random"},
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": torch.get_num_threads()},
        "versions": package_versions(),
        "repeats": args.repeats,
        "results": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


def _sample_inputs(loaded, sequences: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """Inputs to trace each graph with (the build's own check batches)."""
    encoded = loaded.tokenizer.encode(sequences)
    batch = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
             "residue_mask": encoded.residue_mask}
    cross, steps = decoder_check_batches(loaded, [batch])
    full = {"tokens": np.full((len(sequences), 3), loaded.seq2seq.begin_id, dtype=np.int64),
            "hiddens": cross[0]["hiddens"], "enc_mask": encoded.residue_mask}
    return {"cross_kv": cross[0], "decoder_step": steps[0], "decoder_full": full}


if __name__ == "__main__":
    sys.exit(main())
