"""The main job on the embedded default: build a model repository, serve it, query it.

Until `bionemo-export build repo` exists this serves the small hand-made Python-backend
repository used by the runtime tests; it exercises the same path a real repository takes:
the real tritonserver from nvidia-pytriton, loopback ports, HTTP and gRPC clients.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bionemo_export.runtime import TritonServer  # noqa: E402
from tests.helpers.tiny_repository import tiny_repository  # noqa: E402


def main() -> None:
    out = ROOT / "demo_out"
    shutil.rmtree(out, ignore_errors=True)
    repo = tiny_repository(out / "model_repository")
    print(f"model repository: {repo}")
    with TritonServer(repo, log_file=out / "tritonserver.log") as server:
        ep = server.endpoints
        print(f"tritonserver {server.metadata()['version']} ready: http://{ep.http_url} grpc://{ep.grpc_url}")

        http = httpclient.InferenceServerClient(ep.http_url)
        x = np.array([[0.5, 1.0, 2.0]], dtype=np.float32)
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        print(f"HTTP affine({x.tolist()}) = {http.infer('affine', [inp]).as_numpy('y').tolist()}")
        http.close()

        grpc = grpcclient.InferenceServerClient(ep.grpc_url)
        seqs = np.array([[b"MSLKRKNIALIPAAGIGVRFG"]], dtype=np.object_)
        sinp = grpcclient.InferInput("sequences", list(seqs.shape), "BYTES")
        sinp.set_data_from_numpy(seqs)
        out_seqs = grpc.infer("reverse", [sinp]).as_numpy("reversed")
        print(f"gRPC reverse({seqs[0, 0].decode()}) = {out_seqs[0, 0].decode()}")
        grpc.close()
    print("server stopped")


if __name__ == "__main__":
    main()
