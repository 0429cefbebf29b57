"""Random checkpoints of the released models' real shapes (ESM-2 35M to 15B, ESM C 300M to 6B),
written tensor by tensor so that writing one never holds more than a few tens of megabytes: what
the memory and speed benchmarks of large builds read (benchmarks/model_sizes.py), and, at tiny
sizes, what tests check the writer with.

    write_random_checkpoint("esm2", out, "esm2_t30_150M")        # config.json + model.safetensors + vocab.txt
    write_random_checkpoint("esmc", out, "esmc_600m")            # bf16, as the released ESM C weights
    write_random_checkpoint("esm2", out, {"hidden_size": 32, "num_layers": 2, "num_heads": 4,
                                          "intermediate_size": 64})

The folders are what the project's Hugging Face reader reads (models/readers/huggingface.py) and
what transformers' `EsmModel` / `EsmcModel.from_pretrained` read: an `EsmForMaskedLM` (with its
contact head, `esm.contact_head.regression`, and its masked-LM head, decoder tied to the word
embeddings) or an `EsmcForMaskedLM`, under the names transformers' modules give their parameters
(LayerNorm `weight`/`bias`). The tensor names and shapes come from the transformers module built
on the meta device, so they are exactly the module's; only the values are random.

The safetensors file is written by hand in its documented layout (8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and byte range, then the raw bytes in that
order), each tensor filled in chunks from one seeded generator: the same family, shape, seed and
dtype always give the same bytes. Weights are drawn with a small standard deviation (0.02, as
transformers initialises them), LayerNorm scales near one, so a random model's activations stay of
the order of a real one's.
"""

from __future__ import annotations

import argparse
import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from bionemo_export.models.esm2 import ALPHABET
from bionemo_export.testing.checkpoints import esm2_config, esmc_config

ESM2_SHAPES: dict[str, dict[str, int]] = {
    "esm2_t6_8M": {"num_layers": 6, "hidden_size": 320, "num_heads": 20, "intermediate_size": 1280},
    "esm2_t12_35M": {"num_layers": 12, "hidden_size": 480, "num_heads": 20, "intermediate_size": 1920},
    "esm2_t30_150M": {"num_layers": 30, "hidden_size": 640, "num_heads": 20, "intermediate_size": 2560},
    "esm2_t33_650M": {"num_layers": 33, "hidden_size": 1280, "num_heads": 20, "intermediate_size": 5120},
    "esm2_t36_3B": {"num_layers": 36, "hidden_size": 2560, "num_heads": 40, "intermediate_size": 10240},
    "esm2_t48_15B": {"num_layers": 48, "hidden_size": 5120, "num_heads": 40, "intermediate_size": 20480},
}
"""facebook/esm2_*_UR50D's sizes (their config.json files): layers, width, heads, feed-forward width."""
ESMC_SHAPES: dict[str, dict[str, int]] = {
    "esmc_300m": {"num_layers": 30, "hidden_size": 960, "num_heads": 15, "intermediate_size": 2560},
    "esmc_600m": {"num_layers": 36, "hidden_size": 1152, "num_heads": 18, "intermediate_size": 3072},
    "esmc_6b": {"num_layers": 80, "hidden_size": 2560, "num_heads": 40, "intermediate_size": 6912},
}
"""ESM C's released sizes: 64-wide heads, SwiGLU width 8/3 x the width rounded up to a multiple of
256 (the esm package's `swiglu_correction_fn`: 2560, 3072, 6912)."""
SHAPES: dict[str, dict[str, dict[str, int]]] = {"esm2": ESM2_SHAPES, "esmc": ESMC_SHAPES}
DEFAULT_DTYPES: dict[str, torch.dtype] = {"esm2": torch.float32, "esmc": torch.bfloat16}
"""How the released checkpoints store their weights: ESM-2 in fp32, ESM C in bf16."""
CHUNK_ELEMENTS = 1 << 22
"""Elements drawn at once (16 MB of fp32): what bounds the writer's memory."""
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of a checkpoint to write: its name, shape and how its values are drawn."""

    name: str
    shape: tuple[int, ...]
    kind: str
    """"scale" (a normalization's weight: one plus noise), or "weight" (noise around zero)."""

    @property
    def elements(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def family_config(family: str, shape: str | Mapping[str, int]) -> Any:
    """The transformers config of a `family` ("esm2" or "esmc") model of `shape`: a released
    model's name (ESM2_SHAPES, ESMC_SHAPES) or the sizes (num_layers, hidden_size, num_heads,
    intermediate_size)."""
    if family not in SHAPES:
        raise ValueError(f"no large random checkpoints for family {family!r}; known: {', '.join(SHAPES)}")
    if isinstance(shape, str):
        try:
            sizes = SHAPES[family][shape]
        except KeyError:
            raise ValueError(f"unknown {family} shape {shape!r}; known: {', '.join(SHAPES[family])}") from None
    else:
        sizes = dict(shape)
    config = esm2_config(**sizes) if family == "esm2" else esmc_config(**sizes)
    config.architectures = ["EsmForMaskedLM" if family == "esm2" else "EsmcForMaskedLM"]
    return config


def tensor_layouts(family: str, config: Any) -> list[TensorLayout]:
    """Every parameter a `family` masked-LM model of `config` stores, in the module's order, tied
    ones once (the decoder tied to ESM-2's word embeddings is not stored, as save_pretrained
    leaves it out): the module is built on the meta device, so nothing is allocated."""
    model_class = transformers.EsmForMaskedLM if family == "esm2" else transformers.EsmcForMaskedLM
    with torch.device("meta"):
        model = model_class(config)
    layouts = []
    for name, parameter in model.named_parameters():  # tied parameters are named once
        # A normalization's scale: a one-dimensional weight of a module named for a norm
        # (LayerNorm, layer_norm, input_layernorm, q_norm, norm).
        module, _, leaf = name.rpartition(".")
        is_scale = leaf == "weight" and parameter.dim() == 1 and "norm" in module.rpartition(".")[2].lower()
        layouts.append(TensorLayout(name, tuple(parameter.shape), "scale" if is_scale else "weight"))
    return layouts


def write_safetensors(path: Path, layouts: Iterable[TensorLayout], *, dtype: torch.dtype, seed: int = 0,
                      std: float = 0.02) -> int:
    """Write the tensors of `layouts` to the safetensors file `path` in `dtype`, their values drawn
    chunk by chunk from one generator seeded with `seed` (weights N(0, std), scales 1 + N(0, std)),
    so that at most CHUNK_ELEMENTS are in memory at once. Returns the file's size in bytes."""
    layouts = list(layouts)
    if dtype not in SAFETENSORS_DTYPES:
        raise ValueError(f"dtype {dtype}: choose one of {', '.join(map(str, SAFETENSORS_DTYPES))}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for layout in layouts:
        size = layout.elements * itemsize
        header[layout.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(layout.shape),
                               "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    generator = torch.Generator().manual_seed(seed)
    path = Path(path)
    with path.open("wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for layout in layouts:
            left = layout.elements
            while left:
                count = min(left, CHUNK_ELEMENTS)
                chunk = torch.randn(count, generator=generator).mul_(std)
                if layout.kind == "scale":
                    chunk.add_(1.0)
                stored = chunk.to(dtype)
                raw = stored.view(torch.int16) if itemsize == 2 else stored
                handle.write(raw.numpy().tobytes())
                left -= count
    return path.stat().st_size


def write_random_checkpoint(family: str, out: Path | str, shape: str | Mapping[str, int], *, seed: int = 0,
                            std: float = 0.02, dtype: torch.dtype | None = None) -> Path:
    """A Hugging Face folder `out` (created) of a random `family` masked-LM model of `shape`
    (`family_config`): config.json, model.safetensors written tensor by tensor in `dtype` (default:
    what the released checkpoints store, DEFAULT_DTYPES), and the tokenizer files the family reads
    (ESM-2's vocab.txt, ESM C's EsmcTokenizer files). Returns `out` as a Path."""
    config = family_config(family, shape)
    dtype = dtype or DEFAULT_DTYPES[family]
    config.dtype = str(dtype).removeprefix("torch.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensor_layouts(family, config), dtype=dtype, seed=seed, std=std)
    config.to_json_file(str(out / "config.json"))
    if family == "esm2":
        (out / "vocab.txt").write_text("\n".join(ALPHABET) + "\n", encoding="utf-8")
    else:
        transformers.EsmcTokenizer().save_pretrained(str(out))
    return out


def main(argv: list[str] | None = None) -> None:
    """python -m bionemo_export.testing.large_checkpoints FAMILY SHAPE OUT [--seed N] [--dtype fp32|bf16]"""
    parser = argparse.ArgumentParser(description="Write a random checkpoint of a released model's shape.")
    parser.add_argument("family", choices=sorted(SHAPES))
    parser.add_argument("shape", help=f"one of {', '.join(s for shapes in SHAPES.values() for s in shapes)}")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    args = parser.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or "")
    print(write_random_checkpoint(args.family, args.out, args.shape, seed=args.seed, dtype=dtype))


if __name__ == "__main__":
    main()
