"""SaProt (westlake-repl/SaProt: SaProt 35M / 650M, AF2 and PDB): an ESM-2 network whose vocabulary
pairs each residue with a Foldseek 3Di structure letter, read from its Hugging Face directory
(`EsmForMaskedLM`, model_type `esm`, a vocab.txt of 446 paired tokens).

The network is transformers' own `EsmModel`, exactly as ESM-2's; only the tokenizer and the
masked-LM alphabet differ:

- the tokenizer (tokenizers/structure_aware.py) reads structure-aware sequences (`MdEvVp`: each
  residue followed by its 3Di letter, `#` for an unknown structure, `#` as the residue for a masked
  one) and plain ones (`MEV`, read as `M# E# V#`), one token per residue;
- the masked-LM head (EsmForMaskedLM's `lm_head`, as ESM-2's) is served over the 20 amino acids:
  the log-probability of a residue is the log of the SUM of the probabilities of its 21 tokens
  (one per 3Di letter and `#`), with the softmax over the 420 amino-acid tokens (specials and the
  masked-residue tokens `#?` excluded). That marginal is what SaProt's zero-shot mutation score
  reads (`SaprotFoldseekMutationModel.predict_mut`: `probs[pos, st: st + 21].sum()`), and a
  ratio of two residues' marginals does not depend on which tokens the softmax ran over;
- N_scores' default method with variants is SaProt's: `variant-masked` (serving/scoring.py).

The family reads the directory only when its vocab.txt is SaProt's (checked token by token), and
`--model` may be left out for such a directory (`base.huggingface_family`); the esm2 family refuses
it, naming this family.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from bionemo_export.models.base import ModelDescription, register
from bionemo_export.models.encoder import HuggingFaceEncoderFamily, token_limit, word_embeddings
from bionemo_export.models.esm2 import ESM_CLASSIFIER_RENAMES, esm_classifier_kind
from bionemo_export.models.lm_head import HeadWeights, MaskedLMHead, build_lm_head
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.serving.tokenizers.structure_aware import (
    PAIRED_TOKENS,
    StructureAwareTokenizer,
    paired_tokens,
    saprot_vocabulary,
)
from bionemo_export.tasks import Requirement

MAX_TOKENS = 1024
"""SaProt's length limit, ESM-2's: <cls> + 1022 residues + <eos> (1026 position slots)."""
VOCAB_SIZE = 446


def looks_paired(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint's vocab.txt is a residue/3Di pair vocabulary (SaProt's, or a damaged
    copy that the family then refuses with the reason): at least PAIRED_TOKENS such tokens."""
    try:
        return paired_tokens(checkpoint.lines("vocab.txt") or []) >= PAIRED_TOKENS
    except CheckpointError:  # not UTF-8 text
        return False


def check_vocab(checkpoint: Checkpoint) -> None:
    """CheckpointError unless the checkpoint's vocab.txt is SaProt's 446 tokens in SaProt's order."""
    vocab_file, vocab = checkpoint.path / "vocab.txt", checkpoint.lines("vocab.txt", "vocabulary")
    if vocab is None:
        raise CheckpointError(f"{vocab_file} is missing: a SaProt directory carries its vocab.txt of 446 residue/3Di "
                              "tokens (the token ids depend on it)")
    expected = saprot_vocabulary()
    for line, (got, want) in enumerate(zip(vocab, expected), start=1):
        if got != want:
            raise CheckpointError(f"{vocab_file} is not SaProt's vocabulary: line {line} is {got!r}, expected "
                                  f"{want!r} (5 specials, then each residue of ACDEFGHIKLMNPQRSTVWY# with each 3Di "
                                  "letter of pynwrqhgdlvtmfsaeikc#)")
    if len(vocab) != len(expected):
        raise CheckpointError(f"{vocab_file} has {len(vocab)} tokens; SaProt's vocabulary has {len(expected)}")


class StructureMarginalHead(torch.nn.Module):
    """forward(hiddens FP32 [B, L, H]) -> log_probs FP32 [B, L, 20]: EsmForMaskedLM's head
    (MaskedLMHead over the 420 amino-acid tokens, a log_softmax over them), then each residue's 21
    structure tokens summed in probability (logsumexp). Tensor operations only."""

    def __init__(self, head: MaskedLMHead, alphabet: tuple[str, ...], group: int) -> None:
        super().__init__()
        if len(head.alphabet) != len(alphabet) * group:
            raise ValueError(f"a head over {len(head.alphabet)} tokens is not {len(alphabet)} residues x {group}")
        self.head, self.alphabet, self.group = head, alphabet, group

    @property
    def alphabet_ids(self) -> tuple[int, ...]:
        """The tokens of every residue's group, residue-major (what the inner head's rows are)."""
        return self.head.alphabet_ids

    def forward(self, hiddens: torch.Tensor) -> torch.Tensor:
        return self.head(hiddens).unflatten(-1, (len(self.alphabet), self.group)).logsumexp(dim=-1)


@register
class SaprotFamily(HuggingFaceEncoderFamily):
    name = "saprot"
    may_carry = frozenset({Requirement.ENCODER, Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES,
                           Requirement.CLASSIFIER, Requirement.ATTENTION_PROBABILITIES})
    """its masked-LM head and a fine-tuned head (EsmForSequenceClassification / EsmForTokenClassification) where the
    checkpoint has them."""

    @classmethod
    def claims(cls, checkpoint: Checkpoint) -> bool:
        """A Hugging Face ESM directory whose vocab.txt pairs residues with 3Di letters."""
        return (checkpoint.form == "huggingface" and checkpoint.model_class in ("esm", None)
                and looks_paired(checkpoint))

    description = ("SaProt structure-aware protein language model (ESM-2 over residue + Foldseek 3Di tokens): "
                   "Hugging Face EsmForMaskedLM directory")
    model_type = "esm"
    config_class = transformers.EsmConfig
    backbone_class = transformers.EsmModel
    key_prefix = "esm."
    unused_prefixes = ("lm_head.", "contact_head.", "classifier.")
    head_prefix = "lm_head."
    classifier_renames = ESM_CLASSIFIER_RENAMES
    scoring_default = "variant-masked"
    """N_scores' method for variants when the request names none: SaProt's predict_mut."""

    def guess_classifier(self, keys: Any) -> str | None:
        return esm_classifier_kind(keys)

    def huggingface_config(self, checkpoint: Checkpoint) -> Any:
        config = super().huggingface_config(checkpoint)
        source = checkpoint.path / "config.json"
        if config.position_embedding_type != "rotary":
            raise CheckpointError(f"{source}: position_embedding_type is {config.position_embedding_type!r}; SaProt "
                                  "is ESM-2 with rotary positions")
        if config.vocab_size != VOCAB_SIZE:
            raise CheckpointError(f"{source}: vocab_size is {config.vocab_size}; SaProt's vocabulary has {VOCAB_SIZE} "
                                  "tokens")
        return config

    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> StructureAwareTokenizer:
        check_vocab(checkpoint)
        positions = int(getattr(config, "max_position_embeddings", MAX_TOKENS + 2) or MAX_TOKENS + 2)
        limit = min(MAX_TOKENS, positions - 2)
        return StructureAwareTokenizer(saprot_vocabulary(), max_length=token_limit(limit, max_length, "SaProt"))

    def head_settings(self, weights: dict[str, torch.Tensor], names: dict[str, str], config: Any,
                      checkpoint: Checkpoint) -> HeadWeights:
        """EsmLMHead: exact GELU, the config's epsilon, decoder tied to the word embeddings."""
        return HeadWeights(weights, names, activation="gelu", layer_norm_eps=float(config.layer_norm_eps),
                           tied=bool(getattr(config, "tie_word_embeddings", True)))

    def make_lm_head(self, description: ModelDescription, backbone: torch.nn.Module) -> Any:
        """The head over the 420 amino-acid tokens, marginalized over the structure letters."""
        head = description.lm_head
        if head is None:
            return None
        tokenizer = description.tokenizer
        assert isinstance(tokenizer, StructureAwareTokenizer)  # build_tokenizer's
        groups = tokenizer.structure_groups()
        ids = [token for group in groups for token in group]
        inner = build_lm_head(head.weights, word_embeddings(backbone), alphabet=[tokenizer.vocab[i] for i in ids],
                              alphabet_ids=ids, layer_norm_eps=head.layer_norm_eps, activation=head.activation,
                              tied=head.tied, source=description.checkpoint.weights_path, names=head.names)
        return StructureMarginalHead(inner, tokenizer.alphabet, len(groups[0])).eval()

    def sample_sequences(self) -> list[str]:
        return [
            "MKTAY",  # plain first: export checks mask it by prefixing '#'
            "MdEvVpLgKa",
            "MSLKRKNIALIPAAGIGVRFG",
            "FpVyNnQwHrLqChGgSdHlLvVtEmAfLsYaLeViCkGcE#RpGyFnFwYrTqPhKg",
            "ACDEFGHIKLMNPQRSTVWY",  # every residue
            "M#Q#I#F#V#K#T#L#T#G#K#T#I#T#L#E#V#E#P#S#D#T#I#E#N#V#K#A#K#I#Q#D#K#E#G#I#P#P#D#Q#",
            "MSKGEELFTGVVPILVELDGDVNGHKFSVSGEGEGDATYGKLTLKFICTTGKLPVPWPTLVTTFSYGVQCFSRYPDHMKQ"
            "HDFFKSAMPEGYVQERTIFFKDDGNYKTRAEVKFEGDTLV",
        ]
