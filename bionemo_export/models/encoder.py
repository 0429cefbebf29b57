"""What encoder families (ESM-2, ESM-1, ProtT5, BERT protein LMs) have in common.

- `PooledEncoder`: the backbone wrapped into the one encoder signature of `base.py`, with the
  masked mean pooling inside the graph.
- `EncoderFamily`: building an encoder from a `ModelDescription` (strict key check, pooling), for
  Hugging Face backbones and the project's pre-LN transformer (Megatron layouts) alike;
  `HuggingFaceEncoderFamily` adds the Hugging Face directory form: a family supplies only its
  backbone class, key layout and tokenizer.

A checkpoint that carries a masked-LM head (EsmForMaskedLM's `lm_head`, BERT's `cls.predictions`,
a `.nemo`'s `lm_head`) gets it built as `LoadedModel.lm_head` (models/lm_head.py), loaded as
strictly as the encoder; one without gets None.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, cast

import torch
from transformers.initialization import no_init_weights

from bionemo_export.errors import InvalidInputError
from bionemo_export.models.base import LoadedModel, ModelDescription, ModelFamily, leave_out
from bionemo_export.models.classifier import (
    ClassifierWeights,
    build_classifier,
    classifier_kind,
    config_labels,
    split_classifier,
)
from bionemo_export.models.contact_head import ContactPredictor, build_contact_predictor, split_contact_head
from bionemo_export.models.lm_head import HeadWeights, MaskedLMHead, build_lm_head, split_head
from bionemo_export.models.readers import Checkpoint, CheckpointError
from bionemo_export.models.readers.base import KeyMismatchError, describe_checkpoint
from bionemo_export.models.readers.base import some as _some
from bionemo_export.models.readers.mapped import assign_widened
from bionemo_export.models.transformer import Encoder as TransformerEncoder
from bionemo_export.models.transformer import TransformerConfig
from bionemo_export.serving.tokenizers.protocol import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
        output = self.backbone(input_ids=input_ids, attention_mask=attention_mask)
        # transformers backbones return an output object, the project's own transformer a tensor
        hiddens = getattr(output, "last_hidden_state", output).float()
        return hiddens, masked_mean(hiddens, residue_mask)

    def layer_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every layer's hidden states, layers + 1 tensors [batch, length, hidden] in ESM's numbering:
        a transformers backbone's own `output_hidden_states=True` (0 the embedding's output, i block
        i's, the last after the final layer norm: its `last_hidden_state`), or the project's
        transformer's `layer_states` (the same convention)."""
        if isinstance(self.backbone, TransformerEncoder):
            return self.backbone.layer_states(input_ids, attention_mask)
        output = self.backbone(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        return tuple(state.float() for state in output.hidden_states)


def masked_mean(hiddens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The embeddings [batch, hidden]: mean of hiddens [batch, length, hidden] where mask
    [batch, length] is True. Tensor operations only, so it traces for any batch and length."""
    weights = mask.unsqueeze(-1).to(hiddens.dtype)
    # clamp: an all-False mask (never produced by the tokenizer) gives zeros, not NaN.
    counts = weights.sum(dim=1).clamp(min=1.0)
    return (hiddens * weights).sum(dim=1) / counts


class EncoderFamily(ModelFamily):
    """A family that serves an encoder (embeddings, hiddens): `build` makes the backbone its
    description's config calls for, loads the state dict strictly and adds the pooling."""

    backbone_class: ClassVar[type[Any]]
    """The transformers model class of its Hugging Face form (EsmModel, BertModel, ...)."""
    unused_prefixes: ClassVar[tuple[str, ...]] = ()
    """Parameters of `backbone_class` the encoder does not use (heads): never loaded."""

    def make_backbone(self, config: Any) -> torch.nn.Module:
        """The backbone for `config`, its parameters not yet loaded: the project's pre-LN
        transformer for a TransformerConfig (Megatron layouts), else `backbone_class`."""
        if isinstance(config, TransformerConfig):
            with torch.device("meta"):  # every parameter comes from the checkpoint
                return TransformerEncoder(config)
        # Skip the random initialisation (12 s for ESM-2 650M): strict loading overwrites every
        # parameter the encoder uses, and buffers are computed in the constructors regardless.
        with no_init_weights():
            return self.backbone_class(config, add_pooling_layer=False)

    def build(self, description: ModelDescription) -> LoadedModel:
        config, checkpoint = description.config, description.checkpoint
        backbone = self.make_backbone(config)
        load_strict(backbone, description.state_dict, checkpoint.weights_path, self.unused_prefixes)
        lm_head = self.make_lm_head(description, backbone)
        layers, hidden, heads = architecture_sizes(config)
        classifier = None
        if description.classifier is not None:
            classifier = build_classifier(description.classifier, hidden, checkpoint.weights_path)
        encoder = PooledEncoder(backbone).float().eval()
        return LoadedModel(
            lm_head=lm_head,
            classifier=classifier,
            contacts=self.make_contacts(description, encoder.backbone, layers, heads),
            alphabet=lm_head.alphabet if lm_head is not None else (),
            family=self,
            encoder=encoder,
            tokenizer=description.tokenizer,
            hidden_size=hidden,
            checkpoint=checkpoint.path,
            description={
                "architecture": type(backbone).__name__,
                "layers": layers,
                "hidden": hidden,
                "heads": heads,
                "parameters": sum(p.numel() for name, p in backbone.named_parameters()
                                  if not name.startswith(self.unused_prefixes)),
                "checkpoint_form": describe_checkpoint(checkpoint),
                **description.facts,
            },
        )


    def make_contacts(self, description: ModelDescription, backbone: torch.nn.Module, layers: int,
                      heads: int) -> ContactPredictor | None:
        """The described checkpoint's contact head over the backbone's attention (weights shared
        with the encoder); None without a head."""
        head = description.contact_head
        if head is None:
            return None
        if isinstance(backbone, TransformerEncoder):  # no reader gives one such a head
            raise CheckpointError(f"{description.checkpoint.weights_path}: a contact head over the project's own "
                                  "transformer is not supported; remove its contact_head keys")
        return build_contact_predictor(head, backbone, layers=layers, heads=heads,
                                       eos_id=getattr(description.tokenizer, "eos_id", None),
                                       source=description.checkpoint.weights_path)

    def make_lm_head(self, description: ModelDescription, backbone: torch.nn.Module) -> MaskedLMHead | None:
        """The described checkpoint's masked-LM head over the tokenizer's alphabet, its output
        weights the backbone's word embeddings unless the head has its own; None without a head."""
        head = description.lm_head
        if head is None:
            return None
        tokenizer = description.tokenizer
        return build_lm_head(head.weights, word_embeddings(backbone), alphabet=tokenizer.alphabet,
                             alphabet_ids=tokenizer.alphabet_ids, layer_norm_eps=head.layer_norm_eps,
                             activation=head.activation, tied=head.tied,
                             source=description.checkpoint.weights_path, names=head.names)


def word_embeddings(backbone: torch.nn.Module) -> torch.Tensor:
    """The token embedding matrix [vocab, hidden] of a transformers backbone or the project's
    transformer.Encoder (what tied masked-LM heads project onto)."""
    if isinstance(backbone, TransformerEncoder):
        return backbone.embedding.word_embeddings.weight.detach()
    # Any other backbone is a transformers model (EncoderFamily.backbone_class), whose input
    # embeddings are an nn.Embedding; torch's Module.__getattr__ types neither.
    embeddings = cast("PreTrainedModel", backbone).get_input_embeddings()
    return cast(torch.nn.Embedding, embeddings).weight.detach()


class HuggingFaceEncoderFamily(EncoderFamily):
    """An encoder family with a Hugging Face directory form: config.json + weights (+ vocab)."""

    model_type: ClassVar[str]
    """config.json's model_type this family reads."""
    config_class: ClassVar[type[Any]]
    """The transformers config class (EsmConfig, BertConfig)."""
    key_prefix: ClassVar[str]
    """Prefix of the backbone's keys in *ForMaskedLM-style checkpoints (stripped when present)."""
    head_prefix: ClassVar[str | None] = None
    """Where the masked-LM head's keys start (after key_prefix is stripped); None: the family
    reads no head from this form."""
    head_renames: ClassVar[dict[str, str]] = {}
    """The head's keys (after head_prefix) -> lm_head.HEAD_KEYS names, where they differ."""
    classifier_prefix: ClassVar[str] = "classifier."
    """Where a fine-tuned head's keys start (after key_prefix is stripped)."""
    contact_prefix: ClassVar[str | None] = None
    """Where ESM's contact head's keys start (after key_prefix is stripped); None: the family
    reads no contact head (its keys, if any, are left out with the other unused heads)."""
    classifier_renames: ClassVar[dict[str, dict[str, str]]] = {}
    """Per kind ("sequence", "token"): the fine-tuned head's keys -> classifier.SEQUENCE_KEYS /
    TOKEN_KEYS names; empty: the family reads no fine-tuned head."""

    @abstractmethod
    def build_tokenizer(self, checkpoint: Checkpoint, config: Any, max_length: int | None) -> Tokenizer:
        """The tokenizer for the checkpoint (from the side files its reader read: `Checkpoint.files`),
        limited to `max_length` tokens when given."""

    def huggingface_config(self, checkpoint: Checkpoint) -> Any:
        """config.json as this family's transformers config, checked to be of `model_type`."""
        config = dict(checkpoint.config)
        # Configs written by old transformers versions (rxnfp's, for one) have no model_type: the
        # family the user named decides, and loading checks every weight's name and shape anyway.
        config.setdefault("model_type", self.model_type)
        if config["model_type"] != self.model_type:
            raise CheckpointError(f"{checkpoint.path / 'config.json'} has model_type {config['model_type']!r}, "
                                  f"expected {self.model_type!r}")
        return self.config_class.from_dict(config)

    def from_huggingface(self, checkpoint: Checkpoint, max_length: int | None) -> ModelDescription:
        config = self.huggingface_config(checkpoint)
        tokenizer = self.build_tokenizer(checkpoint, config, max_length)
        if tokenizer.vocab_size > config.vocab_size:
            raise CheckpointError(
                f"{checkpoint.path}: the vocabulary has {tokenizer.vocab_size} tokens but config.json's "
                f"vocab_size is {config.vocab_size}"
            )
        # The stored names normalized once (`normalized_name`); `stored` maps them back for messages.
        stored = {self.normalized_name(key): key for key in checkpoint.weights}
        weights = {name: checkpoint.weights[key] for name, key in stored.items()}
        weights, head = self.huggingface_head(checkpoint, weights, config)
        weights, classifier = self.huggingface_classifier(checkpoint, weights)
        contact_head = None
        if self.contact_prefix is not None:
            weights, contact_head = split_contact_head(weights, self.contact_prefix, stored)
        return ModelDescription(checkpoint, config, tokenizer, self.huggingface_keys(weights), lm_head=head,
                                classifier=classifier, contact_head=contact_head)

    def normalized_name(self, key: str) -> str:
        """A stored weight's name as this family's conversion reads it: the *ForMaskedLM prefix
        (`key_prefix`) stripped, old LayerNorm names modernized."""
        return _modern_name(key.removeprefix(self.key_prefix))

    def huggingface_classifier(self, checkpoint: Checkpoint, weights: Mapping[str, torch.Tensor]
                               ) -> tuple[dict[str, torch.Tensor], ClassifierWeights | None]:
        """(the other weights, the fine-tuned head or None), `weights` under their normalized names.
        config.json's `architectures` say whether the head is a sequence or a token head; without
        them the keys do (guess_classifier)."""
        normalized = dict(weights)
        if not self.classifier_renames:
            return normalized, None
        kind = classifier_kind(checkpoint.config) or self.guess_classifier(normalized)
        if kind is None:
            return normalized, None
        rest, head, names = split_classifier(normalized, self.classifier_prefix, self.classifier_renames[kind])
        source = str(checkpoint.path / "config.json")
        labels, problem_type = config_labels(checkpoint.config, source)
        return rest, ClassifierWeights(head, names, labels, problem_type, per_token=kind == "token")

    def guess_classifier(self, keys: Mapping[str, Any]) -> str | None:
        """The head's kind from its keys when config.json does not name a *ForSequence/TokenClassification
        architecture: None (no head) unless a family knows better."""
        return None

    def huggingface_head(self, checkpoint: Checkpoint, weights: Mapping[str, torch.Tensor], config: Any
                         ) -> tuple[dict[str, torch.Tensor], HeadWeights | None]:
        """(the other weights, the masked-LM head or None), `weights` under their normalized names:
        the keys under head_prefix taken out before the unused heads are dropped."""
        if self.head_prefix is None:
            return dict(weights), None
        head = {name: tensor for name, tensor in weights.items() if name.startswith(self.head_prefix)}
        rest = {name: tensor for name, tensor in weights.items() if name not in head}
        if not head:
            return rest, None
        _, head_weights, names = split_head(head, self.head_prefix, self.head_renames, checkpoint.weights_path)
        return rest, self.head_settings(head_weights, names, config, checkpoint)

    def head_settings(self, weights: dict[str, torch.Tensor], names: dict[str, str], config: Any,
                      checkpoint: Checkpoint) -> HeadWeights:
        """The head's weights with how this family's head computes (activation, epsilon, tying)."""
        raise CheckpointError(f"{checkpoint.weights_path}: the {self.name} family reads no masked-LM head")

    def huggingface_keys(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The checkpoint's weights under the backbone's names (`weights` under their normalized
        names), heads the encoder does not use dropped."""
        for key in weights:
            if key.startswith(self.unused_prefixes):
                leave_out(key, f"{key.split('.')[0]}: a head the {self.name} family does not serve")
        return {key: tensor for key, tensor in weights.items() if not key.startswith(self.unused_prefixes)}


def load_strict(module: torch.nn.Module, state_dict: Mapping[str, torch.Tensor], source: str,
                unused_prefixes: tuple[str, ...] = ()) -> None:
    """Give `module` every parameter it uses from `state_dict`; CheckpointError naming `source`
    for missing, unexpected and mis-shaped keys. Buffers (position ids, rotary frequencies) are
    computed from the config, never read; parameters under `unused_prefixes` (heads) are zeroed."""
    buffers = {name for name, _ in module.named_buffers()}
    buffer_leaves = {name.rsplit(".", 1)[-1] for name in buffers}
    weights = {key: tensor for key, tensor in state_dict.items()
               if key not in buffers and key.rsplit(".", 1)[-1] not in buffer_leaves}
    expected = {name: p for name, p in module.named_parameters() if not name.startswith(unused_prefixes)}
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
        raise KeyMismatchError(f"{source} does not match the {type(module).__name__} its configuration describes: "
                               + "; ".join(problems), missing, unexpected, shapes)
    assign_widened(module, weights)  # a bf16 checkpoint's fp32: a mapped file (readers/mapped.py)
    with torch.no_grad():  # unused heads were never initialised: make their memory defined
        for name, parameter in module.named_parameters():
            if name not in expected:
                parameter.zero_()


def architecture_sizes(config: Any) -> tuple[int, int, int]:
    """(layers, hidden, heads) of a transformers config or a TransformerConfig."""
    if isinstance(config, TransformerConfig):
        return config.num_layers, config.hidden_size, config.num_heads
    return config.num_hidden_layers, config.hidden_size, config.num_attention_heads


def _modern_name(key: str) -> str:
    """LayerNorm `gamma`/`beta` -> `weight`/`bias`: old checkpoints use these names, and
    transformers 5.x's save_pretrained writes them again for ESM."""
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if key.endswith(old):
            return key[: -len(old)] + new
    return key


def token_limit(architecture_limit: int, requested: int | None, family: str) -> int:
    """The tokenizer's max_length: the architecture's limit, or a lower one the user asked for."""
    if requested is None:
        return architecture_limit
    if requested > architecture_limit:
        raise InvalidInputError(
            f"max_length {requested} exceeds what {family} supports ({architecture_limit} tokens)"
        )
    return requested
