"""An int4 repository served by the real tritonserver: its Python-backend encoder model opens the
MatMulNBits graph, passes its golden check on this host, and answers within int4's tolerance of
PyTorch and as ONNX Runtime does in-process (exporters/optimize/weight_only.py)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.choices import Precision
from bionemo_export.client import RepositoryClient
from bionemo_export.exporters.verification import PRECISION_MIN_COSINE
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.testing.checkpoints import save_random_checkpoint

SEQUENCES = ["EVQLVESGGGLVQPGGSLRLSCAASGFTFSSYAMS", "DIQMTQSPSSLSASVGDRVTITC", "QVQLQESGPGLVKPSETLSLTCTVSGGSISSYYWS"]


def test_an_int4_repository_is_served_and_answers_within_its_tolerance(tmp_path, triton_install):
    checkpoint = save_random_checkpoint("bert", tmp_path / "checkpoint", seed=0)
    result = build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="ab", out=tmp_path / "repo",
                                           backend="python", precision=Precision.INT4, tasks=("embeddings",)))
    assert result.manifest.precision == "int4"
    graph = tmp_path / "repo" / "ab_encoder" / "1" / "model.onnx"
    with TritonServer(tmp_path / "repo", install=triton_install, log_file=tmp_path / "tritonserver.log") as server:
        with RepositoryClient("ab", f"grpc://{server.endpoints.grpc_url}") as client:
            served = client.seqs_to_embedding(SEQUENCES)
    loaded = get_family("bert").load(checkpoint)
    encoded = loaded.tokenizer.encode(SEQUENCES)
    inputs = {"input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask,
              "residue_mask": encoded.residue_mask}
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [value.name for value in session.get_inputs()]
    outputs = [value.name for value in session.get_outputs()]
    in_process = np.asarray(session.run(["embeddings"], {n: inputs[n] for n in names})[0])
    with torch.inference_mode():
        reference = loaded.encoder(*(torch.from_numpy(inputs[n]) for n in names))[outputs.index("embeddings")].numpy()
    assert served.shape == reference.shape
    assert np.min(cosine_rows(served.astype(np.float64), reference.astype(np.float64))) \
        >= PRECISION_MIN_COSINE["int4"]["embeddings"]
    np.testing.assert_allclose(served, in_process, atol=1e-4)
