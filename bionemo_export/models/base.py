"""What a model family declares, in the style of optimum's exporter configs.

A family is one small class registered under a name (`esm2`, `bert`, ...). Loading a checkpoint
goes in two steps:

    path --(a reader, models/readers/)--> Checkpoint --(family.from_<form>)--> ModelDescription
         --(family.build)--> LoadedModel

A reader knows a form on disk and nothing of architectures; a family reads the forms for which it
defines a `from_<form>` method (`from_huggingface`, `from_nemo`, `from_saved`), each turning that
form's configuration, tokenizer files and key names into one normalized `ModelDescription` (its
own config object, its tokenizer, the state dict in its own naming), and `build` makes the PyTorch
module from that, whatever the form was. The family also says which tasks it serves and the
tolerance its exported graph must meet, and wraps its backbone into the one encoder signature
every exporter and repository template understands:

    inputs : input_ids INT64 [batch, length], attention_mask INT64 [batch, length],
             residue_mask BOOL [batch, length]   (True exactly on real residues)
    outputs: hiddens FP32 [batch, length, hidden], embeddings FP32 [batch, hidden]
             (embeddings = mean of hiddens over residue_mask, computed inside the graph)

Adding a family is one new module in this package that subclasses `ModelFamily` and decorates it
with `@register` (the package imports every module in it); adding a form is one reader module plus a
`from_<form>` method on the families that read it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import TASKS, Requirement
from bionemo_export.tensors import DType, TensorSpec

if TYPE_CHECKING:  # torch is heavy; importing the registry must stay cheap
    import torch

    from bionemo_export.models.classifier import ClassifierHead, ClassifierWeights
    from bionemo_export.models.contact_head import ContactPredictor, ContactWeights
    from bionemo_export.models.lm_head import HeadWeights
    from bionemo_export.models.readers import Checkpoint
    from bionemo_export.serving.tokenizers.protocol import DecodingTokenizer, Tokenizer


ENCODER_INPUTS: tuple[TensorSpec, ...] = (
    TensorSpec("input_ids", DType.INT64, ("batch", "length")),
    TensorSpec("attention_mask", DType.INT64, ("batch", "length")),
    TensorSpec("residue_mask", DType.BOOL, ("batch", "length")),
)


def encoder_outputs(hidden_size: int) -> tuple[TensorSpec, ...]:
    return (
        TensorSpec("hiddens", DType.FP32, ("batch", "length", hidden_size)),
        TensorSpec("embeddings", DType.FP32, ("batch", hidden_size)),
    )


def classifier_outputs(num_labels: int, per_token: bool) -> tuple[TensorSpec, ...]:
    """The fine-tuned head graph's output (its input is the encoder's `hiddens`)."""
    axes = ("batch", "length", num_labels) if per_token else ("batch", num_labels)
    return (TensorSpec("logits", DType.FP32, axes),)


CONTACT_INPUTS: tuple[TensorSpec, ...] = ENCODER_INPUTS[:2]
"""The contacts graph's inputs: the encoder's token inputs (its residues are positions 1..L)."""
CONTACT_OUTPUTS: tuple[TensorSpec, ...] = (TensorSpec("contacts", DType.FP32, ("batch", "residues", "residues")),)
"""The contacts graph's output: [B, T-2, T-2], row and column i the sequence's residue i
(models/contact_head.py)."""


LAYER_INPUTS: tuple[TensorSpec, ...] = ENCODER_INPUTS[:2]
"""The layers graph's inputs: the encoder's token inputs (models/layer_states.py)."""


def lm_head_outputs(alphabet_size: int) -> tuple[TensorSpec, ...]:
    """The masked-LM head graph's output (its input is the encoder's `hiddens`)."""
    return (TensorSpec("log_probs", DType.FP32, ("batch", "length", alphabet_size)),)


@dataclass
class Seq2SeqModules:
    """The decoder side of an encoder-decoder family, split into the graphs a served decode loop
    needs (all fp32, eval mode):

    cross_kv(hiddens [B,S,H]) -> (cross_k, cross_v), each [layers, B, heads, S, head_dim]:
        the cross-attention keys/values, computed once per request.
    decoder_step(tokens INT64 [B,1], enc_mask BOOL [B,S], cross_k, cross_v,
                 past_k, past_v [layers, B, heads, P, head_dim])
        -> (logits FP32 [B, vocab], present_k, present_v [layers, B, heads, P+1, head_dim]):
        one decoding step with the self-attention cache (P = 0 on the first step; the position of
        the new token is P).
    decoder_full(tokens INT64 [B,T], hiddens [B,S,H], enc_mask BOOL [B,S]) -> logits [B,T,vocab]:
        the same decoder without a cache (recomputes every position; reference and benchmark).
    """

    cross_kv: torch.nn.Module
    decoder_step: torch.nn.Module
    decoder_full: torch.nn.Module
    num_layers: int
    num_heads: int
    head_dim: int
    vocab_size: int
    begin_id: int
    end_id: int
    pad_id: int
    max_decode_length: int
    """Most tokens a decode may produce (the decoder's position limit, minus the begin token)."""


@dataclass
class LoadedModel:
    """A checkpoint read into memory, ready to export and to serve as the reference."""

    family: ModelFamily
    encoder: torch.nn.Module
    """forward(input_ids, attention_mask, residue_mask) -> (hiddens, embeddings); eval mode, fp32."""
    tokenizer: Tokenizer
    hidden_size: int
    checkpoint: Path
    description: dict[str, Any] = field(default_factory=dict)
    """Facts for manifest.json (architecture, layers, parameters, checkpoint form, ...)."""
    seq2seq: Seq2SeqModules | None = None
    """The decoder graphs, for families that decode (tasks decodes/samplings)."""
    lm_head: torch.nn.Module | None = None
    """The masked-LM head (models/lm_head.py), None when the checkpoint has none:
    forward(hiddens FP32 [B, L, H], the encoder's output) -> log_probs FP32 [B, L, len(alphabet)],
    a log_softmax over the alphabet's tokens only (special tokens excluded); eval mode, fp32."""
    alphabet: tuple[str, ...] = ()
    """What log_probs' last axis holds, in order: the residue characters (SMILES tokens for SMILES
    models), one per distinct non-special token the tokenizer maps them to, aliases excluded."""
    classifier: ClassifierHead | None = None
    """The fine-tuned head (models/classifier.py: *ForSequenceClassification,
    *ForTokenClassification), None when the checkpoint has none: forward(hiddens FP32 [B, L, H]) ->
    logits FP32 [B, C] (sequence heads) or [B, L, C] (`per_token`); `labels` (C names),
    `problem_type`; eval mode, fp32."""
    contacts: ContactPredictor | None = None
    """ESM's contact head over the attention of every layer (models/contact_head.py), None when the
    checkpoint has none: forward(input_ids, attention_mask INT64 [B, T]) -> contacts FP32
    [B, T-2, T-2]; eval mode, fp32."""

    @property
    def serves_scores(self) -> bool:
        """Whether N_scores can run on it: a masked-LM head, a mask character (for the masked
        copies) and one character per residue (variants are written residue by residue)."""
        return (self.lm_head is not None and getattr(self.tokenizer, "mask_char", None) is not None
                and all(len(token) == 1 for token in self.alphabet))

    def carries(self, requirement: Requirement) -> bool:
        """Whether this checkpoint carries what a task entry's `requires` names."""
        return {Requirement.ENCODER: True, Requirement.DECODER: self.seq2seq is not None,
                Requirement.LM_HEAD: self.lm_head is not None,
                Requirement.ONE_CHARACTER_RESIDUES: self.serves_scores,
                Requirement.CLASSIFIER: getattr(self, "classifier", None) is not None,
                Requirement.CONTACT_HEAD: getattr(self, "contacts", None) is not None,
                Requirement.ATTENTION_PROBABILITIES: self.returns_attentions}[requirement]

    def servable(self, tasks: Collection[str] | None = None) -> tuple[str, ...]:
        """Those of `tasks` (default: every task of the table) whose requirements it carries, in the
        table's order."""
        return tuple(name for name, task in TASKS.items() if (tasks is None or name in tasks)
                     and all(self.carries(requirement) for requirement in task.requires))

    def decoding(self) -> tuple[Seq2SeqModules, DecodingTokenizer]:
        """The decoder graphs and the tokenizer that turns their token ids into text, for decoding
        and sampling; ValueError for a model that does not decode."""
        from bionemo_export.serving.tokenizers.protocol import DecodingTokenizer

        if self.seq2seq is None or not isinstance(self.tokenizer, DecodingTokenizer):
            raise ValueError(f"{self.checkpoint} ({self.family.name}) has no decoder, so it serves no decodes or "
                             "samplings: those need a checkpoint of an encoder-decoder family")
        return self.seq2seq, self.tokenizer

    @property
    def num_layers(self) -> int:
        """The encoder's blocks (N: the layers graph answers N + 1 states, 0 the embedding's)."""
        return int(self.description["layers"])

    @property
    def layer_states(self) -> torch.nn.Module:
        """Every layer's hidden states over the encoder's weights (models/layer_states.py):
        forward(input_ids, attention_mask INT64 [B, T]) -> hiddens_0 .. hiddens_N FP32 [B, T, H]."""
        from bionemo_export.models.layer_states import LayerStates

        return LayerStates(self.encoder, self.num_layers).eval()

    @property
    def layer_outputs(self) -> tuple[TensorSpec, ...]:
        """The layers graph's outputs: hiddens_0 .. hiddens_N [batch, length, hidden]."""
        from bionemo_export.models.layer_states import layer_outputs

        return layer_outputs(self.num_layers, self.hidden_size)

    @property
    def returns_attentions(self) -> bool:
        """Whether the encoder is a transformers backbone, whose eager attention answers its
        probabilities (models/attention_maps.py); the project's own transformer does not."""
        from bionemo_export.models.attention_maps import returns_attentions

        backbone = getattr(self.encoder, "backbone", None)
        return backbone is not None and returns_attentions(backbone)

    @property
    def attention_maps(self) -> torch.nn.Module:
        """Every block's attention probabilities over the encoder's weights (models/attention_maps.py):
        forward(input_ids, attention_mask INT64 [B, T]) -> attentions_1 .. attentions_N FP32
        [B, heads, T, T]."""
        from bionemo_export.models.attention_maps import AttentionMaps

        return AttentionMaps(cast(Any, self.encoder).backbone, self.num_layers).eval()

    @property
    def attention_outputs(self) -> tuple[TensorSpec, ...]:
        """The attentions graph's outputs: attentions_1 .. attentions_N [batch, heads, length, length]."""
        from bionemo_export.models.attention_maps import attention_outputs

        return attention_outputs(self.num_layers, self.num_heads)

    @property
    def num_heads(self) -> int:
        """The encoder's attention heads per block."""
        return int(self.description["heads"])

    @property
    def classifier_outputs(self) -> tuple[TensorSpec, ...]:
        """The fine-tuned head graph's output: logits [B, C] or, per token, [B, L, C]."""
        if self.classifier is None:
            raise InvalidInputError(f"{self.checkpoint} has no fine-tuned head")
        return classifier_outputs(self.classifier.num_labels, self.classifier.per_token)

    @property
    def inputs(self) -> tuple[TensorSpec, ...]:
        return ENCODER_INPUTS

    @property
    def lm_head_inputs(self) -> tuple[TensorSpec, ...]:
        """The head graph's input: the encoder's hiddens."""
        return (TensorSpec("hiddens", DType.FP32, ("batch", "length", self.hidden_size)),)

    @property
    def lm_head_outputs(self) -> tuple[TensorSpec, ...]:
        """The head graph's output: log-probabilities over the alphabet."""
        return lm_head_outputs(len(self.alphabet))

    @property
    def outputs(self) -> tuple[TensorSpec, ...]:
        return encoder_outputs(self.hidden_size)


@dataclass
class ModelDescription:
    """A checkpoint in normalized form: what `ModelFamily.build` needs, whatever the form was."""

    checkpoint: Checkpoint
    config: Any
    """The family's own configuration object (a transformers config, a TransformerConfig, ...)."""
    tokenizer: Tokenizer
    state_dict: dict[str, torch.Tensor]
    """The weights under the names of the module `build` makes (every one of them, nothing else)."""
    facts: dict[str, Any] = field(default_factory=dict)
    """What the form adds to manifest.json's description (e.g. the NeMo target class)."""
    lm_head: HeadWeights | None = None
    """The checkpoint's masked-LM head, None when it has none (models/lm_head.py)."""
    classifier: ClassifierWeights | None = None
    """The checkpoint's fine-tuned head, None when it has none (models/classifier.py)."""
    contact_head: ContactWeights | None = None
    """The checkpoint's contact head, None when it has none (models/contact_head.py)."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Stored tensors the family does not use, with why (`leave_out`): heads it does not serve,
    copies of shared tensors, tables it computes from the config. `inspect` reports them."""


_LEFT_OUT: ContextVar[dict[str, str] | None] = ContextVar("left_out", default=None)


def leave_out(key: str, why: str) -> None:
    """Record that a family's conversion dropped the stored tensor `key` (named as stored, or as
    the conversion had renamed it), and why: `ModelFamily.describe` collects these into
    `ModelDescription.left_out`. Outside describe it does nothing."""
    recorded = _LEFT_OUT.get()
    if recorded is not None:
        recorded.setdefault(key, why)


class ModelFamily(ABC):
    """One architecture family. Subclasses set the class variables, define a `from_<form>` method
    for each checkpoint form they read, and implement the abstract methods."""

    name: ClassVar[str]
    description: ClassVar[str]
    may_carry: ClassVar[frozenset[Requirement]] = frozenset({Requirement.ENCODER})
    """What this family's checkpoints can carry (each checkpoint says what it does: LoadedModel.carries):
    the tasks it can serve are those whose requirements are among these (`possible_tasks`)."""
    atol: ClassVar[float] = 1e-4
    """Max abs error allowed between the exported graph and PyTorch (fp32)."""
    min_cosine: ClassVar[float] = 0.9999
    nemo_targets: ClassVar[tuple[str, ...]] = ()
    """Class names of the `.nemo` `target`s this family reads (how `--model` is inferred)."""
    scoring_default: ClassVar[str] = "wt-marginal"
    """N_scores' method for variants when a request names none (serving/scoring.py METHODS)."""

    claimed_forms: ClassVar[tuple[str, ...]] = ()
    """Checkpoint forms that are this family's by being that form (NVIDIA's nv_esm directory, the
    esm package's ESM C weight files): how `--model` is inferred for them."""

    @classmethod
    def claims(cls, checkpoint: Checkpoint) -> bool:
        """Whether the checkpoint says, by its form or its contents, that this family reads it
        (`load_checkpoint` then needs no family named, and refuses another): by default, its form
        is one of `claimed_forms`. A family whose checkpoints say it otherwise overrides this."""
        return checkpoint.form in cls.claimed_forms

    @classmethod
    def possible_tasks(cls) -> tuple[str, ...]:
        """The tasks some checkpoint of this family can serve (their `requires` within `may_carry`),
        in the table's order; which ones a given checkpoint serves is `LoadedModel.servable`."""
        return tuple(name for name, task in TASKS.items() if set(task.requires) <= cls.may_carry)

    @classmethod
    def forms(cls) -> tuple[str, ...]:
        """The checkpoint forms this family reads (those it has a from_<form> method for)."""
        from bionemo_export.models.readers import READERS

        return tuple(form for form in READERS if callable(getattr(cls, f"from_{form}", None)))

    def load(self, checkpoint: Path, max_length: int | None = None) -> LoadedModel:
        """Read a checkpoint (any form this family reads) into a LoadedModel.

        `max_length` (tokens, specials included) lowers the tokenizer's limit; it may not exceed
        what the architecture supports. Raises ValueError (CheckpointError) naming the file and the
        problem for bad checkpoints.
        """
        return load_checkpoint(Path(checkpoint), self.name, max_length)

    def describe(self, checkpoint: Checkpoint, max_length: int | None = None) -> ModelDescription:
        """The normalized description of a checkpoint already read."""
        from bionemo_export.models.readers import CheckpointError

        convert = getattr(self, f"from_{checkpoint.form}", None)
        if convert is None:
            said = (checkpoint.model_class if checkpoint.form in CONFIG_FILES
                    else f"model_type {checkpoint.model_class!r}")
            what = f" ({said})" if checkpoint.model_class else ""
            raise CheckpointError(f"{checkpoint.path} is a {checkpoint.form} checkpoint{what}; "
                                  f"the {self.name} family reads {', '.join(self.forms())} checkpoints")
        recorded: dict[str, str] = {}
        token = _LEFT_OUT.set(recorded)
        try:
            description = convert(checkpoint, max_length)
        finally:
            _LEFT_OUT.reset(token)
        description.left_out.update(recorded)
        return description

    @abstractmethod
    def build(self, description: ModelDescription) -> LoadedModel:
        """The PyTorch modules (eval mode, fp32) and tokenizer of a described checkpoint."""

    @abstractmethod
    def sample_sequences(self) -> list[str]:
        """Valid inputs of varied lengths (short and long) for export checks and verification."""


REGISTRY: dict[str, type[ModelFamily]] = {}


FamilyClass = TypeVar("FamilyClass", bound="type[ModelFamily]")


def register(cls: FamilyClass) -> FamilyClass:
    """Class decorator: make a family available under `cls.name`."""
    if cls.name in REGISTRY:
        raise ValueError(f"model family {cls.name!r} is registered twice")
    REGISTRY[cls.name] = cls
    return cls


def form_family(checkpoint: Checkpoint) -> str | None:
    """The family whose `claims` says the checkpoint is its own (an nv_esm directory, ESM C's
    weight files, a fair-esm file's architecture, SaProt's paired vocabulary); None where no
    family's does. Every family is registered by now: importing this module runs the package's
    `__init__` first, which imports them all."""
    claimants = [name for name, cls in sorted(REGISTRY.items()) if cls.claims(checkpoint)]
    if len(claimants) > 1:
        raise RuntimeError(f"{checkpoint.path}: the families {', '.join(claimants)} each claim it; "
                           "a checkpoint's form or contents may name one family only")
    return claimants[0] if claimants else None


def _what_it_is(checkpoint: Checkpoint) -> str:
    """What a checkpoint whose form names its family is, for the message refusing another family."""
    if checkpoint.form == "huggingface":
        return "Hugging Face directory whose vocab.txt pairs residues with Foldseek 3Di letters (SaProt's)"
    return f"{checkpoint.model_class} checkpoint"


CONFIG_FILES = {"nemo": "model_config.yaml", "nemo2": "context/model.yaml"}
"""Checkpoint forms whose config names the model's class (how `--model` is inferred: .nemo
targets, NeMo 2 config classes), and that config's file."""


def load_checkpoint(path: Path, family: str | None = None, max_length: int | None = None) -> LoadedModel:
    """Read the checkpoint at `path` (any form) and load it as `family`; without a family, a
    .nemo archive's `target` names it, or the family that `claims` it (`form_family`). A checkpoint
    that says it belongs to another family is refused."""
    from bionemo_export.models.readers import CheckpointError, read_checkpoint

    checkpoint = read_checkpoint(Path(path))
    found = (infer_family(checkpoint, required=family is None) if checkpoint.form in CONFIG_FILES
             else form_family(checkpoint))
    if family is None:
        if found is None:
            raise CheckpointError(f"{path} is a {checkpoint.form} checkpoint: name its model family with `family` "
                                  "(only .nemo archives, NeMo 2, nv_esm directories, fair-esm files and SaProt "
                                  "directories say what they are)")
        family = found
    elif found is not None and found != family:
        raise CheckpointError(f"{path} is a {_what_it_is(checkpoint)}, which the {found} family "
                              f"reads, not {family}: use `family` {found}")
    reader = get_family(family)
    return reader.build(reader.describe(checkpoint, max_length))


def infer_family(checkpoint: Checkpoint, required: bool = True) -> str | None:
    """The family that reads a .nemo checkpoint, from its `target` class (a NeMo 2 directory:
    its context/model.yaml's config class)."""
    from bionemo_export.models.readers import CheckpointError

    target = (checkpoint.model_class or "").rsplit(".", 1)[-1]
    for name, cls in sorted(REGISTRY.items()):
        if target and target in cls.nemo_targets:
            return name
    if not required:
        return None
    known = ", ".join(f"{t} ({name})" for name, cls in sorted(REGISTRY.items()) for t in cls.nemo_targets)
    what = f"target {checkpoint.model_class!r}" if target else "no target"
    config_file = CONFIG_FILES.get(checkpoint.form, "model_config.yaml")
    raise CheckpointError(f"{checkpoint.path} has {what} in {config_file}; known targets: {known}. "
                          "Name the family with `family` if it is one of them under another class name")


def get_family(name: str) -> ModelFamily:
    """The family registered as `name` (every family is: see `form_family`); the error lists the known ones."""
    try:
        return REGISTRY[name]()
    except KeyError:
        known = ", ".join(sorted(REGISTRY)) or "none"
        raise InvalidInputError(f"unknown model family {name!r}; known families: {known}") from None


def seq2seq_graph_specs(seq2seq: Seq2SeqModules, hidden_size: int
                        ) -> dict[str, tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]]:
    """(inputs, outputs) of each decoder graph, as Seq2SeqModules documents them. Key/value
    tensors are [layers, batch, heads, length, head_dim]: their batch is not the first axis."""

    def kv(name: str, length: str) -> TensorSpec:
        return TensorSpec(name, DType.FP32, (seq2seq.num_layers, "batch", seq2seq.num_heads, length, seq2seq.head_dim))

    return {
        "cross_kv": (
            (TensorSpec("hiddens", DType.FP32, ("batch", "src_length", hidden_size)),),
            (kv("cross_k", "src_length"), kv("cross_v", "src_length")),
        ),
        "decoder_step": (
            (
                TensorSpec("tokens", DType.INT64, ("batch", 1)),
                TensorSpec("enc_mask", DType.BOOL, ("batch", "src_length")),
                kv("cross_k", "src_length"),
                kv("cross_v", "src_length"),
                kv("past_k", "past_length"),
                kv("past_v", "past_length"),
            ),
            (
                TensorSpec("logits", DType.FP32, ("batch", seq2seq.vocab_size)),
                kv("present_k", "present_length"),
                kv("present_v", "present_length"),
            ),
        ),
        "decoder_full": (
            (
                TensorSpec("tokens", DType.INT64, ("batch", "tgt_length")),
                TensorSpec("hiddens", DType.FP32, ("batch", "src_length", hidden_size)),
                TensorSpec("enc_mask", DType.BOOL, ("batch", "src_length")),
            ),
            (TensorSpec("logits", DType.FP32, ("batch", "tgt_length", seq2seq.vocab_size)),),
        ),
    }
