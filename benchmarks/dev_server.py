"""The baseline every speed claim is measured against: BioNeMo's way of serving, a PyTriton
"dev" server whose inference callable runs the PyTorch model in the Python process.

As BioNeMo's servers do: one Triton model per task (`N_embeddings`, `N_hiddens`), `sequences`
BYTES [1] in, max_batch_size 10 with dynamic batching and no queue delay, the model in PyTorch
(fp32, eval, inference_mode). Tokenization is the package's own (the same ids the generated
repository computes), so the comparison is about serving, not tokenizers.

    python benchmarks/dev_server.py --family bert --checkpoint CKPT --name antiberty --grpc-port 8101

PyTriton 0.7 protects Triton's statistics endpoint with a token, which perf_analyzer over gRPC
cannot pass (PLATFORM.md): the endpoints are left unprotected here, as a benchmark needs.
It serves until SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

from bionemo_export.models import load_checkpoint
from bionemo_export.runtime.discovery import _python_stub_env

MAX_BATCH_SIZE = 10  # BioNeMo's servers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--family", default=None, help="model family (optional for .nemo)")
    parser.add_argument("--name", required=True, help="model name prefix: NAME_embeddings, NAME_hiddens")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    args = parser.parse_args()

    # PyTriton starts its tritonserver from this process: give its Python stubs this interpreter's
    # environment and libpython (PLATFORM.md), as the project's own server runner does.
    for key, value in _python_stub_env().items():
        os.environ[key] = value + (os.pathsep + os.environ[key] if os.environ.get(key) else "")
    loaded = load_checkpoint(args.checkpoint, args.family)
    encoder = loaded.encoder.eval()

    def run(sequences: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        encoded = loaded.tokenizer.encode([item[0] for item in sequences])
        with torch.inference_mode():
            hiddens, embeddings = encoder(torch.from_numpy(encoded.input_ids),
                                          torch.from_numpy(encoded.attention_mask),
                                          torch.from_numpy(encoded.residue_mask))
        return hiddens.numpy(), embeddings.numpy(), encoded.residue_mask

    @batch
    def embeddings(sequences: np.ndarray) -> dict[str, np.ndarray]:
        return {"embeddings": run(sequences)[1]}

    @batch
    def hiddens(sequences: np.ndarray) -> dict[str, np.ndarray]:
        hidden_states, _, mask = run(sequences)
        return {"hiddens": hidden_states, "mask": mask}

    config = TritonConfig(http_address=args.host, http_port=args.http_port, grpc_address=args.host,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    size = loaded.hidden_size
    with Triton(config=config, security_config=TritonSecurityConfig(restricted_endpoints=[])) as triton:
        batching = ModelConfig(max_batch_size=MAX_BATCH_SIZE, batcher=DynamicBatcher())
        triton.bind(model_name=f"{args.name}_embeddings", infer_func=embeddings,
                    inputs=[Tensor(name="sequences", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="embeddings", dtype=np.float32, shape=(size,))], config=batching)
        triton.bind(model_name=f"{args.name}_hiddens", infer_func=hiddens,
                    inputs=[Tensor(name="sequences", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="hiddens", dtype=np.float32, shape=(-1, size)),
                             Tensor(name="mask", dtype=np.bool_, shape=(-1,))], config=batching)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):  # whatever disposition we inherited
            signal.signal(sig, lambda *_: stop.set())
        triton.run()
        print(f"dev server ready: grpc {args.host}:{args.grpc_port}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
