"""Export a model's masked-LM head (LoadedModel.lm_head) as its own ONNX graph, `lm_head.onnx`,
checked against PyTorch like the encoder graph:

    inputs : hiddens   FP32 [batch, length, hidden]   (the encoder graph's `hiddens` output)
    outputs: log_probs FP32 [batch, length, A]        (log_softmax over LoadedModel.alphabet)

Served log-probabilities are then encoder graph -> head graph. The export goes through the same
`export_onnx` (torch.onnx, or Model Navigator) and `verify_onnx` as the encoder; the check batches
are the encoder's hidden states of the family's sample sequences (one of them with a masked
position), padded positions left out of the comparison.

    exported = export_lm_head(loaded, out_dir)          # writes out_dir/lm_head.onnx, verified
    exported.result.path, exported.report.to_dict()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bionemo_export.choices import Exporter
from bionemo_export.errors import UserError
from bionemo_export.exporters.onnx_export import DEFAULT_OPSET, ExportResult, export_onnx
from bionemo_export.exporters.verification import VerificationReport, verify_onnx
from bionemo_export.models.base import LoadedModel

LM_HEAD_FILE = "lm_head.onnx"


class NoLMHeadError(UserError, ValueError):
    """The checkpoint has no masked-LM head to export."""


@dataclass(frozen=True)
class LMHeadExport:
    """What export_lm_head wrote and how it compared with PyTorch."""

    result: ExportResult
    report: VerificationReport
    alphabet: tuple[str, ...]
    """The order of log_probs' last axis."""


def lm_head_check_batches(loaded: LoadedModel, sequences: Sequence[Sequence[str]] | None = None
                          ) -> list[dict[str, np.ndarray]]:
    """Batches for exporting and checking the head graph: {"hiddens" FP32 [B, L, H] from the
    PyTorch encoder, "attention_mask" INT64 [B, L] (verify_onnx skips its zeros)}. Default
    sequences: the family's samples all together (with one of them masked at its first position
    when the tokenizer has a mask character), the shortest alone and the longest alone."""
    if sequences is None:
        samples = list(loaded.family.sample_sequences())
        mask_char = getattr(loaded.tokenizer, "mask_char", None)
        if mask_char is not None:
            samples.append(mask_char + samples[0])
        by_length = sorted(samples, key=len)
        sequences = [samples, [by_length[0]], [by_length[-1]]]
    batches = []
    for batch in sequences:
        encoded = loaded.tokenizer.encode(list(batch), truncate=True)  # within a lowered --max-length too
        with torch.inference_mode():
            hiddens, _ = loaded.encoder(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask),
                                        torch.from_numpy(encoded.residue_mask))
        batches.append({"hiddens": np.ascontiguousarray(hiddens.float().numpy()),
                        "attention_mask": encoded.attention_mask})
    return batches


def export_lm_head(
    loaded: LoadedModel,
    out_dir: Path,
    *,
    exporter: Exporter | str = Exporter.TORCH,
    opset: int = DEFAULT_OPSET,
    batches: Sequence[dict[str, np.ndarray]] | None = None,
    workspace: Path | None = None,
) -> LMHeadExport:
    """Write `loaded.lm_head` to `out_dir/lm_head.onnx` (dynamic batch and length) and check it
    against PyTorch on `batches` (default: lm_head_check_batches(loaded)) within the family's
    atol/min_cosine. Raises NoLMHeadError when the checkpoint has no head, ExportError when the
    export fails and ExportVerificationError when the graph is over tolerance."""
    if loaded.lm_head is None:
        raise NoLMHeadError(f"{loaded.checkpoint} has no masked-LM head (it is not a *ForMaskedLM checkpoint): "
                            "log-probabilities cannot be served from it")
    batches = list(batches) if batches is not None else lm_head_check_batches(loaded)
    family = loaded.family
    result = export_onnx(loaded.lm_head, loaded.lm_head_inputs, loaded.lm_head_outputs, batches[0],
                         Path(out_dir) / LM_HEAD_FILE, exporter=exporter, opset=opset, workspace=workspace)
    report = verify_onnx(loaded.lm_head, result.path, batches, atol=family.atol, min_cosine=family.min_cosine,
                         output_names=["log_probs"], mask_input="attention_mask")
    report.raise_for_tolerance()
    return LMHeadExport(result, report, loaded.alphabet)
