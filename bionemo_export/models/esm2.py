"""ESM-2 (rotary positions, pre-LN), read into transformers' `EsmModel` from a Hugging Face
directory or from a BioNeMo ESM-2nv `.nemo` archive (Megatron BERT layout, mapped key by key to
Hugging Face's names as docs/reference/checkpoint-layouts.md documents). The masked-LM head
(`EsmForMaskedLM`'s `lm_head`, the archive's `model.lm_head`) becomes `LoadedModel.lm_head`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import transformers

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.base import ModelDescription, leave_out, register
from bionemo_export.models.encoder import (
    HuggingFaceEncoderFamily,
    token_limit,
)
from bionemo_export.models.fair_esm import as_huggingface, family_of
from bionemo_export.models.lm_head import HeadWeights
from bionemo_export.models.megatron import check_gelu, cut_vocab, fused_bias_gelu, megatron_lm_head, rename, split_fused
from bionemo_export.models.megatron_core import esm2_settings, esm2_weights
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.nemo import setting
from bionemo_export.models.transformer_engine_esm import check_tokenizer_json, nv_esm_config, nv_esm_weights
from bionemo_export.serving.tokenizers.character import MASK_CHAR, CharacterTokenizer
from bionemo_export.serving.tokenizers.structure_aware import PAIRED_TOKENS, paired_tokens
from bionemo_export.tasks import Requirement

if TYPE_CHECKING:
    from transformers.models.esm.modeling_esm import EsmIntermediate

RESIDUES = "LAGVSERTIDPKQNFYMHWCXBUZO"
ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>", *RESIDUES, ".", "-", "<null_1>", "<mask>"]
"""The 33 ESM-2 token ids, in order (docs/reference/tokenizers.md)."""
MAX_TOKENS = 1024
"""ESM-2's length limit: <cls> + 1022 residues + <eos>."""
ESM_CLASSIFIER_RENAMES = {
    "sequence": {"classifier.dense.weight": "dense.weight", "classifier.dense.bias": "dense.bias",
                 "classifier.out_proj.weight": "out.weight", "classifier.out_proj.bias": "out.bias"},
    "token": {"classifier.weight": "out.weight", "classifier.bias": "out.bias"},
}
"""transformers' ESM fine-tuned heads (EsmFor* and EsmcFor*: the same classes): the sequence head's
EsmClassificationHead (dense -> tanh -> out_proj on <cls>), the token head's Linear."""


def esm_classifier_kind(keys: Any) -> str | None:
    """"sequence" or "token" from the fine-tuned head's keys (without config.json's architectures), None without one."""
    if "classifier.out_proj.weight" in keys or "classifier.dense.weight" in keys:
        return "sequence"
    return "token" if "classifier.weight" in keys else None


@register
class Esm2Family(HuggingFaceEncoderFamily):
    name = "esm2"
    may_carry = frozenset({Requirement.ENCODER, Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES,
                           Requirement.CLASSIFIER, Requirement.CONTACT_HEAD, Requirement.ATTENTION_PROBABILITIES})
    """heads where the checkpoint has them (contact head: Hugging Face directories' `contact_head.regression`);
    attention probabilities where it is read into transformers."""
    claimed_forms = ("nv_esm",)  # NVIDIA's nv_esm directories: config.json's model_type
    description = ("ESM-2 protein language model (rotary positions, pre-LN): Hugging Face EsmModel, BioNeMo ESM-2nv "
                   ".nemo (model-parallel too), BioNeMo 2 / NeMo 2 directory, NVIDIA's nv_esm directory, "
                   "fair-esm .pt file")
    model_type = "esm"
    config_class = transformers.EsmConfig
    backbone_class = transformers.EsmModel
    key_prefix = "esm."
    unused_prefixes = ("lm_head.", "contact_head.", "classifier.")
    head_prefix = "lm_head."
    contact_prefix = "contact_head."

    @classmethod
    def claims(cls, checkpoint: Checkpoint) -> bool:
        """Also a fair-esm file of this family's architecture (ESM-2; ESM-1b/1v for esm1)."""
        return super().claims(checkpoint) or (checkpoint.form == "fair_esm" and family_of(checkpoint) == cls.name)

    classifier_renames = ESM_CLASSIFIER_RENAMES

    def guess_classifier(self, keys: Any) -> str | None:
        return esm_classifier_kind(keys)

    nemo_targets = ("ESM2nvModel", "ESM2Config")
    """.nemo targets, and the config class a NeMo 2 directory's context/model.yaml names."""

    position_embedding_type = "rotary"
    """What config.json must say (ESM-1b-style directories say "absolute": the esm1 family)."""

    def huggingface_config(self, checkpoint: Checkpoint) -> Any:
        config = super().huggingface_config(checkpoint)
        if config.position_embedding_type != self.position_embedding_type:
            other = "esm1" if config.position_embedding_type == "absolute" else "esm2"
            raise CheckpointError(f"{checkpoint.path / 'config.json'}: position_embedding_type is "
                                  f"{config.position_embedding_type!r}, not {self.position_embedding_type!r}: "
                                  f"use `family` {other}")
        return config

    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> CharacterTokenizer:
        check_alphabet(checkpoint)
        return esm_tokenizer(token_limit(MAX_TOKENS, max_length, "ESM-2"))

    def head_settings(self, weights: dict[str, torch.Tensor], names: dict[str, str], config: Any,
                      checkpoint: Checkpoint) -> HeadWeights:
        """EsmLMHead: exact GELU, the config's epsilon, decoder tied to the word embeddings
        (unless the config unties them)."""
        return HeadWeights(weights, names, activation="gelu", layer_norm_eps=float(config.layer_norm_eps),
                           tied=bool(getattr(config, "tie_word_embeddings", True)))

    def from_nemo(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """An ESM-2nv archive. Its tokenizer is named by Hugging Face model name (not in the
        archive): the fixed ESM-2 alphabet applies."""
        source = f"{checkpoint.path}:model_config.yaml"
        position = setting(checkpoint, "position_embedding_type", default="rope")
        if position != "rope":
            raise CheckpointError(f"{source}: position_embedding_type is {position!r}; ESM-2nv uses 'rope'")
        heads = int(setting(checkpoint, "num_attention_heads"))
        layers = int(setting(checkpoint, "num_layers"))
        hidden = int(setting(checkpoint, "hidden_size"))
        exact = bool(setting(checkpoint, "esm_gelu", default=False))
        activation = "gelu" if exact else check_gelu(
            setting(checkpoint, "activation", default="gelu"), fused_bias_gelu(checkpoint), source)
        seq_length = int(setting(checkpoint, "seq_length", default=MAX_TOKENS))
        config = transformers.EsmConfig(
            vocab_size=len(ALPHABET),
            pad_token_id=ALPHABET.index("<pad>"),
            mask_token_id=ALPHABET.index("<mask>"),
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=int(setting(checkpoint, "ffn_hidden_size", default=4 * hidden)),
            position_embedding_type="rotary",
            max_position_embeddings=int(setting(checkpoint, "max_position_embeddings", default=seq_length)),
            token_dropout=bool(setting(checkpoint, "embedding_token_dropout", default=False)),
            emb_layer_norm_before=False,
            layer_norm_eps=float(setting(checkpoint, "layernorm_epsilon", default=1e-5)),
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        config.gelu_approximate = "tanh" if activation == "gelu_tanh" else "none"
        tokenizer = esm_tokenizer(token_limit(min(seq_length, MAX_TOKENS), max_length, "this ESM-2nv model"))
        weights, head = _megatron_to_huggingface(checkpoint, config)
        return ModelDescription(checkpoint, config, tokenizer, weights,
                                facts={"nemo_target": checkpoint.model_class, "activation": activation},
                                lm_head=head)

    def from_fair_esm(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """A fair-esm .pt file (ESM-2 here; ESM-1b and ESM-1v in the esm1 family), read as the
        EsmForMaskedLM checkpoint it maps to key by key (models/fair_esm.py)."""
        return self.from_huggingface(as_huggingface(checkpoint, self.name), max_length)

    def from_nv_esm(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """NVIDIA's TransformerEngine ESM-2 directory (bionemo-recipes; the layout and what it
        computes: models/transformer_engine_esm.py), under EsmModel's names; the encoder's MLP
        keeps TransformerEngine's tanh GELU. Its tokenizer files must be the ESM-2 alphabet."""
        config = nv_esm_config(checkpoint, ALPHABET)
        found = nv_esm_weights(checkpoint, config)
        check_tokenizer_json(checkpoint, ALPHABET)
        tokenizer = self.build_tokenizer(checkpoint, config, max_length)  # checks vocab.txt
        return ModelDescription(checkpoint, config, tokenizer, found.backbone, facts=found.facts,
                                lm_head=found.head, classifier=found.classifier)

    def from_nemo2(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        """A BioNeMo 2 / NeMo 2 ESM-2 directory: its settings from context/model.yaml, its
        Megatron-core weights under EsmModel's names (models/megatron_core.py). Its tokenizer is
        named by class, not stored: the fixed ESM-2 alphabet applies."""
        settings = esm2_settings(checkpoint)
        config = transformers.EsmConfig(
            vocab_size=len(ALPHABET),
            pad_token_id=ALPHABET.index("<pad>"),
            mask_token_id=ALPHABET.index("<mask>"),
            hidden_size=settings.hidden_size,
            num_hidden_layers=settings.num_layers,
            num_attention_heads=settings.num_heads,
            intermediate_size=settings.ffn_hidden_size,
            position_embedding_type="rotary",
            max_position_embeddings=settings.seq_length,
            token_dropout=settings.token_dropout,
            emb_layer_norm_before=False,
            layer_norm_eps=settings.layer_norm_eps,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        config.gelu_approximate = "tanh" if settings.activation == "gelu_tanh" else "none"
        tokenizer = esm_tokenizer(token_limit(min(settings.seq_length, MAX_TOKENS), max_length, "this ESM-2 model"))
        weights, head = esm2_weights(checkpoint, settings, len(ALPHABET))
        return ModelDescription(checkpoint, config, tokenizer, weights, lm_head=head,
                                facts={"nemo2_config": checkpoint.model_class, "activation": settings.activation})

    def make_backbone(self, config: Any) -> torch.nn.Module:
        backbone = super().make_backbone(config)
        if getattr(config, "gelu_approximate", "none") == "tanh":
            # A transformers EsmModel: gelu_approximate is set on the EsmConfigs of Megatron checkpoints.
            for layer in cast(transformers.EsmModel, backbone).encoder.layer:
                dense = cast("EsmIntermediate", layer.intermediate).dense
                layer.intermediate = _TanhGeluIntermediate(dense)
        return backbone

    def sample_sequences(self) -> list[str]:
        return [
            "MKTAY",
            "MSLKRKNIALIPAAGIGVRFG",
            "FVNQHLCGSHLVEALYLVCGERGFFYTPKT",
            "LAGVSERTIDPKQNFYMHWCXBUZO",  # every residue letter, rare ones included
            "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG",
            "MSKGEELFTGVVPILVELDGDVNGHKFSVSGEGEGDATYGKLTLKFICTTGKLPVPWPTLVTTFSYGVQCFSRYPDHMKQ"
            "HDFFKSAMPEGYVQERTIFFKDDGNYKTRAEVKFEGDTLV",
        ]


def esm_tokenizer(max_length: int) -> CharacterTokenizer:
    """<cls> + residues + <eos> over the 33-token ESM alphabet (ESM-2, and ESM-1b in Hugging Face form)."""
    return CharacterTokenizer(ALPHABET, residues=RESIDUES, pad_token="<pad>", bos_token="<cls>",
                              eos_token="<eos>", unk_token="<unk>", max_length=max_length,
                              mask_token="<mask>", mask_char=MASK_CHAR)


class _TanhGeluIntermediate(torch.nn.Module):
    """EsmIntermediate with the tanh approximation of GELU (Megatron's fused bias-GELU)."""

    def __init__(self, dense: torch.nn.Linear) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.dense(hidden_states), approximate="tanh")


def _megatron_to_huggingface(checkpoint: Checkpoint, config: transformers.EsmConfig
                             ) -> tuple[dict[str, torch.Tensor], HeadWeights | None]:
    """ESM-2nv's Megatron BERT keys -> EsmModel's (docs/reference/checkpoint-layouts.md's table): fused QKV
    split per head, the word embeddings cut from 128 padded rows to 33; the LM head taken apart
    (its bias is cut like the embeddings when the head is built)."""
    source = checkpoint.weights_path
    weights = {key.removeprefix("model."): tensor for key, tensor in checkpoint.weights.items()}
    weights, head = megatron_lm_head(weights, checkpoint)
    inv_freq = weights.pop("language_model.rotary_pos_emb.inv_freq", None)
    _check_rotary(inv_freq, config, source)
    if inv_freq is not None:
        leave_out("model.language_model.rotary_pos_emb.inv_freq",
                  "the rotary table: checked, and computed from the config")
    weights = split_fused(weights, config.num_attention_heads, source)
    table = [("language_model.embedding.word_embeddings.", "embeddings.word_embeddings."),
             ("language_model.encoder.final_layernorm.", "encoder.emb_layer_norm_after.")]
    for i in range(config.num_hidden_layers):
        old, new = f"language_model.encoder.layers.{i}.", f"encoder.layer.{i}."
        table += [(old + "input_layernorm.", new + "attention.LayerNorm."),
                  (old + "self_attention.query.", new + "attention.self.query."),
                  (old + "self_attention.key.", new + "attention.self.key."),
                  (old + "self_attention.value.", new + "attention.self.value."),
                  (old + "self_attention.dense.", new + "attention.output.dense."),
                  (old + "post_attention_layernorm.", new + "LayerNorm."),
                  (old + "mlp.dense_h_to_4h.", new + "intermediate.dense."),
                  (old + "mlp.dense_4h_to_h.", new + "output.dense.")]
    weights = rename(weights, table, drop=("lm_head.", "language_model.pooler.", "binary_head."))
    key = "embeddings.word_embeddings.weight"
    if key in weights:
        assert config.vocab_size is not None  # the caller's config sets it (len(ALPHABET))
        weights[key] = cut_vocab(weights[key], config.vocab_size,
                                 "model.language_model.embedding.word_embeddings.weight", source)
    return weights, head


def _check_rotary(inv_freq: torch.Tensor | None, config: transformers.EsmConfig, source: str) -> None:
    """The archive's rotary frequencies must be the standard ones EsmModel computes."""
    if inv_freq is None:
        return
    head_dim = config.hidden_size // config.num_attention_heads
    expected = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    # megatron_amp_O2 archives hold it in half precision, as every floating buffer: within that precision
    rtol = max(1e-4, torch.finfo(inv_freq.dtype).eps) if inv_freq.is_floating_point() else 1e-4
    if inv_freq.shape != expected.shape or not torch.allclose(inv_freq.float(), expected, rtol=rtol):
        raise CheckpointError(f"{source}: model.language_model.rotary_pos_emb.inv_freq is not the standard "
                              f"rotary frequency table for head size {head_dim}")


def check_alphabet(checkpoint: Checkpoint) -> None:
    """A checkpoint's vocab.txt, where it has one, must be the ESM-2 alphabet, or its token ids
    would be wrong."""
    vocab = checkpoint.lines("vocab.txt", "vocabulary")
    if vocab is None or vocab == ALPHABET:
        return
    vocab_file = checkpoint.path / "vocab.txt"
    if paired_tokens(vocab) >= PAIRED_TOKENS:
        raise InvalidInputError(f"{vocab_file} pairs residues with Foldseek 3Di letters (SaProt's vocabulary), not "
                                "the ESM-2 alphabet: use `family` saprot")
    for line, (got, want) in enumerate(zip(vocab, ALPHABET), start=1):
        if got != want:
            raise InvalidInputError(
                f"{vocab_file} is not the ESM-2 alphabet: line {line} is {got!r}, expected {want!r}"
            )
    raise InvalidInputError(
        f"{vocab_file} has {len(vocab)} tokens; the ESM-2 alphabet has {len(ALPHABET)}"
    )
