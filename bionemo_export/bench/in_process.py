"""A repository's encoder run in this process exactly as its served model runs it: the anchor that
tells serving overhead apart from the graph's own time (benchmarks/serving.py, encoder_profile.py,
esm_cpp.py).

    encoder = InProcessEncoder(Path("repo"), "esm2", tokenizer)
    embeddings = encoder.embeddings(["MKTAYIAKQR", ...])            # [N, H], in the caller's order

The session is opened by the served code itself (serving/onnx_session.create_session) from the
model's own config.pbtxt, so its threads, memory arena, optimization level, CPU-kind graph and
golden check are the served model's; the rows go through the served GraphEncoder (length buckets,
token budget, sub-batch limit from the same config). Needs onnxruntime and numpy, not torch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.model_repository.reader import config_json
from bionemo_export.serving.encoding import GraphEncoder
from bionemo_export.serving.onnx_session import create_session
from bionemo_export.serving.responses import Responder


def served_session(folder: Path) -> tuple[Any, dict[str, str]]:
    """(the ONNX Runtime session, the config's parameters) of the graph model in `folder` (a
    repository's N_encoder, N_cross_kv, ...), opened by the served code from its config.pbtxt."""
    config = read_config(folder)
    args = {"model_config": json.dumps(config_json(config)), "model_name": config.name, "model_repository": str(folder),
            "model_instance_kind": "CPU"}
    return create_session(args, str(folder / "1"))


@dataclass
class Timing:
    """Seconds of one pass over some sequences: all of it, and ONNX Runtime's share."""

    total: float
    graph: float


class TimedSession:
    """A session whose run() seconds are added up (what the graph itself cost)."""

    def __init__(self, session: Any) -> None:
        self.session, self.seconds = session, 0.0

    def run(self, names: Any, feed: Any) -> Any:
        began = time.perf_counter()
        try:
            return self.session.run(names, feed)
        finally:
            self.seconds += time.perf_counter() - began


class InProcessEncoder:
    """Repository `repository`'s `<name>_encoder` in this process: `tokenizer` (the family's, as
    the fused layout's model tokenizes) and the served GraphEncoder on the served session."""

    def __init__(self, repository: Path, name: str, tokenizer: Any) -> None:
        folder = Path(repository) / f"{name}_encoder"
        session, parameters = served_session(folder)
        self.session = TimedSession(session)
        self.tokenizer = tokenizer
        self.parameters = parameters
        self.encoder = GraphEncoder(
            self.session, lambda request: request, outputs=("embeddings",), pad_id=tokenizer.pad_id,
            length_bucket=int(parameters.get("length_bucket", "0")),
            token_budget=int(parameters.get("token_budget", "0")),
            max_sub_batch=int(parameters.get("max_sub_batch", "0")),
            responder=Responder(folder.name), input_prefix=name)

    def embeddings(self, sequences: Sequence[str]) -> np.ndarray:
        """[N, H] embeddings of `sequences`, in their order: one handed-over batch of every row, as
        the dynamic batcher would hand them over."""
        encoded = self.tokenizer.encode(list(sequences))
        rows = (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)
        (answer,) = self.encoder.run([rows], {"embeddings"})
        return answer["embeddings"]

    def timed(self, sequences: Sequence[str]) -> tuple[np.ndarray, Timing]:
        """`embeddings(sequences)` and what the pass cost (tokenizing included)."""
        self.session.seconds = 0.0
        began = time.perf_counter()
        embeddings = self.embeddings(sequences)
        return embeddings, Timing(time.perf_counter() - began, self.session.seconds)
