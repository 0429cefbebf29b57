"""What a layer costs: the encoder graph's embeddings (N_embeddings today) against the layers graph
(N_layer_graph) fetching the last layer, a middle one, or every one, in process on the stored graphs
with the served session options, then the same through N_layers' served logic (serving/layers.py:
batching and pooling), and optionally through a real tritonserver.

    .venv/bin/python benchmarks/layers_cost.py [--rows 8] [--length 120] [--repeats 20] [--served]
    .venv/bin/python benchmarks/layers_cost.py --family esm2 --checkpoint ./esm2_t33_650M_UR50D

Default checkpoint: the real AntiBERTy (antiberty wheel, 8 blocks). Run it on a quiet machine: the
numbers are medians of `--repeats` runs of one batch of `--rows` random proteins of `--length`
residues. The expectation it checks: the last layer's mean from N_layers costs about what
N_embeddings costs (the same blocks run, plus pooling in numpy), and a middle layer costs the same
as the last (ONNX Runtime runs every block whichever outputs are fetched; fetching fewer outputs
only saves their copies). Results go to --out (default: a temporary folder; nothing committed).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bionemo_export.bench.inputs import random_proteins
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.model_repository.manifest import package_versions
from bionemo_export.models import get_family
from bionemo_export.models.bert import antiberty_checkpoint
from bionemo_export.serving.host import available_cores
from bionemo_export.serving.layers import LayerEmbeddings, has_bos_token
from bionemo_export.serving.responses import Responder


def served_session(path: Path) -> ort.InferenceSession:
    """The session as the served models open it (serving/onnx_session.py: every core, no spinning)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = available_cores()
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def median_ms(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--family", default="bert")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the real AntiBERTy")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-optimize", action="store_true", help="store the encoder graph unoptimized")
    parser.add_argument("--served", action="store_true", help="also time the models through tritonserver")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    checkpoint = args.checkpoint or antiberty_checkpoint()
    out = args.out or Path(tempfile.mkdtemp(prefix="bionemo-export-layers-cost-"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bionemo-export-layers-cost-build-"))
    result = build_repository(BuildRequest(family=args.family, checkpoint=checkpoint, name="lc", out=work / "repo",
                                           backend="python", tasks=("embeddings", "hiddens", "layers"),
                                           optimize=not args.no_optimize))
    loaded = get_family(args.family).load(checkpoint)
    count = loaded.num_layers
    sequences = random_proteins(np.full(args.rows, args.length), np.random.default_rng(0))
    encoded = loaded.tokenizer.encode(sequences)
    feed = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask}
    encoder = served_session(result.repository / "lc_encoder" / "1" / "model.onnx")
    layers = served_session(result.repository / "lc_layer_graph" / "1" / "model.onnx")
    every = [f"hiddens_{i}" for i in range(count + 1)]
    timings = {
        "encoder graph: embeddings (N_embeddings today)":
            median_ms(lambda: encoder.run(["embeddings"], {**feed, "residue_mask": encoded.residue_mask}),
                      args.repeats),
        f"layers graph: hiddens_{count} (the last)": median_ms(lambda: layers.run([every[-1]], feed), args.repeats),
        f"layers graph: hiddens_{count // 2} (a middle one)":
            median_ms(lambda: layers.run([every[count // 2]], feed), args.repeats),
        "layers graph: every layer": median_ms(lambda: layers.run(every, feed), args.repeats),
    }

    def run_graph(input_ids, attention_mask, wanted):
        return layers.run([f"hiddens_{i}" for i in wanted], {"input_ids": input_ids, "attention_mask": attention_mask})

    model = LayerEmbeddings(loaded.tokenizer, run_graph, num_layers=count,
                            has_bos=has_bos_token(loaded.tokenizer, sequences[0]), token_budget=1 << 20,
                            max_rows=args.rows, responder=Responder("lc_layers"))
    column = np.array([[s.encode()] for s in sequences], dtype=np.object_)
    for label, chosen in (("N_layers logic: layer -1, mean", [-1]), (f"N_layers logic: layer {count // 2}, mean",
                                                                       [count // 2])):
        request = {"sequences": column, "layers": np.array([chosen] * args.rows, dtype=np.int32)}
        timings[label] = median_ms(lambda request=request: model.answer([request]), args.repeats)
    if args.served:
        from bionemo_export.client import RepositoryClient
        from bionemo_export.runtime import TritonServer

        with TritonServer(result.repository, log_file=work / "tritonserver.log") as server, \
                RepositoryClient("lc", f"grpc://{server.endpoints.grpc_url}") as client:
            timings["served: N_embeddings"] = median_ms(lambda: client.seqs_to_embedding(sequences), args.repeats)
            timings["served: N_layers, layer -1, mean"] = median_ms(
                lambda: client.layer_embeddings(sequences, [-1]), args.repeats)
            timings[f"served: N_layers, layer {count // 2}, mean"] = median_ms(
                lambda: client.layer_embeddings(sequences, [count // 2]), args.repeats)
    lines = [f"# Layers cost: {args.family} ({checkpoint.name}, {count} blocks, hidden {loaded.hidden_size})", "",
             f"`{' '.join(['benchmarks/layers_cost.py', *sys.argv[1:]])}`; {args.rows} rows of {args.length} residues; "
             f"median of {args.repeats}; {platform.processor() or platform.machine()}, {available_cores()} cores; "
             f"onnxruntime {package_versions().get('onnxruntime')}", "", "| what | ms per batch |", "|---|---|"]
    lines += [f"| {label} | {ms:.2f} |" for label, ms in timings.items()]
    (out / "layers_cost.md").write_text("\n".join(lines) + "\n")
    (out / "layers_cost.json").write_text(json.dumps(timings, indent=2) + "\n")
    print("\n".join(lines))
    print(f"\nwritten to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
