"""Writing BioNeMo `.nemo` archives from small random models, for tests.

The converters apply the layouts documented in docs/reference/checkpoint-layouts.md in the forward
direction (plain model -> Megatron), written from that text and not from the importer, so a test
that imports the archive and compares with the source model checks the importer against the
documentation:
- fused attention projections are built head by head: rows [q_h; k_h; v_h] (and [k_h; v_h] for
  cross-attention) for h = 0..heads-1;
- vocabulary rows (embeddings, output weight and bias) are zero-padded to a multiple of 128;
- tokenizer files are stored as `<uuid>_<name>` members and referenced as `nemo:<uuid>_<name>`.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import torch
import yaml

UUID = "3f2a9c1e0b7d4e5fa1c2d3e4f5a6b7c8"


def fuse_per_head(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Megatron's fused projection: for each head, its rows of every part in turn."""
    head_dim = parts[0].shape[0] // heads
    blocks = []
    for h in range(heads):
        for part in parts:
            blocks.append(part[h * head_dim:(h + 1) * head_dim])
    return torch.cat(blocks, dim=0)


def pad_rows(tensor: torch.Tensor, multiple: int = 128, fill: float = 0.0) -> torch.Tensor:
    rows = -(-tensor.shape[0] // multiple) * multiple
    padding = torch.full((rows - tensor.shape[0], *tensor.shape[1:]), fill, dtype=tensor.dtype)
    return torch.cat([tensor, padding], dim=0)


def write_nemo(path: Path, config: dict, weights: dict[str, torch.Tensor], artifacts: dict[str, bytes] | None = None,
               *, gzip: bool = False, prefix: str = "./") -> Path:
    """A .nemo archive: model_config.yaml, model_weights.ckpt and `artifacts` (stored under
    their names, which should be the `<uuid>_<name>` that config references)."""
    members = {"model_config.yaml": yaml.safe_dump(config, sort_keys=False).encode()}
    buffer = io.BytesIO()
    torch.save({k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in weights.items()}, buffer)
    members["model_weights.ckpt"] = buffer.getvalue()
    members.update(artifacts or {})
    with tarfile.open(path, "w:gz" if gzip else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


# ------------------------------------------------------------------------------------ ESM-2nv
def esm2_to_megatron(hf_state: dict[str, torch.Tensor], num_layers: int, heads: int) -> dict[str, torch.Tensor]:
    """An `EsmForMaskedLM` state dict in ESM-2nv's Megatron BERT layout."""
    # transformers 5.x saves ESM LayerNorms as gamma/beta
    hf = {k.removeprefix("esm.").replace(".gamma", ".weight").replace(".beta", ".bias"): v for k, v in hf_state.items()}
    out = {"model.language_model.embedding.word_embeddings.weight": pad_rows(hf["embeddings.word_embeddings.weight"])}
    for i in range(num_layers):
        src, dst = f"encoder.layer.{i}.", f"model.language_model.encoder.layers.{i}."
        for leaf in ("weight", "bias"):
            out[dst + f"input_layernorm.{leaf}"] = hf[src + f"attention.LayerNorm.{leaf}"]
            out[dst + f"self_attention.query_key_value.{leaf}"] = fuse_per_head(
                [hf[src + f"attention.self.{p}.{leaf}"] for p in ("query", "key", "value")], heads)
            out[dst + f"self_attention.dense.{leaf}"] = hf[src + f"attention.output.dense.{leaf}"]
            out[dst + f"post_attention_layernorm.{leaf}"] = hf[src + f"LayerNorm.{leaf}"]
            out[dst + f"mlp.dense_h_to_4h.{leaf}"] = hf[src + f"intermediate.dense.{leaf}"]
            out[dst + f"mlp.dense_4h_to_h.{leaf}"] = hf[src + f"output.dense.{leaf}"]
    for leaf in ("weight", "bias"):
        out[f"model.language_model.encoder.final_layernorm.{leaf}"] = hf[f"encoder.emb_layer_norm_after.{leaf}"]
        out[f"model.lm_head.dense.{leaf}"] = hf[f"lm_head.dense.{leaf}"]
        out[f"model.lm_head.layernorm.{leaf}"] = hf[f"lm_head.layer_norm.{leaf}"]
    out["model.lm_head.bias"] = pad_rows(hf["lm_head.bias"])
    hidden = out["model.language_model.embedding.word_embeddings.weight"].shape[1]
    head_dim = hidden // heads
    exponents = torch.arange(0, head_dim, 2).float() / head_dim
    out["model.language_model.rotary_pos_emb.inv_freq"] = 1.0 / (10000 ** exponents)
    return out


def esm2nv_config(hf_config, **overrides) -> dict:
    """An ESM-2nv model_config.yaml for a transformers EsmConfig."""
    return {
        "target": "bionemo.model.protein.esm1nv.esm1nv_model.ESM2nvModel",
        "num_layers": hf_config.num_hidden_layers,
        "hidden_size": hf_config.hidden_size,
        "ffn_hidden_size": hf_config.intermediate_size,
        "num_attention_heads": hf_config.num_attention_heads,
        "seq_length": 1024,
        "max_position_embeddings": 1024,
        "position_embedding_type": "rope",
        "layernorm_epsilon": hf_config.layer_norm_eps,
        "make_vocab_size_divisible_by": 128,
        "bias_gelu_fusion": False,
        "esm_gelu": True,
        "embedding_token_dropout": True,
        "tokenizer": {"library": "huggingface", "type": "BertWordPieceLowerCase",
                      "model_name": "facebook/esm2_t33_650M_UR50D", "mask_id": 32, "model": None, "vocab_file": None},
        **overrides,
    }


# -------------------------------------------------------------------------------- MegaMolBART
def megamolbart_to_nemo(state: dict[str, torch.Tensor], config, *,
                        head: str = "weight and bias") -> dict[str, torch.Tensor]:
    """A `MegaMolBart` state dict (separate q/k/v) in NeMo's Megatron encoder-decoder layout. The
    output head as a NeMo version saved it (docs/reference/checkpoint-layouts.md): "weight and bias", "weight" (NeMo
    1.11-1.12, and >= 1.13 with share_decoder_tokens_head_embeddings false: no bias) or "bias"
    (NeMo <= 1.10: the weight tied to the token embeddings, not stored)."""
    heads = config.num_heads
    out = {
        "enc_dec_model.encoder_embedding.word_embeddings.weight": pad_rows(state["embedding.word_embeddings.weight"]),
        "enc_dec_model.encoder_embedding.position_embeddings.weight": state["embedding.position_embeddings.weight"],
    }
    for stack, layers in (("encoder", config.num_layers), ("decoder", config.num_decoder_layers)):
        for i in range(layers):
            src, dst = f"{stack}.layers.{i}.", f"enc_dec_model.enc_dec_model.{stack}.model.layers.{i}."
            for leaf in ("weight", "bias"):
                out[dst + f"self_attention.query_key_value.{leaf}"] = fuse_per_head(
                    [state[src + f"self_attention.{p}.{leaf}"] for p in ("query", "key", "value")], heads)
                names = ["input_layernorm", "self_attention.dense", "post_attention_layernorm",
                         "mlp.dense_h_to_4h", "mlp.dense_4h_to_h"]
                if stack == "decoder":
                    out[dst + f"inter_attention.key_value.{leaf}"] = fuse_per_head(
                        [state[src + f"inter_attention.{p}.{leaf}"] for p in ("key", "value")], heads)
                    names += ["inter_attention.query", "inter_attention.dense", "post_inter_attention_layernorm"]
                for name in names:
                    out[dst + f"{name}.{leaf}"] = state[src + f"{name}.{leaf}"]
        for leaf in ("weight", "bias"):
            out[f"enc_dec_model.enc_dec_model.{stack}.model.final_layernorm.{leaf}"] = \
                state[f"{stack}.final_layernorm.{leaf}"]
    if head in ("weight and bias", "weight"):
        out["enc_dec_model.tokens_head.weight"] = pad_rows(state["tokens_head.weight"])
    if head in ("weight and bias", "bias"):
        out["enc_dec_model.tokens_head.bias"] = pad_rows(state["tokens_head.bias"])
    return out


MEGAMOLBART_REGEX = (r"\[[^\]]+]|Br?|Cl?|N|O|S|P|F|I|b|c|n|o|s|p|\(|\)|\.|=|#|-|\+|\\|\/|:|~|@|\?|>|\*|\$"
                     r"|\%[0-9]{2}|[0-9]")
"""The regex of MegaMolBART's tokenizer .model file (docs/reference/tokenizers.md)."""


def megamolbart_config(config, vocab: list[str], *, nested: bool = False, **overrides) -> tuple[dict, dict[str, bytes]]:
    """(model_config.yaml, tokenizer artifacts) of a MegaMolBART archive with these sizes."""
    sizes = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.ffn_size,
        "num_attention_heads": config.num_heads,
        "layernorm_epsilon": config.layer_norm_eps,
        "bias_gelu_fusion": False,
        "activation": "gelu",
        "position_embedding_type": "learned_absolute",
        "max_position_embeddings": config.max_position_embeddings,
    }
    yaml_config = {
        "target": "bionemo.model.molecule.megamolbart.megamolbart_model.MegaMolBARTModel",
        "seq_length": config.max_position_embeddings,
        "make_vocab_size_divisible_by": 128,
        "share_token_embeddings": True,
        "share_decoder_tokens_head_embeddings": False,
        "tokenizer": {"library": "regex", "type": None,
                      "model": f"nemo:{UUID}_megamolbart.model", "vocab_file": f"nemo:{UUID}_megamolbart.vocab"},
    }
    if nested:  # per-stack sections read bias_activation_fusion (bias_gelu_fusion is the flat configs' alias)
        sizes["bias_activation_fusion"] = sizes.pop("bias_gelu_fusion")
        decoder = dict(sizes, num_layers=config.num_decoder_layers)
        yaml_config.update(encoder=dict(sizes), decoder=decoder, max_position_embeddings=config.max_position_embeddings)
    else:
        yaml_config.update(sizes)
    yaml_config.update(overrides)
    artifacts = {f"{UUID}_megamolbart.model": MEGAMOLBART_REGEX.encode(),
                 f"{UUID}_megamolbart.vocab": ("\n".join(vocab) + "\n").encode()}
    return yaml_config, artifacts


# ------------------------------------------------------------- what NeMo and Megatron vary
def legacy_qkv(weights: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    """`megatron_legacy: true`: fused `query_key_value` rows stored [all q; all k; all v] and
    `key_value` rows [all k; all v], instead of per head (NeMo v1.23 attention.py). Applied to a
    single rank's weights (`heads` = that rank's heads)."""
    out = {}
    for key, tensor in weights.items():
        module = key.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        parts = {"query_key_value": 3, "key_value": 2}.get(module)
        if parts is None:
            out[key] = tensor
            continue
        head_dim = tensor.shape[0] // (parts * heads)
        per_head = tensor.reshape(heads, parts, head_dim, *tensor.shape[1:])  # the standard layout
        out[key] = per_head.transpose(0, 1).reshape(tensor.shape).contiguous()
    return out


def amp_o2_keys(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`megatron_amp_O2: true`: `.module.` after the top prefix of every key, half-precision values."""
    out = {}
    for key, tensor in weights.items():
        top, rest = key.split(".", 1)
        out[f"{top}.module.{rest}"] = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
    return out


COLUMN_PARALLEL = ("query_key_value", "key_value", "query", "dense_h_to_4h", "word_embeddings", "tokens_head")
ROW_PARALLEL = ("self_attention.dense.weight", "inter_attention.dense.weight", "mlp.dense_4h_to_h.weight")


def tensor_parallel_shards(weights: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Megatron-LM's tensor parallelism (tensor_parallel/layers.py, as docs/reference/checkpoint-layouts.md states it):
    column-parallel layers (fused QKV, cross-attention query/key_value, dense_h_to_4h) and
    vocabulary-parallel tensors (word embeddings, LM-head bias, tokens head) split by rows - each
    rank gets a contiguous block of rows, so whole heads in per-head order; row-parallel weights
    (attention output dense, dense_4h_to_h) split by columns, their bias copied; the rest copied."""
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for key, tensor in weights.items():
        module = key.rsplit(".", 1)[0]
        if key.endswith(ROW_PARALLEL):
            pieces = tensor.chunk(size, dim=1)
        elif module.rsplit(".", 1)[-1] in COLUMN_PARALLEL or key.endswith("lm_head.bias"):
            assert tensor.shape[0] % size == 0, key
            pieces = tensor.chunk(size, dim=0)
        else:
            pieces = [tensor] * size
        for rank, piece in enumerate(pieces):
            shards[rank][key] = piece.clone()
    return shards


def pipeline_stages(weights: dict[str, torch.Tensor], layers_per_stage: list[int],
                    stack: str = "language_model.encoder.layers.") -> list[dict[str, torch.Tensor]]:
    """A Megatron BERT split into pipeline stages (docs/reference/checkpoint-layouts.md): each stage holds its layers
    numbered from 0; the first the embeddings, the last the final layer norm, the LM head and a
    copy of the word embeddings as `model.word_embeddings.weight`; rotary tables on every stage."""
    stages: list[dict[str, torch.Tensor]] = [{} for _ in layers_per_stage]
    first_layer = [sum(layers_per_stage[:i]) for i in range(len(layers_per_stage))]
    last = len(stages) - 1
    for key, tensor in weights.items():
        if stack in key:
            head, rest = key.split(stack)
            index, leaf = rest.split(".", 1)
            stage = max(i for i, start in enumerate(first_layer) if int(index) >= start)
            stages[stage][f"{head}{stack}{int(index) - first_layer[stage]}.{leaf}"] = tensor
        elif "rotary_pos_emb" in key:
            for stage in stages:
                stage[key] = tensor
        elif ".embedding." in key:
            stages[0][key] = tensor
        else:
            stages[last][key] = tensor
    stages[last]["model.word_embeddings.weight"] = weights["model.language_model.embedding.word_embeddings.weight"]
    return stages


def write_nemo_ranks(path: Path, config: dict, ranks: dict[str, dict[str, torch.Tensor]],
                     artifacts: dict[str, bytes] | None = None) -> Path:
    """A model-parallel .nemo: model_config.yaml and `<rank folder>/model_weights.ckpt` per rank
    (mp_rank_XX, or tp_rank_XX_pp_rank_XXX), as NeMo's save_to writes them, members under `./`."""
    members = {"model_config.yaml": yaml.safe_dump(config, sort_keys=False).encode(), **(artifacts or {})}
    for folder, weights in ranks.items():
        buffer = io.BytesIO()
        torch.save({k: v.contiguous() for k, v in weights.items()}, buffer)
        members[f"{folder}/model_weights.ckpt"] = buffer.getvalue()
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path
