"""BERT language models from a Hugging Face directory, read into `BertModel`: protein LMs
(AntiBERTy, ProtBert) and reaction-SMILES models (rxnfp). The real AntiBERTy ships inside the
`antiberty==0.1.3` wheel (see antiberty_checkpoint), rxnfp's BERTs inside `rxnfp==0.1.0`
(see rxnfp_checkpoint).

The vocabulary decides the tokenizer (see `is_smiles_vocab`): a SMILES vocabulary gets the regex
SmilesTokenizer with rxnfp's reaction pattern, [CLS]/[SEP] around each sequence and [PAD]; any other
the one-character-per-residue CharacterTokenizer. Both accept the mask character (`_`) where the
vocabulary has `[MASK]`. A checkpoint with BERT's masked-LM head (`cls.predictions`: AntiBERTy,
rxnfp's bert_pretrained, BertForMaskedLM) gets it as `LoadedModel.lm_head`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.base import LoadedModel, ModelDescription, register
from bionemo_export.models.encoder import (
    HuggingFaceEncoderFamily,
    token_limit,
)
from bionemo_export.models.lm_head import HeadWeights, huggingface_activation
from bionemo_export.models.readers import Checkpoint
from bionemo_export.models.readers.base import MAX_SIDE_FILE_BYTES
from bionemo_export.serving.tokenizers.character import MASK_CHAR, CharacterTokenizer, find_mask_token
from bionemo_export.serving.tokenizers.smiles import REACTION_SMILES_PATTERN, SmilesTokenizer
from bionemo_export.tasks import Requirement

SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "bos": "[CLS]", "eos": "[SEP]"}
RARE_RESIDUES = "UZOB"
"""Mapped to X when the vocabulary has X, as ProtBert's authors prescribe."""
ANTIBERTY_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"ACDEFGHIKLMNPQRSTVWY"]
ALPHABETS = ("protein", "smiles")

SMILES_BRANCH_TOKENS = ("(", ")")
"""A vocabulary holding both is a SMILES vocabulary (see is_smiles_vocab)."""

RXNFP_VARIANTS = ("bert_pretrained", "bert_ft", "bert_ft_10k_25s")
"""The BERT folders under rxnfp/models/transformers/ in the rxnfp==0.1.0 wheel."""

SAMPLE_SMILES = (
    "CCO",
    "c1ccccc1",
    "CC(=O)O.OCC>>CC(=O)OCC",  # Fischer esterification
    "CC(=O)Oc1ccccc1C(=O)O",  # aspirin
    "CN1C=NC2=C1C(=O)N(C(=O)N2C)C",  # caffeine
    "Brc1ccccc1.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1",  # Suzuki coupling
    "CC(C)(C)OC(=O)N1CCC(C(=O)O)CC1.Cl.O1CCOCC1>>O=C(O)C1CCNCC1",  # Boc removal, reagents
    "C[C@@H](N)C(=O)O.[Na+].[OH-]>>C[C@@H](N)C(=O)[O-].[Na+]",  # bracket atoms, chirality
    "COc1ccc(CC(=O)N[C@@H](Cc2ccccc2)C(=O)OC)cc1.O=C(O)C(F)(F)F.ClCCl>>COc1ccc(CC(=O)N[C@@H]"
    "(Cc2ccccc2)C(=O)O)cc1",
)
"""Molecules and reactions of varied lengths for SMILES BERTs (every token in rxnfp's vocabulary)."""


def is_smiles_vocab(vocab: Sequence[str]) -> bool:
    """Whether a BERT vocabulary is for SMILES: it holds both branch tokens "(" and ")". Every
    SMILES vocabulary has them (branches are in nearly every molecule); protein vocabularies
    (AntiBERTy, ProtBert: letters and [..] specials) never do."""
    return all(token in vocab for token in SMILES_BRANCH_TOKENS)


@register
class BertFamily(HuggingFaceEncoderFamily):
    name = "bert"
    may_carry = frozenset({Requirement.ENCODER, Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES,
                           Requirement.CLASSIFIER, Requirement.ATTENTION_PROBABILITIES})
    """a masked-LM head and a fine-tuned head where the checkpoint has them; transformers' attention."""
    description = "BERT language models: protein (AntiBERTy, ProtBert), reaction SMILES (rxnfp); Hugging Face BertModel"
    model_type = "bert"
    config_class = transformers.BertConfig
    backbone_class = transformers.BertModel
    key_prefix = "bert."
    unused_prefixes = ("pooler.", "cls.", "classifier.")
    head_prefix = "cls.predictions."
    head_renames = {"transform.dense.weight": "dense.weight", "transform.dense.bias": "dense.bias",
                    "transform.LayerNorm.weight": "layer_norm.weight", "transform.LayerNorm.bias": "layer_norm.bias"}
    classifier_renames = {
        "sequence": {"pooler.dense.weight": "dense.weight", "pooler.dense.bias": "dense.bias",
                     "classifier.weight": "out.weight", "classifier.bias": "out.bias"},
        "token": {"classifier.weight": "out.weight", "classifier.bias": "out.bias"},
    }
    """BertForSequenceClassification pools [CLS] (bert.pooler.dense + tanh) into `classifier`;
    BertForTokenClassification applies `classifier` to every token."""

    def guess_classifier(self, keys: Any) -> str | None:
        if "classifier.weight" not in keys:
            return None
        return "sequence" if "pooler.dense.weight" in keys else "token"

    def __init__(self, alphabet: str = "protein") -> None:
        """`alphabet` ("protein" or "smiles") decides what sample_sequences() returns; build()
        gives its LoadedModel a family with the alphabet of the checkpoint's vocabulary."""
        if alphabet not in ALPHABETS:
            raise ValueError(f"alphabet must be one of {ALPHABETS}, got {alphabet!r}")
        self.alphabet = alphabet

    def build(self, description: ModelDescription) -> LoadedModel:
        loaded = super().build(description)
        alphabet = "smiles" if isinstance(loaded.tokenizer, SmilesTokenizer) else "protein"
        if alphabet != self.alphabet:  # loaded.family.sample_sequences() then fits the tokenizer
            loaded = dataclasses.replace(loaded, family=type(self)(alphabet))
        return loaded

    def head_settings(self, weights: dict[str, torch.Tensor], names: dict[str, str], config: Any,
                      checkpoint: Checkpoint) -> HeadWeights:
        """BertLMPredictionHead: `config.hidden_act`, the config's epsilon, decoder tied to the word
        embeddings unless `tie_word_embeddings` is false. Its `decoder.bias` is tied to
        `cls.predictions.bias` (old files hold both): the latter is used, the former when alone."""
        decoder_bias = weights.pop("decoder.bias", None)
        decoder_bias_name = names.pop("decoder.bias", "decoder.bias")
        if "bias" not in weights and decoder_bias is not None:
            weights["bias"], names["bias"] = decoder_bias, decoder_bias_name
        activation = huggingface_activation(config.hidden_act, str(checkpoint.path / "config.json"))
        return HeadWeights(weights, names, activation=activation, layer_norm_eps=float(config.layer_norm_eps),
                           tied=bool(getattr(config, "tie_word_embeddings", True)))

    def build_tokenizer(
        self, checkpoint: Checkpoint, config: Any, max_length: int | None
    ) -> CharacterTokenizer | SmilesTokenizer:
        vocab_file, vocab = _vocabulary(checkpoint)
        missing = [token for token in SPECIAL_TOKENS.values() if token not in vocab]
        if missing:
            raise InvalidInputError(f"{vocab_file} lacks the special tokens {missing}")
        mask_token = find_mask_token(vocab)
        mask = {"mask_token": mask_token, "mask_char": MASK_CHAR if mask_token else None}
        if is_smiles_vocab(vocab):
            # rxnfp's tokenization: its regex, ids in vocab.txt order, [CLS] + tokens + [SEP].
            # A token missing from the vocabulary is an error naming it, never [UNK].
            return SmilesTokenizer(
                vocab,
                max_length=token_limit(config.max_position_embeddings, max_length, "this BERT model"),
                pattern=REACTION_SMILES_PATTERN,
                pad_token=SPECIAL_TOKENS["pad"],
                unk_token=SPECIAL_TOKENS["unk"],
                bos_token=SPECIAL_TOKENS["bos"],
                eos_token=SPECIAL_TOKENS["eos"],
                begin_token=None,
                end_token=None,
                **mask,
            )
        residues = "".join(t for t in vocab if len(t) == 1 and t.isascii() and t.isalpha())
        if not residues:
            raise InvalidInputError(f"{vocab_file} has no single-letter residue tokens")
        aliases = {}
        if "X" in vocab:
            aliases = {rare: "X" for rare in RARE_RESIDUES}
            residues += "".join(rare for rare in RARE_RESIDUES if rare not in residues)
        return CharacterTokenizer(
            vocab,
            residues=residues,
            pad_token=SPECIAL_TOKENS["pad"],
            bos_token=SPECIAL_TOKENS["bos"],
            eos_token=SPECIAL_TOKENS["eos"],
            unk_token=SPECIAL_TOKENS["unk"],
            max_length=token_limit(config.max_position_embeddings, max_length, "this BERT model"),
            aliases=aliases,
            **mask,
        )

    def sample_sequences(self) -> list[str]:
        if self.alphabet == "smiles":
            return list(SAMPLE_SMILES)
        # Antibody variable-domain fragments: trastuzumab VH/VL, a CDR-H3, human germline starts.
        return [
            "EVQLV",
            "SRWGGDGFYAMDY",
            "EIVLTQSPGTLSLSPGERATLSC",
            "QVQLVQSGAEVKKPGASVKVSCKASGYTFT",
            "DIQMTQSPSSLSASVGDRVTITCRASQDVNTAVAWYQQKPGKAPKLLIYSASFLYSGVPSRFSGSRSGTDFTLTISSLQPEDFA"
            "TYYCQQHYTTPPTFGQGTKVEIK",
            "EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVARIYPTNGYTRYADSVKGRFTISADTSKNTAYLQMNS"
            "LRAEDTAVYYCSRWGGDGFYAMDYWGQGTLVTVSS",
        ]


def _vocabulary(checkpoint: Checkpoint) -> tuple[Path, list[str]]:
    """(where, tokens) of the checkpoint's vocab.txt, as its reader read it, else of the one in
    its parent folder (where the antiberty wheel keeps it)."""
    vocab = checkpoint.lines("vocab.txt", "vocabulary")
    if vocab is not None:
        return checkpoint.path / "vocab.txt", vocab
    beside = checkpoint.path.parent / "vocab.txt"
    if beside.is_file() and beside.stat().st_size <= MAX_SIDE_FILE_BYTES:
        try:
            return beside, beside.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise InvalidInputError(f"{beside} is not UTF-8 text") from None
    raise InvalidInputError(f"no vocab.txt in {checkpoint.path} or its parent folder")


def antiberty_checkpoint() -> Path:
    """The real AntiBERTy model folder inside the installed antiberty package.

    Located without importing antiberty: its own classes fail under transformers 5.x, and only
    version 0.1.3 ships the weights (newer ones download them from a hub).
    """
    spec = importlib.util.find_spec("antiberty")  # finds the package without running it
    locations = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for location in locations:
        folder = Path(location) / "trained_models" / "AntiBERTy_md_smooth"
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        "the AntiBERTy weights are not installed: pip install antiberty==0.1.3 "
        "(the only version whose wheel ships them)"
    )


def rxnfp_checkpoint(variant: str = "bert_pretrained") -> Path:
    """A real rxnfp reaction-SMILES BERT folder (config.json, pytorch_model.bin, vocab.txt) inside
    the installed rxnfp package: `bert_pretrained` (masked-LM pretrained), `bert_ft` (fine-tuned
    on reaction classes) or `bert_ft_10k_25s`.

    Located without importing rxnfp: it imports rdkit and needs an old transformers. Install it
    with `pip install --no-deps rxnfp==0.1.0` (its pinned requirements cannot install on
    Python 3.11, and only the files are needed).
    """
    if variant not in RXNFP_VARIANTS:
        raise InvalidInputError(f"unknown rxnfp model {variant!r}; the rxnfp wheel ships {', '.join(RXNFP_VARIANTS)}")
    spec = importlib.util.find_spec("rxnfp")  # finds the package without running it
    locations = spec.submodule_search_locations if spec and spec.submodule_search_locations else []
    for location in locations:
        folder = Path(location) / "models" / "transformers" / variant
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        f"the rxnfp {variant} weights are not installed: pip install --no-deps rxnfp==0.1.0 "
        "(the wheel ships them; --no-deps because its pinned scipy/scikit-learn/matplotlib "
        "cannot install on Python 3.11, and only the files are read)"
    )
