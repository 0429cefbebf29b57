"""The esmc family (models/esmc.py) against transformers' own ESM C: random EsmcForMaskedLM
checkpoints of two sizes read by the family compute what transformers computes (last hidden states,
masked-LM log-probabilities), tokenize as transformers' EsmcTokenizer does, and foreign or broken
directories are refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import get_family
from bionemo_export.models.lm_head import MaskedLMHead
from bionemo_export.models.readers import CheckpointError
from bionemo_export.testing.checkpoints import save_random_checkpoint

SEQUENCES = ["MKTAYIAKQR", "MSLKRKNIALIPAAGIGVRFG", "LAGVSERTIDPKQNFYMHWCXBUZO", "MKT_YIAK"]


@pytest.mark.parametrize("sizes", [{}, {"hidden_size": 128, "num_layers": 3, "num_heads": 2,
                                        "intermediate_size": 256}], ids=["tiny", "64-wide heads"])
def test_an_esmc_checkpoint_computes_what_transformers_computes(tmp_path, sizes):
    folder = save_random_checkpoint("esmc", tmp_path / "esmc", seed=4, **sizes)
    loaded = get_family("esmc").load(folder)
    reference = transformers.EsmcForMaskedLM.from_pretrained(folder).eval()
    tokenizer = transformers.EsmcTokenizer.from_pretrained(folder)
    texts = [s.replace("_", "<mask>") for s in SEQUENCES]
    expected_ids = tokenizer(texts, padding=True, return_tensors="pt")
    encoded = loaded.tokenizer.encode(SEQUENCES)
    assert np.array_equal(encoded.input_ids, expected_ids["input_ids"].numpy())
    head = loaded.lm_head
    assert isinstance(head, MaskedLMHead)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(torch.tensor(encoded.input_ids), torch.tensor(encoded.attention_mask),
                                             torch.tensor(encoded.residue_mask))
        log_probs = head(hiddens)
        expected = reference(**expected_ids, output_hidden_states=True)
    real = expected_ids["attention_mask"].bool()
    last = expected.hidden_states[-1] if expected.hidden_states is not None else None
    assert last is not None
    assert (hiddens - last).abs()[real].max().item() < 1e-5
    wanted = torch.log_softmax(expected.logits[..., list(head.alphabet_ids)], dim=-1)
    assert (log_probs - wanted).abs()[real].max().item() < 1e-5
    residues = torch.tensor(encoded.residue_mask).unsqueeze(-1)
    np.testing.assert_allclose(embeddings, (last * residues).sum(1) / residues.sum(1), atol=1e-5)


def test_a_foreign_or_broken_directory_is_refused_with_the_reason(tmp_path):
    esm2 = save_random_checkpoint("esm2", tmp_path / "esm2")
    with pytest.raises(CheckpointError, match="has model_type 'esm', expected 'esmc'"):
        get_family("esmc").load(esm2)
    folder = save_random_checkpoint("esmc", tmp_path / "esmc")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["|"], tokenizer["model"]["vocab"]["<mask>"] = 32, 31
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match=r"not ESM C's vocabulary \('\|' is 32"):
        get_family("esmc").load(folder)
