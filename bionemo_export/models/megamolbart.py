"""MegaMolBART: a pre-LN transformer encoder-decoder over SMILES (Megatron/Chemformer style).

Pure PyTorch. One token + learned-position embedding shared by the encoder and the decoder, GELU
MLPs, a final LayerNorm on each side and a separate output head (`tokens_head`, with bias).
Parameter names follow NeMo's where that is easy (`input_layernorm`, `self_attention.dense`,
`inter_attention`, `mlp.dense_h_to_4h`, ...), with separate query/key/value projections.

The encoder is exported with the standard signature of base.py; the decoder as the three graphs of
`Seq2SeqModules` (cross_kv, decoder_step with a self-attention cache, decoder_full without), all
views of one `MegaMolBart` sharing its parameters.

Checkpoint form read here: the project's own saved form, a directory with config.json
({"model_type": "megamolbart", sizes...}), model.safetensors and vocab.txt (line order = id).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from bionemo_export.models.base import LoadedModel, ModelFamily, Seq2SeqModules, register
from bionemo_export.models.encoder import masked_mean, read_config, read_vocab, read_weights, token_limit
from bionemo_export.tokenizers.smiles import SmilesTokenizer, build_vocab

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
"""What the default vocabulary of random checkpoints is built from: the common SMILES tokens."""


@dataclass
class MegaMolBartConfig:
    """The sizes of a MegaMolBART; defaults are the released checkpoint's (except vocab_size)."""

    vocab_size: int
    hidden_size: int = 512
    num_layers: int = 6
    """Layers of the encoder, and of the decoder."""
    num_heads: int = 8
    ffn_size: int = 0
    """Width of the MLPs; 0 means 4 * hidden_size."""
    max_position_embeddings: int = 512
    layer_norm_eps: float = 1e-5
    dropout: float = 0.0

    def __post_init__(self) -> None:
        self.ffn_size = self.ffn_size or 4 * self.hidden_size
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_dict(self) -> dict[str, Any]:
        """config.json's content."""
        return {"model_type": MODEL_TYPE, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: Path) -> MegaMolBartConfig:
        """The config in config.json (`source`), with unknown or missing fields an error."""
        settings = {key: value for key, value in d.items() if key != "model_type"}
        known = {f.name for f in dataclasses.fields(cls)}
        if unknown := sorted(settings.keys() - known):
            raise ValueError(f"{source} has unknown fields {unknown}; known: {sorted(known)}")
        if "vocab_size" not in settings:
            raise ValueError(f"{source} lacks vocab_size")
        try:
            return cls(**settings)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None


def _split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[batch, length, hidden] -> [batch, heads, length, head_dim]."""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention; `allowed` (bool, broadcast to [batch, heads, queries, keys])
    is True where a query may look at a key. Returns [batch, queries, hidden]."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    # The dtype's minimum rather than -inf: exp() still gives exactly 0, and a fully masked row
    # (a padded query) gives a uniform average instead of NaN.
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    return (scores.softmax(dim=-1) @ v).transpose(1, 2).flatten(2)


class Attention(nn.Module):
    """Multi-head attention with separate query/key/value projections and an output `dense`."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        hidden = config.hidden_size
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.dense = nn.Linear(hidden, hidden)

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `x`, each [batch, heads, length, head_dim] (what caches hold)."""
        return _split_heads(self.key(x), self.num_heads), _split_heads(self.value(x), self.num_heads)

    def forward(
        self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """Attention of the queries of `x` over keys `k` and values `v` where `allowed`."""
        return self.dense(_attend(_split_heads(self.query(x), self.num_heads), k, v, allowed))


class Mlp(nn.Module):
    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.ffn_size)
        self.dense_4h_to_h = nn.Linear(config.ffn_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(nn.functional.gelu(self.dense_h_to_4h(x)))


class EncoderLayer(nn.Module):
    """Pre-LN: x + attention(LN(x)), then x + mlp(LN(x))."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attention = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = Mlp(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.dropout(self.self_attention(h, *self.self_attention.keys_values(h), allowed))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class DecoderLayer(nn.Module):
    """Pre-LN: causal self-attention, cross-attention to the encoder (`inter_attention`), MLP."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        eps = config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.self_attention = Attention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.inter_attention = Attention(config)
        self.post_inter_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=eps)
        self.mlp = Mlp(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
        self_allowed: torch.Tensor,
        cross: tuple[torch.Tensor, torch.Tensor],
        cross_allowed: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, keys, values): the keys/values of the cached positions followed by x's own."""
        h = self.input_layernorm(x)
        k, v = self.self_attention.keys_values(h)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        x = x + self.dropout(self.self_attention(h, k, v, self_allowed))
        x = x + self.dropout(self.inter_attention(self.post_attention_layernorm(x), *cross, cross_allowed))
        x = x + self.dropout(self.mlp(self.post_inter_attention_layernorm(x)))
        return x, k, v


class Embedding(nn.Module):
    """Token + learned absolute position embeddings; tokens start at position `offset`."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, ids: torch.Tensor, offset: int | torch.SymInt = 0) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device) + offset
        return self.dropout(self.word_embeddings(ids) + self.position_embeddings(positions))


class Stack(nn.Module):
    """The layers of the encoder or of the decoder, and their final LayerNorm."""

    def __init__(self, config: MegaMolBartConfig, layer: type[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layer(config) for _ in range(config.num_layers))
        self.final_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class MegaMolBart(nn.Module):
    """The whole model. `encode` gives the hidden states; `cross_kv` + `decode` run the decoder
    (teacher-forced, incrementally with a cache, or both); `forward` is the training pass."""

    def __init__(self, config: MegaMolBartConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.encoder = Stack(config, EncoderLayer)
        self.decoder = Stack(config, DecoderLayer)
        self.tokens_head = nn.Linear(config.hidden_size, config.vocab_size)
        self.apply(_initialize)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Hidden states [batch, length, hidden] of the SMILES tokens (no begin/end tokens)."""
        allowed = attention_mask.bool()[:, None, None, :]
        x = self.embedding(input_ids)
        for layer in self.encoder.layers:
            x = layer(x, allowed)
        return self.encoder.final_layernorm(x)

    def cross_kv(self, hiddens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer's cross-attention keys and values of the encoder's hidden states,
        each [layers, batch, heads, src_length, head_dim]: computed once per decode."""
        pairs = [layer.inter_attention.keys_values(hiddens) for layer in self.decoder.layers]
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


def _initialize(module: nn.Module) -> None:
    """Megatron's initialisation (normal, std 0.02; zero biases), which MegaMolBART was trained
    from; PyTorch's defaults would give the embeddings unit variance."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


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
        raise ValueError(
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
    directory = Path(directory)
    config = MegaMolBartConfig.from_dict(read_config(directory, MODEL_TYPE), directory / "config.json")
    vocab_file = directory / "vocab.txt"
    if not vocab_file.is_file():
        raise ValueError(f"checkpoint {directory} has no vocab.txt")
    vocab = read_vocab(vocab_file)
    if len(vocab) > config.vocab_size:
        raise ValueError(
            f"{vocab_file} has {len(vocab)} tokens but config.json's vocab_size is {config.vocab_size}"
        )
    weights, weights_file = read_weights(directory)
    # Built on the meta device and then given the checkpoint's tensors: no time spent on a random
    # initialisation that strict loading overwrites entirely.
    with torch.device("meta"):
        model = MegaMolBart(config)
    try:
        model.load_state_dict(weights, strict=True, assign=True)
    except RuntimeError as err:  # torch lists every missing, unexpected and mis-shaped key
        raise ValueError(f"{directory / weights_file} does not match config.json: {err}") from None
    return model.float().eval(), vocab, weights_file


@register
class MegaMolBartFamily(ModelFamily):
    name = "megamolbart"
    description = "MegaMolBART SMILES encoder-decoder (pre-LN, learned positions), the project's saved form"
    tasks = ("embeddings", "hiddens", "decodes", "samplings")
    atol = 1e-4

    def load(self, checkpoint: Path, max_length: int | None = None) -> LoadedModel:
        checkpoint = Path(checkpoint)
        model, vocab, weights_file = load_model(checkpoint)
        config = model.config
        try:
            limit = token_limit(config.max_position_embeddings, max_length, "MegaMolBART")
            tokenizer = SmilesTokenizer(vocab, max_length=limit)
        except ValueError as err:
            raise ValueError(f"checkpoint {checkpoint}: {err}") from None
        seq2seq = Seq2SeqModules(
            cross_kv=CrossKV(model).eval(),
            decoder_step=DecoderStep(model).eval(),
            decoder_full=DecoderFull(model).eval(),
            num_layers=config.num_layers,
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
            checkpoint=checkpoint,
            description={
                "architecture": type(model).__name__,
                "layers": config.num_layers,
                "hidden": config.hidden_size,
                "heads": config.num_heads,
                "parameters": sum(p.numel() for p in model.parameters()),
                "checkpoint_form": f"megamolbart directory ({weights_file})",
            },
            seq2seq=seq2seq,
        )

    def save_random_checkpoint(
        self,
        out: Path,
        *,
        seed: int = 0,
        hidden_size: int = 32,
        num_layers: int = 2,
        num_heads: int = 4,
        vocab: Sequence[str] | None = None,
    ) -> Path:
        vocab = list(vocab) if vocab is not None else build_vocab(DEFAULT_VOCAB_SMILES)
        config = MegaMolBartConfig(
            vocab_size=len(vocab), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads
        )
        with torch.random.fork_rng():  # seed the initialisation without disturbing the caller's RNG
            torch.manual_seed(seed)
            model = MegaMolBart(config)
        return save(model, vocab, out)

    def sample_sequences(self) -> list[str]:
        return list(SAMPLE_SMILES)
