"""Small randomly initialised checkpoints of every model family, for tests, benchmarks and demos:
no downloaded weights, yet real checkpoints in a form each family's `load()` reads.

`tiny_config(family, **sizes)` is the family's config (its released settings: alphabet, positions,
activation) at small sizes; `save_random_checkpoint(family, out, seed=0, **sizes)` writes a model
of that config, initialised under `seed`. The same family, seed and sizes always give the same
files, byte for byte: tests compare served outputs with references computed from them.

Each family is one entry of `FAMILIES`: its config, its model class and how it is saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from bionemo_export.models.bert import ANTIBERTY_VOCAB
from bionemo_export.models.esm1 import ESM1B_MAX_POSITIONS
from bionemo_export.models.esm2 import ALPHABET, MAX_TOKENS
from bionemo_export.models.esmc import MAX_TOKENS as ESMC_MAX_TOKENS
from bionemo_export.models.megamolbart import DEFAULT_VOCAB_SMILES, MegaMolBart, MegaMolBartConfig, save
from bionemo_export.models.prott5 import DEFAULT_MAX_TOKENS, PROTT5_PIECES, T5_EXTRA_IDS, sentencepiece_model
from bionemo_export.serving.tokenizers.smiles import build_vocab

ESM2_35M_SIZES = {"hidden_size": 480, "num_layers": 12, "num_heads": 20, "intermediate_size": 1920}
"""The sizes of the released esm2_t12_35M_UR50D (ESM-2nv 35M): a random model that runs as fast
as the real one, for benchmarks."""
ESMC_300M_SIZES = {"hidden_size": 960, "num_layers": 30, "num_heads": 15, "intermediate_size": 2560}
"""The sizes of the released ESM C 300M (esmc_300m: 960 wide, 30 layers, 15 heads, SwiGLU 8/3 x 960):
a random model that runs as fast as the real one, for benchmarks."""


# ---------------------------------------------------------------------------- configs
def esm2_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                intermediate_size: int = 64) -> transformers.EsmConfig:
    """ESM-2's released settings (rotary positions, 1026 position slots, no LayerNorm before the
    encoder) at a small size."""
    return _esm_config(hidden_size, num_layers, num_heads, intermediate_size, position_embedding_type="rotary",
                       max_position_embeddings=MAX_TOKENS + 2, emb_layer_norm_before=False)


def esm1_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                intermediate_size: int = 64) -> transformers.EsmConfig:
    """The released ESM-1b's settings (esm1b_t33_650M_UR50S: learned absolute positions, a
    LayerNorm before the encoder) at a small size."""
    return _esm_config(hidden_size, num_layers, num_heads, intermediate_size, position_embedding_type="absolute",
                       max_position_embeddings=ESM1B_MAX_POSITIONS, emb_layer_norm_before=True)


def _esm_config(hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                **released: Any) -> transformers.EsmConfig:
    return transformers.EsmConfig(
        vocab_size=len(ALPHABET),
        pad_token_id=ALPHABET.index("<pad>"),
        mask_token_id=ALPHABET.index("<mask>"),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        token_dropout=True,
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **released,
    )


SAPROT_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>",
                *("".join(pair) for pair in itertools.product("ACDEFGHIKLMNPQRSTVWY#", "pynwrqhgdlvtmfsaeikc#"))]
"""SaProt's 446 tokens as its source builds them (utils/esm_loader.py of westlake-repl/SaProt: the
specials, then every residue with every 3Di letter), written here apart from the tokenizer's copy."""


def saprot_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                  intermediate_size: int = 64) -> transformers.EsmConfig:
    """SaProt's released settings (ESM-2's, over the 446-token paired vocabulary) at a small size."""
    config = esm2_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                         intermediate_size=intermediate_size)
    config.vocab_size = len(SAPROT_VOCAB)
    config.pad_token_id = SAPROT_VOCAB.index("<pad>")
    config.mask_token_id = SAPROT_VOCAB.index("<mask>")
    return config


def esmc_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                intermediate_size: int = 64) -> transformers.EsmcConfig:
    """ESM C's released settings (64-token embedding, no linear biases, SwiGLU, 2048 positions) at a
    small size."""
    return transformers.EsmcConfig(vocab_size=64, hidden_size=hidden_size, num_hidden_layers=num_layers,
                                   num_attention_heads=num_heads, intermediate_size=intermediate_size,
                                   max_position_embeddings=ESMC_MAX_TOKENS, pad_token_id=1, mask_token_id=32)


def bert_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4,
                intermediate_size: int = 64) -> transformers.BertConfig:
    """AntiBERTy's configuration and vocabulary layout at a small size."""
    return transformers.BertConfig(
        vocab_size=len(ANTIBERTY_VOCAB),
        pad_token_id=ANTIBERTY_VOCAB.index("[PAD]"),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=512,
        type_vocab_size=2,
        layer_norm_eps=1e-12,
    )


def prott5_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 64,
                  num_decoder_layers: int = 0) -> transformers.T5Config:
    """ProtTrans' ProtT5 (T5 v1: ReLU, 128 ids) at a small size. `num_decoder_layers` > 0 is a
    whole T5ForConditionalGeneration (as Rostlab's prot_t5_xl_uniref50); 0 an encoder alone
    (a T5EncoderModel, as the `-enc` half-precision release), whose config says so as
    T5EncoderModel sets it (`is_encoder_decoder` and `use_cache` false)."""
    encoder_only = {} if num_decoder_layers else {"is_encoder_decoder": False, "use_cache": False}
    # T5Config keeps settings its dataclass fields lack as attributes (config.json has them), so
    # they are passed as a mapping: its signature names only the fields.
    undeclared: dict[str, Any] = {"n_positions": DEFAULT_MAX_TOKENS, "decoder_start_token_id": 0}
    return transformers.T5Config(
        vocab_size=len(PROTT5_PIECES) + T5_EXTRA_IDS,  # 128, as ProtT5's
        d_model=hidden_size, d_kv=hidden_size // num_heads, d_ff=intermediate_size,
        num_layers=num_layers, num_decoder_layers=num_decoder_layers or num_layers, num_heads=num_heads,
        feed_forward_proj="relu", layer_norm_epsilon=1e-6,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0, **encoder_only, **undeclared,
    )


def megamolbart_config(*, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 4) -> MegaMolBartConfig:
    """A small MegaMolBART over the default SMILES vocabulary (`megamolbart_vocab()`)."""
    return MegaMolBartConfig(vocab_size=len(megamolbart_vocab()), hidden_size=hidden_size, num_layers=num_layers,
                             num_heads=num_heads)


def megamolbart_vocab() -> list[str]:
    """The vocabulary random MegaMolBART checkpoints are saved with: the tokens of common SMILES."""
    return build_vocab(DEFAULT_VOCAB_SMILES)


# ---------------------------------------------------------------------------- models and files
def _t5_model(config: transformers.T5Config) -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(config) if config.is_encoder_decoder \
        else transformers.T5EncoderModel(config)


def save_huggingface(model: transformers.PreTrainedModel, out: Path, vocab: Sequence[str]) -> Path:
    """A Hugging Face directory as ESM-2 and BERT checkpoints come: save_pretrained's config.json
    and model.safetensors, and vocab.txt (one token per line, the id being the line number).
    Returns `out`."""
    model.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
    return out


def _with_vocab(vocab: Sequence[str]) -> Callable[[Any, Path], None]:
    def write(model: Any, out: Path) -> None:
        save_huggingface(model, out, vocab)
    return write


def _save_esmc(model: Any, out: Path) -> None:
    """ESM C's Hugging Face folder: save_pretrained's files and transformers' own EsmcTokenizer files."""
    model.save_pretrained(out)
    transformers.EsmcTokenizer().save_pretrained(out)


def _save_prott5(model: Any, out: Path) -> None:
    """ProtTrans' folder: save_pretrained's files and spiece.model (written without sentencepiece)."""
    model.save_pretrained(out)
    (out / "spiece.model").write_bytes(sentencepiece_model(PROTT5_PIECES, unk="<unk>", pad="<pad>", eos="</s>"))


def _save_megamolbart(model: Any, out: Path) -> None:
    """The project's own MegaMolBART directory (models/megamolbart.py's `save`)."""
    save(model, megamolbart_vocab(), out)


@dataclass(frozen=True)
class TinyFamily:
    """How random checkpoints of one model family are made."""

    config: Callable[..., Any]
    """Keyword sizes (each with a small default) -> the family's config: `tiny_config`."""
    model: Callable[[Any], torch.nn.Module]
    """A config -> a randomly initialised model of it (called under the seed)."""
    save: Callable[[Any, Path], None]
    """Write that model into an existing folder, in a form the family's `load()` reads."""


FAMILIES: dict[str, TinyFamily] = {
    "esm2": TinyFamily(esm2_config, transformers.EsmForMaskedLM, _with_vocab(ALPHABET)),
    "esm1": TinyFamily(esm1_config, transformers.EsmForMaskedLM, _with_vocab(ALPHABET)),
    "saprot": TinyFamily(saprot_config, transformers.EsmForMaskedLM, _with_vocab(SAPROT_VOCAB)),
    "esmc": TinyFamily(esmc_config, transformers.EsmcForMaskedLM, _save_esmc),
    "bert": TinyFamily(bert_config, transformers.BertForMaskedLM, _with_vocab(ANTIBERTY_VOCAB)),
    "prott5": TinyFamily(prott5_config, _t5_model, _save_prott5),
    "megamolbart": TinyFamily(megamolbart_config, MegaMolBart, _save_megamolbart),
}
"""One entry per registered model family (models/ REGISTRY): adding a family is adding its entry."""


def _entry(family: str) -> TinyFamily:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(f"no random checkpoints for model family {family!r}; known: {', '.join(sorted(FAMILIES))} "
                         "(add the family's entry to FAMILIES in bionemo_export/testing/checkpoints.py)") from None


def tiny_config(family: str, **sizes: int) -> Any:
    """The config of a small `family` model: its released settings at `sizes` (hidden_size,
    num_layers, num_heads, ...: the keywords of that family's `<family>_config` function)."""
    return _entry(family).config(**sizes)


def save_random_checkpoint(family: str, out: Path | str, seed: int = 0, **sizes: int) -> Path:
    """Write a randomly initialised `family` model of `tiny_config(family, **sizes)` to the folder
    `out` (created if missing) in a form the family's `load()` reads; returns `out` as a Path.
    The caller's random state is left as it was."""
    entry = _entry(family)
    config = entry.config(**sizes)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():  # seed the initialisation without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = entry.model(config)
    entry.save(model, out)
    return out


CONTACT_HEAD_KEYS = ("esm.contact_head.regression.weight", "esm.contact_head.regression.bias")
"""An EsmForMaskedLM checkpoint's contact head (every saved ESM model has one)."""


def set_contact_head(checkpoint: Path | str, seed: int = 0, scale: float | None = 1000.0) -> Path:
    """Rewrite the contact head of a random ESM checkpoint (save_random_checkpoint's esm2 or esm1):
    `scale` None removes its keys (a checkpoint without the head); a number gives it weights of
    that standard deviation, drawn under `seed`. A random model's contact features (its attention,
    symmetrized and corrected) are of order 1e-3, so the head transformers initialises answers 0.5
    everywhere; a scale of 1000 spreads the probabilities over (0, 1), so a test can tell maps
    apart. Returns the checkpoint's folder."""
    from safetensors.torch import load_file, save_file

    path = Path(checkpoint) / "model.safetensors"
    weights = load_file(path)
    if scale is None:
        weights = {key: tensor for key, tensor in weights.items() if key not in CONTACT_HEAD_KEYS}
    else:
        generator = torch.Generator().manual_seed(seed)
        weight = weights[CONTACT_HEAD_KEYS[0]]
        weights[CONTACT_HEAD_KEYS[0]] = torch.randn(weight.shape, generator=generator) * scale
        weights[CONTACT_HEAD_KEYS[1]] = torch.full_like(weights[CONTACT_HEAD_KEYS[1]], -0.5)
    save_file(weights, path, metadata={"format": "pt"})
    return Path(checkpoint)
