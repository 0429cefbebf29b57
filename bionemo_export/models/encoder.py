"""What families with a Hugging Face encoder backbone (ESM-2, BERT protein LMs) have in common.

- `PooledEncoder`: the backbone wrapped into the one encoder signature of `base.py`, with the
  masked mean pooling inside the graph.
- `HuggingFaceEncoderFamily`: reading such a checkpoint directory (config.json, weights, strict key
  check) into a `LoadedModel`; a family supplies only its backbone class, key layout and tokenizer.
- `save_random_model`: writing a small random checkpoint in the layout `load()` reads.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
from transformers.initialization import no_init_weights

from bionemo_export.models.base import LoadedModel, ModelFamily
from bionemo_export.tokenizers.character import CharacterTokenizer

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class PooledEncoder(torch.nn.Module):
    """forward(input_ids, attention_mask, residue_mask) -> (hiddens, embeddings).

    embeddings = mean of hiddens over residue_mask. Only tensor operations, so that
    `torch.onnx.export` traces one graph valid for every batch and length.
    """

    def __init__(self, backbone: torch.nn.Module) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, residue_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hiddens = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        hiddens = hiddens.float()
        return hiddens, masked_mean(hiddens, residue_mask)


def masked_mean(hiddens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The embeddings [batch, hidden]: mean of hiddens [batch, length, hidden] where mask
    [batch, length] is True. Tensor operations only, so it traces for any batch and length."""
    weights = mask.unsqueeze(-1).to(hiddens.dtype)
    # clamp: an all-False mask (never produced by the tokenizer) gives zeros, not NaN.
    counts = weights.sum(dim=1).clamp(min=1.0)
    return (hiddens * weights).sum(dim=1) / counts


class HuggingFaceEncoderFamily(ModelFamily):
    """A family whose checkpoint is a Hugging Face directory: config.json + weights (+ vocab)."""

    model_type: ClassVar[str]
    """config.json's model_type this family reads."""
    config_class: ClassVar[type[Any]]
    """The transformers config class (EsmConfig, BertConfig)."""
    backbone_class: ClassVar[type[Any]]
    """The transformers model class, built with add_pooling_layer=False (EsmModel, BertModel)."""
    key_prefix: ClassVar[str]
    """Prefix of the backbone's keys in *ForMaskedLM-style checkpoints (stripped when present)."""
    unused_prefixes: ClassVar[tuple[str, ...]]
    """Keys (after the prefix is stripped) of heads the encoder does not use: never loaded."""

    @abstractmethod
    def build_tokenizer(self, checkpoint: Path, config: Any, max_length: int | None) -> CharacterTokenizer:
        """The tokenizer for this checkpoint, limited to `max_length` tokens when given."""

    def load(self, checkpoint: Path, max_length: int | None = None) -> LoadedModel:
        checkpoint = Path(checkpoint)
        config = self.config_class.from_dict(read_config(checkpoint, self.model_type))
        tokenizer = self.build_tokenizer(checkpoint, config, max_length)
        if tokenizer.vocab_size > config.vocab_size:
            raise ValueError(
                f"{checkpoint}: the vocabulary has {tokenizer.vocab_size} tokens but config.json's "
                f"vocab_size is {config.vocab_size}"
            )
        weights, weights_file = read_weights(checkpoint)
        # Skip the random initialisation (12 s for ESM-2 650M): strict loading overwrites every
        # parameter the encoder uses, and buffers are computed in the constructors regardless.
        with no_init_weights():
            backbone = self.backbone_class(config, add_pooling_layer=False)
        self._load_strict(backbone, weights, checkpoint / weights_file)
        return LoadedModel(
            family=self,
            encoder=PooledEncoder(backbone).eval(),
            tokenizer=tokenizer,
            hidden_size=config.hidden_size,
            checkpoint=checkpoint,
            description={
                "architecture": self.backbone_class.__name__,
                "layers": config.num_hidden_layers,
                "hidden": config.hidden_size,
                "heads": config.num_attention_heads,
                "parameters": sum(p.numel() for p in self._used_parameters(backbone).values()),
                "checkpoint_form": f"huggingface directory ({weights_file})",
            },
        )

    def _used_parameters(self, backbone: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """The backbone's parameters minus the unused heads: what a checkpoint must provide."""
        return {
            name: p
            for name, p in backbone.named_parameters()
            if not name.startswith(self.unused_prefixes)
        }

    def _load_strict(
        self, backbone: torch.nn.Module, state_dict: dict[str, torch.Tensor], source: Path
    ) -> None:
        """Load every parameter the encoder uses; raise ValueError on missing/unexpected/mis-shaped
        keys. Buffers (position ids, rotary frequencies) are computed from the config, not read."""
        buffers = {name.rsplit(".", 1)[-1] for name, _ in backbone.named_buffers()}
        weights = {}
        for key, tensor in state_dict.items():
            key = _modern_name(key.removeprefix(self.key_prefix))
            if not key.startswith(self.unused_prefixes) and key.rsplit(".", 1)[-1] not in buffers:
                weights[key] = tensor
        expected = self._used_parameters(backbone)
        problems = []
        if missing := sorted(expected.keys() - weights.keys()):
            problems.append(f"missing keys: {_some(missing)}")
        if unexpected := sorted(weights.keys() - expected.keys()):
            problems.append(f"unexpected keys: {_some(unexpected)}")
        shapes = [
            f"{key} is {tuple(weights[key].shape)}, expected {tuple(expected[key].shape)}"
            for key in sorted(expected.keys() & weights.keys())
            if weights[key].shape != expected[key].shape
        ]
        if shapes:
            problems.append(f"wrong shapes: {_some(shapes)}")
        if problems:
            raise ValueError(
                f"{source} does not match the {type(backbone).__name__} described by config.json: "
                + "; ".join(problems)
            )
        backbone.load_state_dict(weights, strict=False)
        with torch.no_grad():  # unused heads were never initialised: make their memory defined
            for name, parameter in backbone.named_parameters():
                if name not in expected:
                    parameter.zero_()


def read_config(directory: Path, model_type: str) -> dict[str, Any]:
    """config.json of a Hugging Face checkpoint directory, checked to be of `model_type`."""
    if not directory.is_dir():
        raise ValueError(f"checkpoint {directory} is not a directory (expected a Hugging Face "
                         f"{model_type} checkpoint: config.json and weights)")
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"checkpoint {directory} has no config.json")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    # Configs written by old transformers versions (rxnfp's, for one) have no model_type: the
    # family the user named decides, and loading checks every weight's name and shape anyway.
    config.setdefault("model_type", model_type)
    if config["model_type"] != model_type:
        raise ValueError(f"{path} has model_type {config.get('model_type')!r}, expected {model_type!r}")
    return config


def read_weights(directory: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The state dict in `directory` (single file or sharded with an index) and its file name."""
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return _read_weight_file(directory / name), name
        index = directory / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            weights: dict[str, torch.Tensor] = {}
            for shard in shards:
                weights.update(_read_weight_file(directory / shard))
            return weights, index.name
    raise ValueError(
        f"checkpoint {directory} has no weights: expected {' or '.join(WEIGHT_FILES)} "
        "(or a sharded *.index.json)"
    )


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # every reader has its own error types; name the file either way
        raise ValueError(f"cannot read weights {path}: {err}") from err


def _modern_name(key: str) -> str:
    """LayerNorm `gamma`/`beta` -> `weight`/`bias`: old checkpoints use these names, and
    transformers 5.x's save_pretrained writes them again for ESM."""
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def _some(items: list[str], limit: int = 8) -> str:
    """A readable list of the first `limit` items."""
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def read_vocab(path: Path) -> list[str]:
    """A vocab.txt: one token per line, the id being the line number."""
    return path.read_text(encoding="utf-8").splitlines()


def token_limit(architecture_limit: int, requested: int | None, family: str) -> int:
    """The tokenizer's max_length: the architecture's limit, or a lower one the user asked for."""
    if requested is None:
        return architecture_limit
    if requested > architecture_limit:
        raise ValueError(
            f"max_length {requested} exceeds what {family} supports ({architecture_limit} tokens)"
        )
    return requested


def save_random_model(
    build: Callable[[], Any], out: Path, *, seed: int, vocab: list[str]
) -> Path:
    """Build a transformers model with a fixed seed and save it with save_pretrained + vocab.txt."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # seed the initialisation without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = build()
    model.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return out
