"""MegaMolBART: a pre-LN transformer encoder-decoder over SMILES (Megatron/Chemformer style).

Pure PyTorch. One token + learned-position embedding shared by the encoder and the decoder, GELU
MLPs, a final LayerNorm on each side and a separate output head (`tokens_head`, with bias).
Parameter names follow NeMo's where that is easy (`input_layernorm`, `self_attention.dense`,
`inter_attention`, `mlp.dense_h_to_4h`, ...), with separate query/key/value projections.

The encoder is exported with the standard signature of base.py; the decoder as the three graphs of
`Seq2SeqModules` (cross_kv, decoder_step with a self-attention cache, decoder_full without), all
views of one `MegaMolBart` sharing its parameters.

Checkpoint forms read here: BioNeMo's `.nemo` archive (NeMo's Megatron encoder-decoder layout,
regex tokenizer artifacts) and the project's own saved form, a directory with config.json
({"model_type": "megamolbart", sizes...}), model.safetensors and vocab.txt (line order = id). A
vocabulary padded beyond the tokenizer (Megatron pads to a multiple of 128) is cut back to it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import save_file
from torch import nn

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.base import LoadedModel, ModelDescription, ModelFamily, Seq2SeqModules, register
from bionemo_export.models.encoder import load_strict, masked_mean, token_limit
from bionemo_export.models.megatron import cut_vocab, encoder_decoder_keys, transformer_config
from bionemo_export.models.readers import Checkpoint, CheckpointError, read_checkpoint
from bionemo_export.models.readers.base import describe_checkpoint
from bionemo_export.models.readers.nemo import artifact_text
from bionemo_export.models.transformer import (
    DecoderLayer,
    Embedding,
    EncoderLayer,
    Stack,
    TransformerConfig,
    encode,
    encode_layers,
    initialize,
)
from bionemo_export.serving.tokenizers.smiles import SmilesTokenizer
from bionemo_export.tasks import Requirement

MODEL_TYPE = "megamolbart"

SAMPLE_SMILES = [
    "CCO",
    "c1ccccc1O",
    "CC(=O)Oc1ccccc1C(=O)O",  # aspirin
    "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",  # caffeine
    "CC(C)Cc1ccc(cc1)[C@@H](C)C(=O)O",  # ibuprofen
    "CC(C)c1c(C(=O)Nc2ccccc2)c(-c2ccccc2)c(-c2ccc(F)cc2)n1CC[C@@H](O)C[C@@H](O)CC(=O)O",  # atorvastatin
]
"""Valid SMILES of varied length: bracket atoms, ring closures, branches."""

DEFAULT_VOCAB_SMILES = [
    *SAMPLE_SMILES,
    "Clc1ccc(Br)cc1I",
    "FC(F)(F)c1ccc(cc1)S(=O)(=O)N",
    "N#CC=C/C=C\\C",
    "[NH3+][C@H](C)C(=O)[O-].[Na+].[Cl-]",
    "OP(=O)(O)OB(O)O",
    "c1ccncc1.c1ccoc1.c1ccsc1.c1cc[nH]c1.c1cpcc1.b1ccccc1",
    "C0CC0.C%10CCCCC%10.C1CC2CC3CC4CC5CC6CC7CC8CC9CCC9C8C7C6C5C4C3C2C1",
    "[2H]C([2H])([2H])[13C@@H](O)[N+](=O)[O-]",
]
"""What the default vocabulary of random checkpoints (bionemo_export/testing/checkpoints.py) and
of trained copy models is built from: the common SMILES tokens."""


@dataclass
class MegaMolBartConfig(TransformerConfig):
    """The sizes of a MegaMolBART; defaults are the released checkpoint's (except vocab_size)."""

    def to_dict(self) -> dict[str, Any]:
        """config.json's content."""
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: Path) -> MegaMolBartConfig:
        """The config in config.json (`source`), with unknown or missing fields an error."""
        settings = {key: value for key, value in d.items() if key != "model_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(settings.keys() - known):
            raise InvalidInputError(f"{source} has unknown fields {unknown}; known: {sorted(known)}")
        if "vocab_size" not in settings:
            raise InvalidInputError(f"{source} lacks vocab_size")
        try:
            return cls(**settings)
        except ValueError as err:
            raise InvalidInputError(f"{source}: {err}") from None


class MegaMolBart(nn.Module):
    """The whole model. `encode` gives the hidden states; `cross_kv` + `decode` run the decoder
    (teacher-forced, incrementally with a cache, or both); `forward` is the training pass."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.encoder = Stack(config, EncoderLayer, config.num_layers)
        self.decoder = Stack(config, DecoderLayer, config.num_decoder_layers)
        self.tokens_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.apply(initialize)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, length, hidden] of the SMILES tokens (no begin/end tokens)."""
        return encode(self.embedding, self.encoder, input_ids, attention_mask)

    def cross_kv(self, hiddens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer's cross-attention keys and values of the encoder's hidden states,
        each [layers, batch, heads, src_length, head_dim]: computed once per decode."""
        layers = cast("Iterable[DecoderLayer]", self.decoder.layers)  # Stack(config, DecoderLayer, ...)
        pairs = [layer.inter_attention.keys_values(hiddens) for layer in layers]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])

    def decode(
        self,
        tokens: torch.Tensor,
        enc_mask: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits [batch, T, vocab] for `tokens` [batch, T] at positions P..P+T-1 after the P
        cached ones (none when past_k is None), and the cache extended by them
        ([layers, batch, heads, P+T, head_dim] each). Causal: a token sees itself and earlier ones."""
        cached = 0 if past_k is None else past_k.shape[3]
        queries = torch.arange(tokens.shape[1], device=tokens.device) + cached
        keys = torch.arange(cached + tokens.shape[1], device=tokens.device)
        self_allowed = keys[None, :] <= queries[:, None]
        cross_allowed = enc_mask.bool()[:, None, None, :]
        x = self.embedding(tokens, offset=cached)
        present_k, present_v = [], []
        for i, layer in enumerate(self.decoder.layers):
            past = None if past_k is None or past_v is None else (past_k[i], past_v[i])
            x, k, v = layer(x, past, self_allowed, (cross_k[i], cross_v[i]), cross_allowed)
            present_k.append(k)
            present_v.append(v)
        logits = self.tokens_head(self.decoder.final_layernorm(x))
        return logits, torch.stack(present_k), torch.stack(present_v)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, decoder_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Teacher-forced logits [batch, T, vocab] of the decoder given `decoder_tokens` (training)."""
        cross = self.cross_kv(self.encode(input_ids, attention_mask))
        return self.decode(decoder_tokens, attention_mask, *cross)[0]


class _ModelView(nn.Module):
    """One exported graph of a `MegaMolBart`, over its parameters (shared, not copied)."""

    def __init__(self, model: MegaMolBart) -> None:
        super().__init__()
        self.model = model


class MegaMolBartEncoder(_ModelView):
    """The encoder export: forward(input_ids, attention_mask, residue_mask) -> (hiddens, embeddings)."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, residue_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hiddens = self.model.encode(input_ids, attention_mask)
        return hiddens, masked_mean(hiddens, residue_mask)

    def layer_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every encoder layer's hidden states (transformer.encode_layers): 0 the embedding's output,
        the last after the encoder's final LayerNorm (what `forward` answers as hiddens)."""
        return encode_layers(self.model.embedding, self.model.encoder, input_ids, attention_mask)


class CrossKV(_ModelView):
    """forward(hiddens) -> (cross_k, cross_v): see `Seq2SeqModules.cross_kv`."""

    def forward(self, hiddens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.cross_kv(hiddens)


class DecoderStep(_ModelView):
    """forward(tokens [B,1], enc_mask, cross_k, cross_v, past_k, past_v) -> (logits [B,V],
    present_k, present_v): see `Seq2SeqModules.decoder_step`."""

    def forward(
        self,
        tokens: torch.Tensor,
        enc_mask: torch.Tensor,
        cross_k: torch.Tensor,
        cross_v: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, present_k, present_v = self.model.decode(tokens, enc_mask, cross_k, cross_v, past_k, past_v)
        return logits[:, -1], present_k, present_v


class DecoderFull(_ModelView):
    """forward(tokens [B,T], hiddens, enc_mask) -> logits [B,T,V], no cache: see
    `Seq2SeqModules.decoder_full`."""

    def forward(self, tokens: torch.Tensor, hiddens: torch.Tensor, enc_mask: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens, enc_mask, *self.model.cross_kv(hiddens))[0]


def save(model: MegaMolBart, vocab: Sequence[str], out: Path) -> Path:
    """Write `model` and its vocabulary in the saved form (config.json, model.safetensors,
    vocab.txt) to the directory `out`. Returns `out`."""
    if len(vocab) > model.config.vocab_size:
        raise InvalidInputError(
            f"the vocabulary has {len(vocab)} tokens, the model only {model.config.vocab_size}"
        )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.dumps(model.config.to_dict(), indent=2) + "\n"
    (out / "config.json").write_text(config, encoding="utf-8")
    weights = {key: tensor.contiguous() for key, tensor in model.state_dict().items()}
    save_file(weights, out / "model.safetensors")
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return out


def load_model(directory: Path) -> tuple[MegaMolBart, list[str], str]:
    """(model in eval mode, vocabulary, weights file name) of a saved-form directory, read
    strictly: ValueError names a missing file, a wrong model_type, or the missing, unexpected
    and mis-shaped weights."""
    family = MegaMolBartFamily()
    description = family.describe(read_checkpoint(Path(directory)))
    return family.build_model(description), list(description.tokenizer.vocab), description.checkpoint.weights_name


VOCAB_ROWS = ("embedding.word_embeddings.weight", "tokens_head.weight", "tokens_head.bias")
"""The tensors with one row per vocabulary entry (cut to the tokenizer's size when padded)."""


def _cut_padded_vocab(weights: dict[str, torch.Tensor], rows: int, size: int, source: str) -> dict[str, torch.Tensor]:
    """Keep the tokenizer's `size` rows of the tensors declared with `rows` (padded) rows: a
    padded id then has no logit at all, so no decode can ever produce one."""
    for key in VOCAB_ROWS:
        if key in weights:
            if weights[key].shape[0] != rows:
                raise CheckpointError(f"{source}: {key} has {weights[key].shape[0]} rows, expected {rows}")
            weights[key] = cut_vocab(weights[key], size, key, source)
    return weights


def _output_head(weights: dict[str, torch.Tensor], embedding: torch.Tensor | None, source: str) -> str:
    """Complete the stored output head (`tokens_head`) in place and say which one it was. What the
    file holds decides, whatever the config says (docs/reference/checkpoint-layouts.md): NeMo <= 1.10
    saved only the bias, the weight tied to the token embeddings; NeMo 1.11-1.12, and later with
    `share_decoder_tokens_head_embeddings: false` (MegaMolBART's), only the weight; some archives both."""
    has_weight, has_bias = "tokens_head.weight" in weights, "tokens_head.bias" in weights
    if has_weight:
        return "weight and bias" if has_bias else "weight, no bias"
    if not has_bias:
        raise CheckpointError(f"{source} has no enc_dec_model.tokens_head.weight nor .bias: the decoder's output "
                              "head is missing, so nothing can be decoded")
    if embedding is None:
        raise CheckpointError(f"{source}: enc_dec_model.tokens_head has only a bias, so its weight is the token "
                              "embeddings, but enc_dec_model.encoder_embedding.word_embeddings.weight is missing")
    weights["tokens_head.weight"] = embedding
    return "bias, weight tied to the token embeddings"


@register
class MegaMolBartFamily(ModelFamily):
    name = "megamolbart"
    may_carry = frozenset({Requirement.ENCODER, Requirement.DECODER})
    """its decoder; its own transformer answers no attention probabilities."""
    description = "MegaMolBART SMILES encoder-decoder (pre-LN, learned positions): .nemo or the project's saved form"
    atol = 1e-4
    nemo_targets = ("MegaMolBARTModel",)

    def from_saved(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        config = MegaMolBartConfig.from_dict(checkpoint.config, checkpoint.path / "config.json")
        vocab = checkpoint.text("vocab.txt", "vocabulary").splitlines()
        if len(vocab) > config.vocab_size:
            raise CheckpointError(f"{checkpoint.path / 'vocab.txt'} has {len(vocab)} tokens but config.json's "
                                  f"vocab_size is {config.vocab_size}")
        tokenizer = self._tokenizer(checkpoint, vocab, config, max_length)
        weights = _cut_padded_vocab(dict(checkpoint.weights), config.vocab_size, len(vocab), checkpoint.weights_path)
        return ModelDescription(checkpoint, dataclasses.replace(config, vocab_size=len(vocab)), tokenizer, weights)

    def from_nemo(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """A BioNeMo MegaMolBART archive: NeMo's regex tokenizer files, the Megatron
        encoder-decoder layout (megatron.py), vocabulary rows padded to a multiple of 128."""
        vocab = artifact_text(checkpoint, "vocab_file").splitlines()
        vocab = vocab[:-1] if vocab and not vocab[-1] else vocab
        pattern = artifact_text(checkpoint, "model").strip() if "model" in (checkpoint.config.get("tokenizer") or {}) \
            else None
        base = transformer_config(checkpoint, len(vocab), ("encoder", "decoder"))
        config = MegaMolBartConfig(**base.to_dict())
        tokenizer = self._tokenizer(checkpoint, vocab, config, max_length, pattern)
        source = checkpoint.weights_path
        weights = encoder_decoder_keys(checkpoint.weights, config.num_heads, source)
        embedding = weights.get("embedding.word_embeddings.weight")
        head = _output_head(weights, embedding, source)
        if embedding is not None:
            weights = _cut_padded_vocab(weights, embedding.shape[0], len(vocab), source)
        if "tokens_head.bias" not in weights:  # NeMo 1.11-1.12, and >= 1.13 unshared: a head without bias
            weights["tokens_head.bias"] = torch.zeros(len(vocab), dtype=weights["tokens_head.weight"].dtype)
        return ModelDescription(checkpoint, config, tokenizer, weights,
                                facts={"nemo_target": checkpoint.model_class, "activation": config.activation,
                                       "output_head": head})

    def _tokenizer(self, checkpoint: Checkpoint, vocab: list[str], config: MegaMolBartConfig,
                   max_length: int | None, pattern: str | None = None) -> SmilesTokenizer:
        try:
            limit = token_limit(config.max_position_embeddings, max_length, "MegaMolBART")
            options = {"pattern": pattern} if pattern else {}
            return SmilesTokenizer(vocab, max_length=limit, **options)
        except ValueError as err:
            raise CheckpointError(f"checkpoint {checkpoint.path}: {err}") from None

    def build_model(self, description: ModelDescription) -> MegaMolBart:
        """The whole model, its parameters strictly loaded from the description."""
        # Built on the meta device and then given the checkpoint's tensors: no time spent on a random
        # initialisation that strict loading overwrites entirely.
        with torch.device("meta"):
            model = MegaMolBart(MegaMolBartConfig(**dataclasses.asdict(description.config)))
        load_strict(model, description.state_dict, description.checkpoint.weights_path)
        return model.float().eval()

    def build(self, description: ModelDescription) -> LoadedModel:
        model = self.build_model(description)
        config, tokenizer = model.config, description.tokenizer
        # describe made it (_tokenizer): a SmilesTokenizer with MegaMolBART's begin and end tokens.
        assert isinstance(tokenizer, SmilesTokenizer) and tokenizer.begin_id is not None, tokenizer
        assert tokenizer.end_id is not None, tokenizer
        seq2seq = Seq2SeqModules(
            cross_kv=CrossKV(model).eval(),
            decoder_step=DecoderStep(model).eval(),
            decoder_full=DecoderFull(model).eval(),
            num_layers=config.num_decoder_layers,
            num_heads=config.num_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            begin_id=tokenizer.begin_id,
            end_id=tokenizer.end_id,
            pad_id=tokenizer.pad_id,
            max_decode_length=config.max_position_embeddings - 1,  # position 0 holds the begin token
        )
        return LoadedModel(
            family=self,
            encoder=MegaMolBartEncoder(model).eval(),
            tokenizer=tokenizer,
            hidden_size=config.hidden_size,
            checkpoint=description.checkpoint.path,
            description={
                "architecture": type(model).__name__,
                "layers": config.num_layers,
                "hidden": config.hidden_size,
                "heads": config.num_heads,
                "parameters": sum(p.numel() for p in model.parameters()),
                "checkpoint_form": describe_checkpoint(description.checkpoint),
                **description.facts,
            },
            seq2seq=seq2seq,
        )

    def sample_sequences(self) -> list[str]:
        return list(SAMPLE_SMILES)
