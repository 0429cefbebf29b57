"""bench/in_process.py: a repository's encoder run in this process through the served code answers
what transformers' EsmModel answers, with the served model's own session (its memory arena, its
threads) and batching parameters, whatever order and lengths the sequences come in."""

from __future__ import annotations

import numpy as np
import torch

from bionemo_export.bench.in_process import InProcessEncoder, served_session
from bionemo_export.models import get_family
from bionemo_export.serving.onnx_session import ArenaPerRun

SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ", "GV", "MLLAVLYCLAVFALSSRA" * 3, "ACDEFGHIKLMNPQRSTVWY"]


def reference_embeddings(checkpoint, sequences: list[str]) -> np.ndarray:
    """transformers' EsmModel and EsmTokenizer, one protein at a time: the mean of the last hidden
    state over the residues (<cls> and <eos> left out)."""
    from transformers import EsmModel, EsmTokenizer

    model = EsmModel.from_pretrained(str(checkpoint), add_pooling_layer=False).eval()
    tokenizer = EsmTokenizer.from_pretrained(str(checkpoint))
    rows = []
    with torch.inference_mode():
        for sequence in sequences:
            hidden = model(**tokenizer([sequence], return_tensors="pt")).last_hidden_state[0]
            rows.append(hidden[1:-1].mean(0).numpy())
    return np.stack(rows)


def test_the_in_process_encoder_answers_what_pytorch_does_with_the_served_session(esm2_checkpoint, esm2_repository):
    session, parameters = served_session(esm2_repository / "esm2nv_encoder")
    assert isinstance(session, ArenaPerRun) and parameters["memory_arena"] == "run"
    tokenizer = get_family("esm2").load(esm2_checkpoint).tokenizer
    encoder = InProcessEncoder(esm2_repository, "esm2nv", tokenizer)
    assert encoder.encoder.token_budget == int(parameters["token_budget"]) > 0
    embeddings, timing = encoder.timed(SEQUENCES)
    np.testing.assert_allclose(embeddings, reference_embeddings(esm2_checkpoint, SEQUENCES), atol=1e-4)
    assert 0 < timing.graph <= timing.total
    reordered = encoder.embeddings(SEQUENCES[::-1])  # rows come back in the caller's order
    np.testing.assert_allclose(reordered, embeddings[::-1], atol=1e-5)
