"""The baseline every speed claim is measured against: BioNeMo's way of serving, a PyTriton "dev"
server whose inference callables run the PyTorch model in the Python process.

A thin wrapper around the package's own dev server (bionemo_export/dev_server.py, also
`bionemo-export dev-server`), kept for benchmarks/serving.py, which starts it as a subprocess:
one Triton model per task (`N_embeddings`, `N_hiddens`; `N_decodes`, `N_samplings` for families
that decode), `sequences` BYTES [1] in, max_batch_size 10 with dynamic batching and no queue
delay, the model in PyTorch (fp32, eval, inference_mode), the package's tokenizers (the same ids
the generated repository computes), so the comparison is about serving, not tokenizers. As in
BioNeMo's servers (their @batch callables), all the requests the batcher hands over run as one
forward, every row padded to the batch's longest, and the callable runs in PyTriton's inference
worker thread (every PyTriton callable does: pytriton/proxy/inference.py's InferenceHandler).

    python benchmarks/dev_server.py --family bert --checkpoint CKPT --name antiberty --grpc-port 8101

It serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bionemo_export.dev_server import MAX_BATCH_SIZE, DevModels, Ports, serve
from bionemo_export.models import load_checkpoint


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--family", default=None, help="model family (optional for .nemo)")
    parser.add_argument("--name", required=True, help="model name prefix: NAME_embeddings, NAME_hiddens, ...")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--max-batch-size", type=int, default=MAX_BATCH_SIZE)
    args = parser.parse_args()

    ports = Ports(args.host, args.http_port, args.grpc_port, args.metrics_port)
    models = DevModels(load_checkpoint(args.checkpoint, args.family))
    serve(models, args.name, ports, max_batch_size=args.max_batch_size,
          on_ready=lambda names: print(f"dev server ready: grpc {args.host}:{args.grpc_port}", flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
