"""The esmc family (models/esmc.py) against transformers' own ESM C: random EsmcForMaskedLM
checkpoints of two sizes read by the family compute what transformers computes (last hidden states,
masked-LM log-probabilities), tokenize as transformers' EsmcTokenizer does, and foreign or broken
directories are refused with the reason."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import get_family
from bionemo_export.models.base import load_checkpoint
from bionemo_export.models.readers import CheckpointError
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.loaded_outputs import masked_lm_outputs

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
    got = masked_lm_outputs(loaded, SEQUENCES)
    assert np.array_equal(got.encoded.input_ids, expected_ids["input_ids"].numpy())
    with torch.no_grad():
        expected = reference(**expected_ids, output_hidden_states=True)
    real = expected_ids["attention_mask"].bool()
    last = expected.hidden_states[-1] if expected.hidden_states is not None else None
    assert last is not None
    assert (got.hiddens - last).abs()[real].max().item() < 1e-5
    wanted = torch.log_softmax(expected.logits[..., got.alphabet_ids], dim=-1)
    assert (got.log_probs - wanted).abs()[real].max().item() < 1e-5
    residues = torch.tensor(got.encoded.residue_mask).unsqueeze(-1)
    np.testing.assert_allclose(got.embeddings, (last * residues).sum(1) / residues.sum(1), atol=1e-5)


def _esm_package_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's weights as the EvolutionaryScale esm package's ESMC module names them (written
    from that package's modules: TransformerStack.blocks[i].attn.layernorm_qkv = Sequential(LayerNorm,
    Linear(d, 3d)) whose output is chunked q, k, v; q_ln, k_ln; out_proj; ffn = Sequential(LayerNorm,
    Linear(d, 2f), SwiGLU: silu(first half) * second half, Linear(f, d)); transformer.norm;
    sequence_head = Sequential(Linear, GELU, LayerNorm, Linear))."""
    state = {"embed.weight": model.esmc.embed_tokens.weight, "transformer.norm.weight": model.esmc.norm.weight}
    for i, layer in enumerate(model.esmc.layers):
        block = f"transformer.blocks.{i}."
        attention, mlp = layer.self_attn, layer.mlp
        state |= {block + "attn.layernorm_qkv.0.weight": layer.input_layernorm.weight,
                  block + "attn.layernorm_qkv.0.bias": layer.input_layernorm.bias,
                  block + "attn.layernorm_qkv.1.weight": torch.cat(
                      [attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight]),
                  block + "attn.q_ln.weight": attention.q_norm.weight,
                  block + "attn.k_ln.weight": attention.k_norm.weight,
                  block + "attn.out_proj.weight": attention.o_proj.weight,
                  block + "ffn.0.weight": layer.post_attention_layernorm.weight,
                  block + "ffn.0.bias": layer.post_attention_layernorm.bias,
                  block + "ffn.1.weight": torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                  block + "ffn.3.weight": mlp.down_proj.weight}
    head = model.lm_head
    for index, module in ((0, head.dense), (2, head.layer_norm), (3, head.decoder)):
        state |= {f"sequence_head.{index}.weight": module.weight, f"sequence_head.{index}.bias": module.bias}
    return {key: value.detach().clone() for key, value in state.items()}


def test_the_esm_packages_weight_file_computes_what_transformers_computes(tmp_path):
    """An esmc_300m_2024_12_v0.pth-style state dict (64-wide heads, as ESM C's): sizes read from the
    tensors, the family inferred from the form, the same hiddens and log-probs as transformers."""
    folder = save_random_checkpoint("esmc", tmp_path / "hf", seed=6, hidden_size=128, num_heads=2, num_layers=2,
                                    intermediate_size=384)
    reference = transformers.EsmcForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        for parameter in reference.parameters():  # LayerNorms and biases off their initial values
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.1)
    torch.save(_esm_package_state(reference), tmp_path / "esmc_tiny_v0.pth")
    loaded = load_checkpoint(tmp_path / "esmc_tiny_v0.pth")
    assert loaded.family.name == "esmc" and loaded.description["heads"] == 2
    assert loaded.description["checkpoint_form"] == "esm package ESM C weights esmc_tiny_v0.pth"
    got = masked_lm_outputs(loaded, SEQUENCES)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(got.encoded.input_ids),
                             attention_mask=torch.tensor(got.encoded.attention_mask), output_hidden_states=True)
    assert expected.hidden_states is not None
    assert (got.hiddens - expected.hidden_states[-1]).abs()[got.real].max().item() < 1e-5
    wanted = torch.log_softmax(expected.logits[..., got.alphabet_ids], dim=-1)
    assert (got.log_probs - wanted).abs()[got.real].max().item() < 1e-5

    state = _esm_package_state(reference)
    state["transformer.blocks.0.attn.extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "extra.pth")
    with pytest.raises(CheckpointError, match="unexpected key transformer.blocks.0.attn.extra.weight"):
        load_checkpoint(tmp_path / "extra.pth")
    torch.save({"embed.weight": torch.zeros(64, 8)}, tmp_path / "partial.pth")
    with pytest.raises(CheckpointError, match="not an ESM C weight file of the esm package: no "
                                              "transformer.blocks.0.attn.layernorm_qkv.1.weight"):
        load_checkpoint(tmp_path / "partial.pth")


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
