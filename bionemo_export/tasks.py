"""The served tasks, in one table: each public model's tensors, defaults and documentation.

In the manner of optimum's task -> outputs table: a task is one `Task` entry in `TASKS`, and one
kit (bionemo_export/kits/: its graphs, planner, verify check and dev-server answer). For a
repository built with `--name N`, task `t` is served as the public model `N_t`. Everything that
needs to know a task's tensors reads them here: the planners (config.pbtxt), the dev server,
`RepositoryClient`, `verify`, the supervisor's probes, `bench`'s input generation, the README's
served-API table (`served_api_table()`; a test keeps the README in step) and the docs site's Served
API page (docs/reference_pages.py writes it from this table when the site is built).

Dims exclude the batch axis (every public model is batched) and may name a size the repository
fixes when it is built: `H` (hidden size), `A` (the residue alphabet of a masked-LM head), `C`
(the classes or values of a fine-tuned head), `K` (a checkpoint ensemble's members: its
`member_outputs` only); -1 is a dynamic axis.

Importable without torch or Triton: numpy only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from bionemo_export.errors import InvalidInputError
from bionemo_export.tensors import SIZES_DOC, DType, TensorSpec


class Requirement(str, Enum):
    """What a checkpoint must carry to serve a task (models/base.py `LoadedModel.carries`); build.py's
    `MISSING` says what to do without it."""

    ENCODER = "encoder"
    """Every family has one."""
    DECODER = "decoder"
    """Encoder-decoder families (LoadedModel.seq2seq)."""
    LM_HEAD = "lm_head"
    """A masked-LM head (LoadedModel.lm_head)."""
    ONE_CHARACTER_RESIDUES = "one_character_residues"
    """An alphabet of one character per residue and a mask token (LoadedModel.serves_scores)."""
    CLASSIFIER = "classifier"
    """A fine-tuned head (LoadedModel.classifier)."""
    CONTACT_HEAD = "contact_head"
    """ESM's contact head over every layer's attention (LoadedModel.contacts)."""
    ATTENTION_PROBABILITIES = "attention_probabilities"
    """A transformers backbone, whose eager attention answers its probabilities
    (LoadedModel.returns_attentions); the project's own transformer does not."""


class Graph(str, Enum):
    """An ONNX graph a build exports (the kit that needs it says how: kits/ `TaskKit.graphs`)."""

    ENCODER = "encoder"
    CROSS_KV = "cross_kv"
    DECODER_STEP = "decoder_step"
    LM_HEAD = "lm_head"
    CLASSIFIER = "classifier"
    CONTACTS = "contacts"
    """The encoder again, with every layer's attention probabilities into the contact head: only
    this graph computes them (the encoder graph keeps its fused attention)."""
    LAYERS = "layers"
    """The encoder again, answering every layer's hidden states as separate outputs (hiddens_0 ..
    hiddens_N): a caller fetches only the layers it names (the encoder graph is not changed)."""
    ATTENTIONS = "attentions"
    """The encoder again, answering every block's attention probabilities as separate outputs
    (attentions_1 .. attentions_N): a caller fetches only the blocks it names."""


HOSTED_GRAPHS = (Graph.LAYERS, Graph.CONTACTS, Graph.ATTENTIONS)
"""The graphs that are the encoder again (its weights; other outputs, eager attention). With the
Python backend the encoder's model hosts them over one weights file with its own graph
(model_repository/hosted_graphs.py), so that the repository holds the weights once; Triton's own
runtimes run one graph per model folder, where each keeps a copy, and a default build leaves their
tasks out (`default_tasks`)."""
HOSTED_FILES = {graph.value: f"{graph.value}.onnx" for graph in HOSTED_GRAPHS}
"""Each hosted graph's file in the encoder's version folder."""


class Instances(str, Enum):
    """Which of ServingOptions' instance counts a task's model gets by default."""

    ONE = "one"
    ENCODER = "encoder_instances"
    DECODE = "decode_instances"
    SAMPLING = "sampling_instances"


@dataclass(frozen=True)
class RoleDefaults:
    """How the model serving a task is served unless `roles` in the serving options says otherwise
    (model_repository/options.py `ServingOptions.role`)."""

    instances: Instances = Instances.ONE
    batched: bool = False
    """Triton's dynamic batcher, with the options' queue settings."""
    response_cache: bool = False
    """Triton's response cache where the options turn it on (answers that depend on the input only)."""


CACHED = RoleDefaults(response_cache=True)
"""An ensemble whose answers depend on its input only: no batcher of its own, cacheable."""


@dataclass(frozen=True)
class Task:
    """A served task: the public model `<name>_<task>`, what it takes and answers, and what it
    needs, as declarations that the serving options, the client, the supervisor's probes and bench
    read here (numpy only). Its kit (bionemo_export/kits/) owns the rest: the graphs the build
    exports for it, its planner, its `verify` check and its dev-server answer."""

    name: str
    doc: str
    """One line: what the task answers."""
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    role: str
    """The repository role whose model serves it (model_repository/options.py `roles()`)."""
    requires: tuple[Requirement, ...] = (Requirement.ENCODER,)
    """What the checkpoint must carry; the first is what the served-API table says."""
    calls: tuple[str, ...] = ()
    """Tasks whose public models its own model calls (built along with it)."""
    role_defaults: RoleDefaults = CACHED
    client_method: str = ""
    """The `RepositoryClient` method that asks it (client/repository.py); "" where only the generic
    `RepositoryClient.ask` does."""
    by_default: bool = True
    """Built when a build names no tasks (`--tasks` left out) and the checkpoint carries what it
    requires; False: only when named. A task whose graph is the encoder again (HOSTED_GRAPHS) is
    built by default only where the encoder's model hosts it over one copy of the weights (the
    Python backend, an fp32 encoder: build.py `_check_tasks`)."""
    notes: tuple[str, ...] = field(default=())
    """Further lines of documentation (under the task on the docs site's Served API page)."""
    member_outputs: tuple[TensorSpec, ...] = ()
    """The outputs a checkpoint ensemble's model of this task has besides `outputs` (models/members.py:
    each member's answers, `K` the members), answered when a request names them: the ensemble
    planner, the dev server and the client read them here."""

    def __post_init__(self) -> None:
        if not self.requires:
            raise ValueError(f"task {self.name!r}: `requires` names at least one requirement")
        # public tensors: sizes by letter, not axis names
        for tensor in (*self.inputs, *self.outputs, *self.member_outputs):
            for dim in tensor.dims:
                if isinstance(dim, str) and dim not in SIZES_DOC:
                    raise ValueError(f"task {self.name!r}, tensor {tensor.name}: unknown size {dim!r}; sizes are "
                                     f"{', '.join(SIZES_DOC)}")

    def model(self, prefix: str) -> str:
        """The public model's name in a repository built with `--name prefix`."""
        return f"{prefix}_{self.name}"

    def member_tensors(self, sizes: Mapping[str, int]) -> list[TensorSpec]:
        """`member_outputs` as an ensemble serves them: the named sizes (K, A) filled in from `sizes`."""
        return [TensorSpec(t.name, t.dtype, t.shape(sizes), doc=t.doc) for t in self.member_outputs]

    @property
    def required_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if not t.optional)

    @property
    def optional_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(t for t in self.inputs if t.optional)

    def input(self, name: str) -> TensorSpec:
        return _named(self.inputs, name, f"{self.name} input")

    def output(self, name: str) -> TensorSpec:
        return _named(self.outputs, name, f"{self.name} output")


def _named(tensors: tuple[TensorSpec, ...], name: str, what: str) -> TensorSpec:
    for tensor in tensors:
        if tensor.name == name:
            return tensor
    raise KeyError(f"no {what} {name!r}; there are {', '.join(t.name for t in tensors)}")


SEQUENCES = TensorSpec("sequences", DType.BYTES, (1,), doc="one sequence per row, UTF-8")
MASK = TensorSpec("mask", DType.BOOL, (-1,), doc="True exactly on the sequence's residues/tokens")
SAMPLING_METHODS = ("greedy-perturbate", "topkp-perturbate", "beam-search-perturbate", "beam-search-single-sample",
                    "beam-search-perturbate-sample")
SCORING_METHODS = ("wt-marginal", "masked-marginal", "variant-masked", "pll")
LAYER_INCLUDE = ("mean", "bos", "max", "per_tok")
"""N_layers' `include` choices (serving/layers.py INCLUDE_CHOICES)."""
DEFAULT_MAX_ATTENTION_VALUES = 1 << 24
"""N_attentions' answer limit by default (its `max_attention_values` parameter): 16,777,216
values, 64 MiB of FP32 per request (serving/attentions.py)."""
LAYER_OUTPUTS = {"mean": "embeddings", "bos": "embeddings_bos", "max": "embeddings_max"}
"""N_layers' output of each pooling (serving/layers.py POOLED_OUTPUTS); per_tok answers hiddens and mask."""

TASKS: dict[str, Task] = {task.name: task for task in (
    Task("embeddings", "one vector per sequence: the mean of its hidden states over the residues",
         (SEQUENCES,), (TensorSpec("embeddings", DType.FP32, ("H",), doc="mean of `hiddens` over `mask`"),),
         role="embeddings", client_method="seqs_to_embedding"),
    Task("hiddens", "the encoder's last hidden states, one row per token",
         (SEQUENCES,),
         (TensorSpec("hiddens", DType.FP32, (-1, "H"), doc="every token's hidden state, 0 on padding"), MASK),
         role="hiddens", client_method="seqs_to_hidden"),
    Task("decodes", "greedy decoding of hidden states back into sequences",
         (TensorSpec("hiddens", DType.FP32, (-1, "H"), doc="hidden states, as N_hiddens answers them"),
          TensorSpec("mask", DType.BOOL, (-1,), doc="True on real tokens")),
         (TensorSpec("sequences", DType.BYTES, (1,), doc="the decoded sequence"),),
         role="decodes",
         requires=(Requirement.DECODER,), role_defaults=RoleDefaults(Instances.DECODE, batched=True),
         client_method="hidden_to_seqs"),
    Task("samplings", "new sequences sampled around each input, in its neighbourhood of the latent space",
         (SEQUENCES,
          TensorSpec("num_samples", DType.INT32, (1,), doc="outputs per sequence", default=1, optional=True),
          TensorSpec("scaled_radius", DType.FP32, (1,), doc="noise scale added to the hidden states", default=1.0,
                     optional=True),
          TensorSpec("sampling_method", DType.BYTES, (1,), doc=", ".join(SAMPLING_METHODS), default=SAMPLING_METHODS[0],
                     optional=True),
          TensorSpec("seed", DType.INT64, (1,), doc="random seed: the same seed and inputs give the same output",
                     optional=True),
          TensorSpec("top_k", DType.INT32, (1,), doc="topkp-perturbate: keep the k most likely tokens (0: off)",
                     default=0, optional=True),
          TensorSpec("top_p", DType.FP32, (1,), doc="topkp-perturbate: nucleus probability mass", default=0.9,
                     optional=True),
          TensorSpec("temperature", DType.FP32, (1,), doc="topkp-perturbate: softmax temperature", default=1.0,
                     optional=True),
          TensorSpec("beam_size", DType.INT32, (1,), doc="beam-search-perturbate(-sample): beams per search", default=5,
                     optional=True)),
         (TensorSpec("generated", DType.BYTES, (-1,), doc="num_samples sequences"),),
         role="samplings",
         requires=(Requirement.DECODER,), role_defaults=RoleDefaults(Instances.SAMPLING, batched=True),
         client_method="sample_seqs"),
    Task("logits", "log-probabilities over the residue alphabet at every token, from the masked-LM head",
         (TensorSpec("sequences", DType.BYTES, (1,), doc="one sequence per row; the mask character `_` may stand for "
                     "any residue (SaProt: structure-aware `MdEvVp` or plain residues, `#` a masked residue)"),),
         (TensorSpec("log_probs", DType.FP32, (-1, "A"), doc="log_softmax over the alphabet (special tokens excluded), "
                     "rows laid out like hiddens (SaProt: over the 20 amino acids, each the log of its 21 structure "
                     "tokens' summed probability)"), MASK),
         role="logits",
         requires=(Requirement.LM_HEAD,), client_method="seqs_to_log_probs",
         member_outputs=(TensorSpec("member_log_probs", DType.FP32, ("K", -1, "A"), doc="a checkpoint ensemble's "
                                    "only: each member's log_probs, in the build's order"),),
         notes=("The alphabet's order is the config's `alphabet` parameter (RepositoryClient.alphabet()).",
                "A checkpoint ensemble (`build repo` with several `--checkpoint`) answers the mean of its K members' "
                "log_probs, and each member's as `member_log_probs` FP32 [K, -1, A] when a request names that "
                "output.")),
    Task("scores", "variant-effect scores (ESM's marginals) or the pseudo-log-likelihood of the sequence",
         (TensorSpec("sequences", DType.BYTES, (1,), doc="the wild type (SaProt: structure-aware, or plain residues)"),
          TensorSpec("variants", DType.BYTES, (-1,), doc="`A42G`, multi-mutants `A42G:L43P`, 1-based residue positions",
                     optional=True),
          TensorSpec("method", DType.BYTES, (1,), doc=", ".join(SCORING_METHODS) + " (default: the model's "
                     "`default_method` parameter with variants, wt-marginal, variant-masked for SaProt; pll without)",
                     optional=True)),
         (TensorSpec("scores", DType.FP32, (-1,), doc="one per variant: the sum over its mutations of log p(mutant) - "
                     "log p(wild type); or [1], the PLL (mean log-probability, each residue masked in turn)"),),
         role="scores",
         requires=(Requirement.LM_HEAD, Requirement.ONE_CHARACTER_RESIDUES), calls=("logits",),
         # like samplings: a long request (a deep mutational scan) holds one instance
         role_defaults=RoleDefaults(Instances.SAMPLING, batched=True), client_method="score_variants",
         member_outputs=(TensorSpec("member_scores", DType.FP32, ("K", -1), doc="a checkpoint ensemble's only: "
                                    "each member's scores, in the build's order"),),
         notes=("A checkpoint ensemble's scores are the mean of its K members' scores; each member's come back as "
                "`member_scores` FP32 [K, V] when a request names that output.",)),
    Task("predictions", "the fine-tuned head's logits and predicted label (sequence heads: one per sequence; "
         "token heads: one per token)",
         (SEQUENCES,),
         (TensorSpec("logits", DType.FP32, ("C",), doc="the head's logits (regression: its values); token heads "
                     "[-1, C], rows laid out like hiddens"),
          TensorSpec("label", DType.BYTES, (1,), doc="the argmax's name from id2label (LABEL_i where unnamed); "
                     "multi-label: the names whose sigmoid > 0.5 joined by ','; regression: the values as text; "
                     "token heads [-1]")),
         role="predictions", requires=(Requirement.CLASSIFIER,), client_method="predict",
         notes=("Token heads (*ForTokenClassification) answer `logits` [-1, C], `mask` BOOL [-1] and `label` "
                "[-1]; the label names are the config's `labels` parameter (a JSON list), its problem type "
                "`problem_type`.",)),
    Task("contacts", "residue-residue contact probabilities: ESM's contact head over the attention of every layer",
         (SEQUENCES,),
         (TensorSpec("contacts", DType.FP32, (-1, -1), doc="[L, L] symmetric probabilities, row and column i the "
                     "sequence's residue i; a request of several sequences is padded to its longest with 0"),
          TensorSpec("mask", DType.BOOL, (-1,), doc="True on the sequence's L residues (the rows and columns of "
                     "contacts that are its own)")),
         role="contacts",
         requires=(Requirement.CONTACT_HEAD,), role_defaults=RoleDefaults(Instances.ONE, batched=True),
         client_method="predict_contacts",
         notes=("Built by default for a checkpoint with the contact head (`--backend python`: its graph is written "
                "over the encoder's weights file and served by N_encoder, so the weights are stored and mapped "
                "once; with `--backend native` only when named, its own model `N_contact_graph` holding another "
                "copy of the weights).",
                "transformers' `EsmForMaskedLM.predict_contacts` / `EsmModel.predict_contacts`, computed by its own "
                "graph (`contacts.onnx`: the encoder run again with every layer's attention probabilities); the "
                "embeddings and hiddens graph is not changed by it.",
                "A sequence longer than the config's `max_residues` parameter (default: the model's limit, 1022 "
                "for ESM-2) is refused with INVALID_ARGUMENT naming its length and the limit; the work grows with "
                "L^2 x layers x heads. A graph call holds at most `pair_budget` token pairs (rows x T^2).")),
    Task("layers", "per-residue states and pooled embeddings of any layer (ESM's numbering), chosen per request",
         (SEQUENCES,
          TensorSpec("layers", DType.INT32, (-1,), doc="the layers, the same on every row: 0 the embedding layer's "
                     "output, 1..N the blocks (N after the final layer norm: N_hiddens' states), negative counted "
                     "from the end; answered in this order", default=-1, optional=True, ragged=True),
          TensorSpec("include", DType.BYTES, (-1,), doc=", ".join(LAYER_INCLUDE) + ", the same on every row: "
                     "which outputs to answer", default="mean", optional=True, ragged=True)),
         (TensorSpec("embeddings", DType.FP32, (-1, "H"), doc="include mean: [layers, H], each layer's mean over "
                     "the residues (N_embeddings' pooling)"),
          TensorSpec("embeddings_bos", DType.FP32, (-1, "H"), doc="include bos: [layers, H], the BOS/CLS token's "
                     "state"),
          TensorSpec("embeddings_max", DType.FP32, (-1, "H"), doc="include max: [layers, H], the element-wise "
                     "maximum over the residues"),
          TensorSpec("hiddens", DType.FP32, (-1, -1, "H"), doc="include per_tok: [layers, T, H], every token's "
                     "state, laid out as N_hiddens answers them (0 on padding)"),
          TensorSpec("mask", DType.BOOL, (-1,), doc="include per_tok: True exactly on the sequence's "
                     "residues/tokens")),
         role="layers",
         role_defaults=RoleDefaults(Instances.ONE, batched=True), client_method="layer_embeddings",
         notes=("Built by default (`--backend python`: its graph, every layer's states as separate outputs, is "
                "written over the encoder's weights file and served by N_encoder; with `--backend native` only "
                "when named, its own model `N_layer_graph` holding another copy of the weights). N_embeddings and "
                "N_hiddens and their encoder graph are not changed by it: the last layer's mean costs what it "
                "cost before.",
                "Each output is answered only when `include` names it (default: `embeddings`, the mean). A layer "
                "outside -(N+1)..N, an unknown choice, or `bos` of a model whose rows start with a residue "
                "(ProtT5, MegaMolBART) fails that request alone with INVALID_ARGUMENT naming the value and the "
                "allowed range (the config's `num_layers` parameter is N).",
                "N_layers asks the layers graph for the requested layers only, so the others never cross shared "
                "memory; the graph still runs every block (ONNX Runtime does not prune a graph per request), "
                "so a middle layer costs what the last does, not less.")),
    Task("attentions", "attention probabilities of chosen blocks and heads (transformers' output_attentions)",
         (SEQUENCES,
          TensorSpec("layers", DType.INT32, (-1,), doc="the blocks, the same on every row: 1..N (block i's attention; "
                     "0, the embedding layer, has none), negative counted from the end; answered in this order",
                     default=-1, optional=True, ragged=True),
          TensorSpec("heads", DType.INT32, (-1,), doc="the heads, the same on every row: 0..heads-1, negative counted "
                     "from the end; answered in this order (default: every head)", optional=True, ragged=True)),
         (TensorSpec("attentions", DType.FP32, (-1, -1, -1, -1), doc="[layers, heads, T, T] softmax probabilities, "
                     "query rows and key columns laid out as N_hiddens' tokens (BOS and EOS included), 0 past the "
                     "sequence's own tokens"),
          MASK),
         role="attentions",
         requires=(Requirement.ATTENTION_PROBABILITIES,), role_defaults=RoleDefaults(Instances.ONE, batched=True),
         client_method="attention_maps",
         notes=("Built by default for a transformers checkpoint (`--backend python`: its graph, every block's "
                "probabilities as separate outputs, is written over the encoder's weights file and served by "
                "N_encoder; with `--backend native` only when named, its own model `N_attention_graph` holding "
                "another copy of the weights); the encoder's graph keeps its fused attention.",
                "A request's answer is rows x layers x heads x T^2 values; beyond the config's "
                f"`max_attention_values` parameter (default {DEFAULT_MAX_ATTENTION_VALUES:,}, 64 MiB) it fails "
                "alone with INVALID_ARGUMENT naming the size and the limit: ask for fewer blocks or heads. A "
                "block outside -N..-1, 1..N or a head outside -heads..heads-1 fails the same way, naming the "
                "range (the config's `num_layers` and `num_heads` parameters).",
                "N_attentions asks the attentions graph for the requested blocks only; the graph still computes "
                "every block's probabilities (eager attention), so one block costs what all do to compute, "
                "not to ship.")),
)}
"""Every served task by name, in the order the docs list them."""


def get_task(name: str) -> Task:
    """The task `name`; a ValueError lists the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise InvalidInputError(f"unknown task {name!r}; tasks are {', '.join(TASKS)}") from None


def public_suffixes() -> tuple[str, ...]:
    """How public model names end: `_embeddings`, `_hiddens`, ... (internal models end otherwise)."""
    return tuple(f"_{name}" for name in TASKS)


def sibling_model(model: str, task: str) -> str:
    """The public model of `task` in the repository that serves the public model `model`
    (`esm2nv_embeddings`, contacts -> `esm2nv_contacts`); a name that is no public model's is taken
    as the repository's `--name`."""
    prefix = next((model.removesuffix(suffix) for suffix in public_suffixes() if model.endswith(suffix)), model)
    return get_task(task).model(prefix)


def task_of(model: str) -> Task | None:
    """The task a public model's name serves (None for internal models)."""
    for name, task in TASKS.items():
        if model.endswith(f"_{name}"):
            return task
    return None


REQUIREMENTS = {Requirement.ENCODER: "every family", Requirement.DECODER: "encoder-decoder families (MegaMolBART)",
                Requirement.LM_HEAD: "checkpoints with a masked-LM head",
                Requirement.ONE_CHARACTER_RESIDUES: "checkpoints with one character per residue and a mask token",
                Requirement.CLASSIFIER: "checkpoints with a fine-tuned head",
                Requirement.CONTACT_HEAD: "ESM checkpoints with a contact head",
                Requirement.ATTENTION_PROBABILITIES: "transformers encoders (not the Megatron-layout ones)"}
"""What `Task.requires` means, as the served-API table says it."""


def served_api_table(prefix: str = "N") -> str:
    """The served-API table, as the README writes it (Markdown)."""
    lines = ["| model | inputs | outputs | served for |", "|---|---|---|---|"]
    for task in TASKS.values():
        inputs = ", ".join(t.written() for t in task.required_inputs)
        if task.optional_inputs:
            inputs += "; optional " + ", ".join(t.written() for t in task.optional_inputs)
        outputs = ", ".join(t.written() for t in task.outputs)
        lines.append(f"| `{task.model(prefix)}` | {inputs} | {outputs} | {REQUIREMENTS[task.requires[0]]} |")
    return "\n".join(lines) + "\n"
