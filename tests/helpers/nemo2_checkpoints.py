"""Writing BioNeMo 2 / NeMo 2 ESM-2 checkpoint directories from small random transformers models,
for tests.

The converter applies the layout documented in docs/reference/checkpoint-layouts.md ("BioNeMo 2 / NeMo
2 checkpoints") and in bionemo-esm2's `model/convert.py` (v2.x) in the forward direction
(EsmForMaskedLM -> Megatron-core), written from that text and not from the reader, so a test that
loads the directory and compares with the source model checks the reader against the documentation:
- keys prefixed `module.`; each per-layer parameter STACKED into one tensor with a leading axis of
  num_layers, and saved as one chunk per layer (as Megatron's homogeneous-layer sharding does);
- the fused QKV built like convert.py's import transform: [q; k; v] viewed as (3, heads, head_dim,
  ...) and transposed to (heads, 3, ...), i.e. rows [q_h; k_h; v_h] for each head in turn;
- the pre-attention and pre-MLP LayerNorms stored inside `linear_qkv` and `linear_fc1`;
- the word embeddings and `output_layer.bias` zero-padded to 128 rows; no output weight (tied);
- TransformerEngine `_extra_state` entries as bytes (`<key>._extra_state/shard_<offset>_<shape>`),
  optimizer state under `optimizer.state.*`, trainer state in `common.pt`, the backend named in
  `metadata.json`;
- context/model.yaml: NeMo's dump of the Lightning module's arguments with defaults, the model's
  ESM2Config fields (bionemo-esm2 v2.7's names and defaults) under `config:`.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
import yaml

SPEC = "esm2_bert_layer_with_transformer_engine_spec"


def random_esm2(seed: int = 0, *, hidden: int = 32, layers: int = 2, heads: int = 4, ffn: int = 64
                ) -> transformers.EsmForMaskedLM:
    """A random EsmForMaskedLM with ESM-2's settings; every parameter perturbed (LayerNorms and
    biases too, which initialise to ones and zeros), so that a misplaced one shows."""
    torch.manual_seed(seed)
    config = transformers.EsmConfig(vocab_size=33, pad_token_id=1, mask_token_id=32, hidden_size=hidden,
                                    num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=ffn,
                                    position_embedding_type="rotary", max_position_embeddings=1026,
                                    token_dropout=True, emb_layer_norm_before=False, layer_norm_eps=1e-5,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.EsmForMaskedLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def _pad_rows(tensor: torch.Tensor, rows: int = 128) -> torch.Tensor:
    padding = torch.zeros(rows - tensor.shape[0], *tensor.shape[1:], dtype=tensor.dtype)
    return torch.cat([tensor, padding])


def _interleave_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int) -> torch.Tensor:
    """[q; k; v] -> per head [q_h; k_h; v_h] (bionemo-esm2 convert.py's import direction)."""
    stacked = torch.cat([query, key, value])
    return stacked.view(3, heads, -1, *query.shape[1:]).transpose(0, 1).reshape(stacked.shape)


def esm2_to_megatron_core(model: transformers.EsmForMaskedLM) -> dict[str, torch.Tensor]:
    """`model`'s weights under Megatron-core's names, per-layer tensors stacked (leading axis = layer)."""
    config = model.config
    hf = {key.removeprefix("esm.").replace(".gamma", ".weight").replace(".beta", ".bias"): value.detach().clone()
          for key, value in model.state_dict().items()}
    per_layer: dict[str, list[torch.Tensor]] = {}
    for i in range(config.num_hidden_layers):
        src = f"encoder.layer.{i}."
        for leaf in ("weight", "bias"):
            query, key, value = (hf[f"{src}attention.self.{p}.{leaf}"] for p in ("query", "key", "value"))
            layer = {
                f"self_attention.linear_qkv.{leaf}": _interleave_qkv(query, key, value, config.num_attention_heads),
                f"self_attention.linear_qkv.layer_norm_{leaf}": hf[f"{src}attention.LayerNorm.{leaf}"],
                f"self_attention.linear_proj.{leaf}": hf[f"{src}attention.output.dense.{leaf}"],
                f"mlp.linear_fc1.layer_norm_{leaf}": hf[f"{src}LayerNorm.{leaf}"],
                f"mlp.linear_fc1.{leaf}": hf[f"{src}intermediate.dense.{leaf}"],
                f"mlp.linear_fc2.{leaf}": hf[f"{src}output.dense.{leaf}"],
            }
            for name, tensor in layer.items():
                per_layer.setdefault(name, []).append(tensor)
    out = {f"module.encoder.layers.{name}": torch.stack(tensors) for name, tensors in per_layer.items()}
    out["module.embedding.word_embeddings.weight"] = _pad_rows(hf["embeddings.word_embeddings.weight"])
    for leaf in ("weight", "bias"):
        out[f"module.encoder.final_layernorm.{leaf}"] = hf[f"encoder.emb_layer_norm_after.{leaf}"]
        out[f"module.lm_head.dense.{leaf}"] = hf[f"lm_head.dense.{leaf}"]
        out[f"module.lm_head.layer_norm.{leaf}"] = hf[f"lm_head.layer_norm.{leaf}"]
    out["module.output_layer.bias"] = _pad_rows(hf["lm_head.bias"])
    return out


def esm2_model_yaml(config: transformers.EsmConfig, **overrides: Any) -> dict[str, Any]:
    """context/model.yaml for an ESM-2 of `config`'s sizes, as NeMo writes a BionemoLightningModule:
    ESM2Config's fields with their defaults under `config:`, callables as `_target_` mappings.
    `overrides` replace or add `config:` fields (None values are written as null)."""
    model_config: dict[str, Any] = {
        "_target_": "bionemo.esm2.model.model.ESM2Config",
        "activation_func": {"_call_": False, "_target_": "torch._C._nn.gelu"},
        "add_bias_linear": True,
        "apply_query_key_layer_scaling": False,
        "apply_residual_connection_post_layernorm": False,
        "attention_dropout": 0.0,
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "biobert_spec_option": {"_args_": [SPEC], "_call_": True,
                                "_target_": "bionemo.llm.model.biobert.transformer_specs.BiobertSpecOption"},
        "ffn_hidden_size": config.intermediate_size,
        "gated_linear_unit": False,
        "hidden_dropout": 0,
        "hidden_size": config.hidden_size,
        "init_method_std": 0.02,
        "kv_channels": None,
        "layernorm_epsilon": config.layer_norm_eps,
        "layernorm_zero_centered_gamma": False,
        "make_vocab_size_divisible_by": 128,
        "normalization": "LayerNorm",
        "num_attention_heads": config.num_attention_heads,
        "num_layers": config.num_hidden_layers,
        "num_query_groups": None,
        "params_dtype": {"_call_": False, "_target_": "torch.float32"},
        "position_embedding_type": "rope",
        "qk_layernorm": False,
        "rotary_base": 10000,
        "rotary_interleaved": False,
        "rotary_percent": 1.0,
        "seq_len_interpolation_factor": None,
        "seq_length": 1024,
        "share_embeddings_and_output_weights": True,
        "softmax_scale": 1.0,
        "token_dropout": True,
        "use_attention_mask": True,
        "use_esm_attention": False,
    }
    model_config.update(overrides)
    return {
        "_target_": "bionemo.llm.lightning.BionemoLightningModule",
        "config": model_config,
        "data_step": {"_call_": False, "_target_": "bionemo.llm.model.biobert.lightning.bert_data_step"},
        "forward_step": {"_call_": False, "_target_": "bionemo.llm.model.biobert.lightning.bert_forward_step"},
        "model_transform": None,
        "tokenizer": {"_target_": "bionemo.esm2.data.tokenizer.BioNeMoESMTokenizer"},
    }


def _chunked_per_layer(weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Stacked tensors as torch ShardedTensors of one chunk per layer (what Megatron saves), the
    others as they are. Building a ShardedTensor needs a process group: a one-process gloo group
    is made for it and destroyed again (none is left behind)."""
    import torch.distributed as dist
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor.api import ShardedTensor
    from torch.distributed._shard.sharded_tensor.shard import Shard

    if dist.is_initialized():  # someone else's group: leave it alone and save plain tensors
        return dict(weights)
    # HashStore is public (torch.distributed.HashStore) but imported there from torch._C without a
    # re-export marker, which pyright reads as private.
    store = dist.HashStore()  # pyright: ignore[reportPrivateImportUsage]
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        out: dict[str, Any] = {}
        for key, tensor in weights.items():
            if not key.startswith("module.encoder.layers."):
                out[key] = tensor
                continue
            rest = [0] * (tensor.dim() - 1)
            shards = [Shard(tensor[i:i + 1].clone(), ShardMetadata([i, *rest], [1, *tensor.shape[1:]], "rank:0/cpu"))
                      for i in range(tensor.shape[0])]
            out[key] = ShardedTensor._init_from_local_shards(shards, tuple(tensor.shape))
        return out
    finally:
        dist.destroy_process_group()


def extra_state(module: str, layer: int, layers: int) -> tuple[str, io.BytesIO]:
    """A TransformerEngine `_extra_state` entry as Megatron stores it: a ShardedObject (bytes) per
    layer, keyed `<module>._extra_state/shard_<offsets>_<shape>` over (layer, tensor-parallel rank)."""
    buffer = io.BytesIO()
    torch.save({"scale_fwd": torch.ones(3)}, buffer)
    buffer.seek(0)
    return f"{module}._extra_state/shard_{layer}.0_{layers}.1", buffer


def write_nemo2(path: Path, model_yaml: dict[str, Any], weights: dict[str, torch.Tensor], *,
                optimizer: bool = True, te_extra_state: bool = True, chunk_layers: bool = True,
                common: Any = None) -> Path:
    """A NeMo 2 checkpoint directory at `path`: context/ (model.yaml, io.json) and weights/ (a torch
    distributed checkpoint in two .distcp files, common.pt, metadata.json)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    context, weights_dir = path / "context", path / "weights"
    context.mkdir(parents=True)
    (context / "model.yaml").write_text(yaml.safe_dump(model_yaml))
    (context / "io.json").write_text("{not read: a fiddle graph that only NeMo may execute")
    state: dict[str, Any] = _chunked_per_layer(weights) if chunk_layers else dict(weights)
    layers = model_yaml["config"]["num_layers"]
    if te_extra_state:
        for module in ("self_attention.linear_qkv", "self_attention.core_attention", "mlp.linear_fc1"):
            for layer in range(layers):
                key, value = extra_state(f"module.encoder.layers.{module}", layer, layers)
                state[key] = value
    if optimizer:
        for key, tensor in list(weights.items())[:3]:
            state[f"optimizer.state.exp_avg.{key}"] = torch.zeros_like(tensor)
            state[f"optimizer.state.fp32_param.{key}"] = tensor.float().clone()
    writer = FileSystemWriter(str(weights_dir), thread_count=2)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore")
        save(state, storage_writer=writer, no_dist=True)
    torch.save(common if common is not None else {"epoch": 0, "global_step": 10, "optimizer": [{"lr": 1e-4}]},
               weights_dir / "common.pt")
    (weights_dir / "metadata.json").write_text(json.dumps(
        {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
         "common_backend_version": 1}))
    return path


def write_esm2_nemo2(path: Path, model: transformers.EsmForMaskedLM, weights_edit=None, **overrides: Any) -> Path:
    """`model` as a NeMo 2 ESM-2 directory; `weights_edit(weights)` may change the Megatron-core
    weights first, `overrides` the config: fields."""
    weights = esm2_to_megatron_core(model)
    if weights_edit:
        weights_edit(weights)
    return write_nemo2(path, esm2_model_yaml(model.config, **overrides), weights)
