"""transformers' own encoder run one layer at a time, each layer's weights read from the checkpoint
just before it runs and let go after it: the PyTorch reference of models whose fp32 weights do not
fit in memory (ESM C 6B's 25 GB, ESM-2 15B's 60 GB on a 24 GB host), for the large-model benchmarks
(benchmarks/model_sizes.py) and, at tiny sizes, the tests that check it against the whole model.

    hiddens = streamed_hidden_states(transformers.EsmcModel, folder, input_ids, attention_mask)
    rounded = streamed_hidden_states(transformers.EsmcModel, folder, input_ids, attention_mask, weight_bits=4)

It is independent of the project's code: transformers' module and its forward, the safetensors
file read by safetensors. The model is made with its parameters unallocated (no initialisation)
and every layer's parameters are empty until its forward pre-hook reads them (fp32) and its
forward hook empties them again; the embeddings, the final norm and the computed buffers (rotary
tables) are held throughout.

`weight_bits` (4 or 8) rounds each linear layer's weight as weight-only quantization does before
the layer runs (`round_weights`: asymmetric, round to nearest, a scale and zero point per block of
`block_size` inputs, zero inside every block's range: the scheme MatMulNBits documents), written
here from that description: the reference of a quantized graph's own weights, which tells a
quantized graph's implementation (layout, packing, kernels) apart from what rounding itself costs.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.initialization import no_init_weights

KEY_PREFIXES = ("", "esmc.", "esm.")
"""Where a backbone's parameter names sit in its checkpoint: bare (EsmModel, EsmcModel files) or
under the masked-LM classes' prefix (EsmcForMaskedLM, EsmForMaskedLM)."""


def round_weights(weight: torch.Tensor, bits: int, block_size: int = 32) -> torch.Tensor:
    """`weight` ([out, in]) with each block of `block_size` consecutive inputs of a row rounded to
    `bits`-bit integers: over the block with zero in its range, scale = (max - min) / (2^bits - 1),
    zero point = round(-min / scale), q = clamp(round(w x (1 / scale) + zero point)), and
    w' = (q - zero point) x scale, in fp32, ties rounded away from zero (C's roundf, which
    onnxruntime's blockwise quantizer uses: bf16 weights meet ties often). The row is
    zero-padded to whole blocks."""
    rows, width = weight.shape
    padded = -(-width // block_size) * block_size
    blocks = torch.nn.functional.pad(weight.float(), (0, padded - width)).view(rows, -1, block_size)
    low = blocks.amin(-1, keepdim=True).clamp(max=0.0)
    high = blocks.amax(-1, keepdim=True).clamp(min=0.0)
    levels = 2**bits - 1
    scale = (high - low) / levels
    zero = torch.where(scale == 0, torch.zeros_like(scale), torch.floor(-low / scale + 0.5).clamp(0, levels))
    reciprocal = torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
    quantized = torch.clamp(torch.floor(blocks * reciprocal + zero + 0.5), 0, levels)
    return ((quantized - zero) * scale).view(rows, padded)[:, :width].contiguous()


def streamed_hidden_states(model_class: Any, checkpoint: Path | str, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, *, weight_bits: int | None = None,
                           block_size: int = 32) -> torch.Tensor:
    """The last hidden states of `model_class` (transformers.EsmModel or EsmcModel) on the
    Hugging Face folder `checkpoint`, one layer's weights in memory at a time (the module's
    docstring); `weight_bits`: each linear weight rounded first (`round_weights`)."""
    checkpoint = Path(checkpoint)
    config = model_class.config_class.from_pretrained(str(checkpoint))
    with no_init_weights():
        pooler = "add_pooling_layer" in inspect.signature(model_class.__init__).parameters
        model = (model_class(config, add_pooling_layer=False) if pooler else model_class(config)).eval()
    layers = _layers(model, config.num_hidden_layers)
    # pread: each tensor read when asked. safetensors' default maps the whole file private and
    # writable, which Linux refuses beyond memory plus swap (ESM-2 15B's 30 GB on a 24 GB host).
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt", backend="pread") as weights:
        keys = set(weights.keys())

        def key(name: str) -> str:
            found = next((prefix + name for prefix in KEY_PREFIXES if prefix + name in keys), None)
            if found is None:
                raise KeyError(f"{checkpoint / 'model.safetensors'} has no {name}")
            return found

        in_layers = {id(p) for layer in layers for p in layer.parameters()}
        for name, parameter in model.named_parameters():
            if id(parameter) not in in_layers:
                parameter.data = weights.get_tensor(key(name)).float()
        names = {id(layer): name for name, layer in model.named_modules() if any(layer is m for m in layers)}

        def load(layer: torch.nn.Module, _args: Any) -> None:
            for name, parameter in layer.named_parameters():
                tensor = weights.get_tensor(key(f"{names[id(layer)]}.{name}")).float()
                if weight_bits and name.endswith("weight") and tensor.dim() == 2:
                    tensor = round_weights(tensor, weight_bits, block_size)
                parameter.data = tensor

        def release(layer: torch.nn.Module, _args: Any, _output: Any) -> None:
            for parameter in layer.parameters():
                parameter.data = torch.empty(0)

        for layer in layers:
            release(layer, None, None)
            layer.register_forward_pre_hook(load)
            layer.register_forward_hook(release)
        with torch.inference_mode():
            return model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state.float()


def _layers(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """The model's transformer layers: the ModuleList of `count` modules (EsmcModel.layers,
    EsmModel.encoder.layer)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return list(module)
    raise ValueError(f"{type(model).__name__} has no list of {count} layers")
