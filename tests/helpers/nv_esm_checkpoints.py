"""NVIDIA's TransformerEngine ESM-2 directories (`nv_esm`, bionemo-recipes) written from a random
transformers `EsmForMaskedLM`, in the forward direction of NVIDIA's convert.py as
docs/reference/checkpoint-layouts.md describes it and NVIDIA's source shows it: TransformerEngine
names, the word embeddings padded with zero rows, the LM-head bias padded with the dtype's minimum,
QKV fused per head, the config.json fields NVIDIA's export writes. Written from that description,
independently of the package's reader, so that the tests compare two separate readings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file
from transformers.models.esm.modeling_esm import EsmLayer

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
AUTO_MAP = {"AutoConfig": "esm_nv.NVEsmConfig", "AutoModel": "esm_nv.NVEsmModel",
            "AutoModelForMaskedLM": "esm_nv.NVEsmForMaskedLM",
            "AutoModelForTokenClassification": "esm_nv.NVEsmForTokenClassification"}
NEVER_RUN = 'raise RuntimeError("esm_nv.py was executed: bionemo-export must never run a checkpoint\'s code")\n'
"""The stand-in for the modeling code NVIDIA's exports ship: it fails if anything imports it."""


def pack_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int, layout: str) -> torch.Tensor:
    """TransformerEngine's fused QKV weight or bias: per head [q_h; k_h; v_h] ("interleaved",
    qkv_weight_interleaved true) or [all q; all k; all v] ("concatenated")."""
    if layout == "concatenated":
        return torch.cat([query, key, value])
    by_head = [t.reshape(heads, t.shape[0] // heads, *t.shape[1:]) for t in (query, key, value)]
    return torch.stack(by_head, dim=1).reshape(3 * query.shape[0], *query.shape[1:])


def padded(rows: torch.Tensor, size: int, fill: float) -> torch.Tensor:
    """`rows` followed by `size - len(rows)` rows of `fill`."""
    pad = torch.full((size - rows.shape[0], *rows.shape[1:]), fill, dtype=rows.dtype)
    return torch.cat([rows, pad])


def nv_esm_state_dict(model: transformers.EsmForMaskedLM, *, prefix: str = "model.", padded_vocab_size: int = 64,
                      layout: str = "interleaved", head: bool = True, decoder_weight: bool = False,
                      inv_freq: bool = False, extra_state: bool = False) -> dict[str, torch.Tensor]:
    """The state dict NVEsmForMaskedLM (or, without `head`, NVEsmModel) holds for `model`."""
    esm, config = model.esm, model.config
    hidden, heads = config.hidden_size, config.num_attention_heads
    embeddings = padded(esm.embeddings.word_embeddings.weight, padded_vocab_size, 0.0)  # zero rows
    out = {f"{prefix}embeddings.word_embeddings.weight": embeddings}
    if config.emb_layer_norm_before:
        layer_norm = esm.embeddings.layer_norm
        assert layer_norm is not None  # EsmEmbeddings has one exactly when emb_layer_norm_before is set
        out[f"{prefix}embeddings.layer_norm.weight"] = layer_norm.weight
        out[f"{prefix}embeddings.layer_norm.bias"] = layer_norm.bias
    for i, layer in enumerate(esm.encoder.layer):
        assert isinstance(layer, EsmLayer)
        te = f"{prefix}encoder.layers.{i}."
        attention, parts = layer.attention.self, ("query", "key", "value")
        for leaf in ("weight", "bias"):
            q, k, v = (getattr(getattr(attention, part), leaf) for part in parts)
            if layout == "separate":
                out |= {f"{te}self_attention.layernorm_qkv.{part}_{leaf}": t for part, t in zip(parts, (q, k, v))}
            else:
                out[f"{te}self_attention.layernorm_qkv.{leaf}"] = pack_qkv(q, k, v, heads, layout)
            out[f"{te}self_attention.layernorm_qkv.layer_norm_{leaf}"] = getattr(layer.attention.LayerNorm, leaf)
            out[f"{te}self_attention.proj.{leaf}"] = getattr(layer.attention.output.dense, leaf)
            out[f"{te}layernorm_mlp.layer_norm_{leaf}"] = getattr(layer.LayerNorm, leaf)
            out[f"{te}layernorm_mlp.fc1_{leaf}"] = getattr(layer.intermediate.dense, leaf)
            out[f"{te}layernorm_mlp.fc2_{leaf}"] = getattr(layer.output.dense, leaf)
        if extra_state:  # older exports kept TransformerEngine's FP8 metadata
            out[f"{te}self_attention.layernorm_qkv._extra_state"] = torch.zeros(0, dtype=torch.uint8)
            out[f"{te}layernorm_mlp._extra_state"] = torch.zeros(0, dtype=torch.uint8)
    out[f"{prefix}encoder.emb_layer_norm_after.weight"] = esm.encoder.emb_layer_norm_after.weight
    out[f"{prefix}encoder.emb_layer_norm_after.bias"] = esm.encoder.emb_layer_norm_after.bias
    if inv_freq:  # exports before 2026-03-20 kept the rotary buffer
        head_dim = hidden // heads
        exponents = torch.arange(0, head_dim, 2).float() / head_dim
        out[f"{prefix}encoder.rotary_embeddings.inv_freq"] = 1.0 / 10000 ** exponents
    if head:
        lm_head = model.lm_head
        out["lm_head.dense.weight"] = lm_head.dense.weight
        out["lm_head.dense.bias"] = lm_head.dense.bias
        out["lm_head.decoder.layer_norm_weight"] = lm_head.layer_norm.weight
        out["lm_head.decoder.layer_norm_bias"] = lm_head.layer_norm.bias
        out["lm_head.decoder.bias"] = padded(lm_head.bias, padded_vocab_size, torch.finfo(lm_head.bias.dtype).min)
        if decoder_weight:  # tied, so save_pretrained usually leaves it out
            out["lm_head.decoder.weight"] = padded(lm_head.decoder.weight, padded_vocab_size, 0.0)
    return {key: tensor.detach().clone().contiguous() for key, tensor in out.items()}


def nv_esm_config(model: transformers.EsmForMaskedLM, *, padded_vocab_size: int | None = 64,
                  layout: str = "interleaved", architecture: str = "NVEsmForMaskedLM") -> dict[str, Any]:
    """config.json as NVIDIA's export writes it: NVEsmConfig(**EsmConfig.to_dict(), ...) plus auto_map."""
    config = {key: value for key, value in model.config.to_dict().items() if key not in ("_name_or_path",)}
    config.update(model_type="nv_esm", architectures=[architecture], auto_map=AUTO_MAP, attn_input_format="bshd",
                  attn_mask_type="padding", encoder_activation="gelu", fuse_qkv_params=layout != "separate",
                  qkv_weight_interleaved=layout != "concatenated", micro_batch_size=None, max_seq_length=None,
                  dtype="float32", transformers_version="4.57.1")
    if padded_vocab_size is not None:
        config["padded_vocab_size"] = padded_vocab_size
    return config


def tokenizer_files(out: Path, *, vocab_txt: bool = True) -> None:
    """The ESM-2 WordLevel tokenizer files NVIDIA's exports carry (and, optionally, vocab.txt)."""
    vocab = {token: i for i, token in enumerate(ESM_VOCAB)}
    special = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]
    tokenizer = {"version": "1.0", "added_tokens": [{"id": vocab[t], "content": t, "special": True} for t in special],
                 "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, indent=2))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "cls_token": "<cls>", "mask_token": "<mask>"}))
    (out / "special_tokens_map.json").write_text(json.dumps({"cls_token": "<cls>", "eos_token": "<eos>"}))
    if vocab_txt:
        (out / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")


def write_nv_esm(model: transformers.EsmForMaskedLM, out: Path, *, prefix: str = "model.",
                 padded_vocab_size: int | None = 64, layout: str = "interleaved", head: bool = True,
                 decoder_weight: bool = False, inv_freq: bool | None = None, extra_state: bool | None = None,
                 classifier: tuple[torch.Tensor, torch.Tensor] | None = None, vocab_txt: bool = True) -> Path:
    """An nv_esm directory for `model`: config.json, model.safetensors, tokenizer files, esm_nv.py
    (never to be run). The "esm." prefix writes what 2025 exports held (rotary inv_freq,
    `_extra_state` entries) unless told otherwise. `classifier` = (weight, bias) of an
    NVEsmForTokenClassification head (then no LM head)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    old = prefix == "esm."
    vocab_size = padded_vocab_size or model.config.vocab_size
    assert vocab_size is not None  # an EsmForMaskedLM is built with a vocab_size
    weights = nv_esm_state_dict(model, prefix=prefix, padded_vocab_size=vocab_size,
                                layout=layout, head=head and classifier is None, decoder_weight=decoder_weight,
                                inv_freq=old if inv_freq is None else inv_freq,
                                extra_state=old if extra_state is None else extra_state)
    architecture = "NVEsmForMaskedLM" if head else "NVEsmModel"
    if classifier is not None:
        weights["classifier.weight"], weights["classifier.bias"] = (t.detach().clone() for t in classifier)
        architecture = "NVEsmForTokenClassification"
    save_file(weights, out / "model.safetensors")
    config = nv_esm_config(model, padded_vocab_size=padded_vocab_size, layout=layout, architecture=architecture)
    if classifier is not None:
        config["id2label"] = {str(i): f"class_{i}" for i in range(classifier[0].shape[0])}
        config["label2id"] = {f"class_{i}": i for i in range(classifier[0].shape[0])}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tokenizer_files(out, vocab_txt=vocab_txt)
    (out / "esm_nv.py").write_text(NEVER_RUN)
    return out


def edit_config(directory: Path, **changes: Any) -> Path:
    """Change config.json's keys (a value of None removes the key)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))
    return directory
