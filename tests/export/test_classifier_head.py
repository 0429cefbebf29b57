"""Fine-tuned heads (issue 17, part 4): LoadedModel.classifier from Hugging Face
*ForSequenceClassification / *ForTokenClassification directories, compared with transformers' own
classes on the same files (tiny random models with every parameter perturbed, and rxnfp's real
bert_ft_10k_25s), plus the strict key checks and the head graph's ONNX export: here the export,
the rest in tests/unit/test_classifier_head_pytorch.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export.models import get_family
from tests.unit.test_classifier_head_pytorch import (
    ATOL,
    CLASSES,
    head_of,
    make,
)


@pytest.mark.parametrize("kind", ["esm-sequence", "bert-token"])
def test_classifier_onnx_matches_pytorch(kind, tmp_path):
    from bionemo_export.exporters import export_onnx, verify_onnx
    from bionemo_export.exporters.lm_head import lm_head_check_batches

    _, folder = make(kind, tmp_path / kind, num_labels=3)
    loaded = get_family(CLASSES[kind][3]).load(folder)
    batches = lm_head_check_batches(loaded)
    exported = export_onnx(head_of(loaded), loaded.lm_head_inputs, loaded.classifier_outputs, batches[0],
                           tmp_path / "classifier.onnx")
    report = verify_onnx(head_of(loaded), exported.path, batches, atol=ATOL, min_cosine=0.9999,
                         output_names=["logits"], mask_input="attention_mask")
    report.raise_for_tolerance()
    assert np.isfinite(report.outputs[0].max_abs_error)
