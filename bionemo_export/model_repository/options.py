"""How each served model is scheduled: the settings belong to the model's ROLE, in one place.

A repository's models play a few roles; every setting that tunes one (instances, ONNX Runtime
threads, dynamic batching, length buckets, token budget, response cache) is decided here, by
`ServingOptions.role(name)`, and the planners (encoder.py, seq2seq.py) only read it:

Each role (the model it is, for `--name N`): what tunes it.
- `tokenizer` (`N_tokenizer`, ensemble layout only): instances, dynamic batching.
- `encoder` (`N_encoder`: the exported encoder graph and, in the fused layout, the tokenizer):
  instances, threads, dynamic batching, length buckets, token budget.
- `embeddings`, `hiddens` (`N_embeddings`, `N_hiddens`: the public entry points, ensembles): response cache.
- `cross_kv`, `decoder_step` (the decoding graphs, called by BLS, not batched by Triton): instances, threads.
- `decodes`, `samplings` (the decode loops: Python, BLS): instances, dynamic batching; `limits` (samplings).
- `lm_head` (`N_lm_head`: the masked-LM head graph, hiddens -> log_probs): as the encoder: instances,
  threads, dynamic batching, token budget.
- `logits` (`N_logits`: public ensemble, encoder steps then N_lm_head): response cache.
- `scores` (`N_scores`: masked copies and scores, Python, BLS to N_logits): instances
  (sampling_instances), dynamic batching.
- `classifier` (`N_classifier`: the fine-tuned head graph, hiddens -> logits): as the encoder:
  instances, threads, dynamic batching.
- `labels` (`N_labels`: logits -> label names, Python): instances, dynamic batching.
- `predictions` (`N_predictions`: public ensemble, encoder steps, N_classifier, N_labels): response cache.
- `contact_graph` (`N_contact_graph`: the contacts graph, called by BLS, not batched by Triton): instances,
  threads.
- `contacts` (`N_contacts`: Python, tokenizes and calls N_contact_graph): instances, dynamic batching.
- `layer_graph` (`N_layer_graph`: every layer's states, called by BLS, not batched by Triton): instances,
  threads.
- `layers` (`N_layers`: Python, tokenizes, calls N_layer_graph and pools): instances, dynamic batching.
- `attention_graph` (`N_attention_graph`: every block's attention probabilities, called by BLS, not
  batched by Triton): instances, threads.
- `attentions` (`N_attentions`: Python, tokenizes, calls N_attention_graph and picks the heads):
  instances, dynamic batching.
With `--backend python` there are no N_contact_graph, N_layer_graph, N_attention_graph: N_encoder
hosts their graphs over its weights file (hosted_graphs.py), so they run on the encoder's
instances and threads, and the `*_graph` roles' settings do not apply.

Defaults and why (measured on 2-core CPU hosts; see docs/benchmarks.md):
- `layout="auto"`: with `--backend python` the encoder model tokenizes and runs the graph itself
  ("fused": one Python model behind the public ensembles, no tokenizer hop); with
  `--backend native` or `tensorrt` Triton's own runtime runs the graph, so a Python tokenizer
  model feeds it ("ensemble", the two-step layout).
- ONNX Runtime threads: 0 = "auto", resolved when the SERVER loads the model (the repository is
  usually served on another machine than the one that built it): from the cores the server process
  may use (CPU affinity, bounded by a cgroup quota) and the model's instance count, every core per
  instance while all instances together have at most two threads per core
  (bionemo_export/serving/host.py). Idle threads sleep (`allow_spinning` off): spinning threads
  take the cores from Triton, the other instances and clients on the same host. Each graph model
  sizes its pool that way: they seldom run at the same time (a decode loop calls cross_kv, then
  decoder_step, in turn); give a role `threads` to split the cores between models instead.
- One instance of each graph model, its ONNX Runtime pool on every core: the dynamic batcher
  then hands it every request that queued while it ran, so batches are real (5.1 at concurrency 8,
  11.8 at 32). Measured side by side on 2 cores (benchmarks/results/encoder_instances.md, real
  AntiBERTy, perf_analyzer on the same host): 1 x 2 threads served 36.4 seq/s at concurrency 8 and
  32 against 34.9 / 32.9 for 2 instances x 2 threads (which split the batches, 2.3 at c8, and
  oversubscribe the cores), with the same latency at concurrency 1 (30.2 ms); 2 x 1 thread
  served 37.1-37.3 under load but doubled the latency at concurrency 1 (54 ms). An earlier
  measurement favouring 2 x 2 was taken on a loaded machine. Spinning threads lost a third of the
  throughput; the memory arena gained nothing (34.0 seq/s).
- Admission control on every batched model: at most `max_queue_size` (64) requests wait and none
  waits longer than `queue_timeout_s` (30 s); Triton answers the rest at once with UNAVAILABLE
  (HTTP 503), through the public ensembles too (measured on Triton 2.51: 26 of 30 simultaneous
  requests to a queue of 2 refused within 0.03 s). Without it a one-molecule request waited 71 s
  behind 20 abandoned sampling requests.
- Dynamic batching without a queue delay: while an instance runs (tens of milliseconds on a CPU),
  the next requests queue and are handed over together, so batches form under load with no delay
  added at low load.
- One instance of N_decodes (joined batches: 0.81x of in-process batch-8 decoding at
  concurrency 8, 0.63x with two instances, which split the queue), two of N_samplings, and
  limits on one request's work
  (`GenerationLimits`: num_samples <= 32, beam_size <= 16, num_samples x beam_size <= 64, at most
  32768 tokens of hidden states per decode; the decode length is the build's max_decode_length):
  a long sampling request holds one instance while the other answers the rest, and a client's
  deadline or cancellation ends its decode loop between steps.
- ONNX Runtime's CPU memory arena within each run, shrunk at its end (choices.MemoryArena.RUN),
  and malloc_trim after large requests: a stub's heap goes back to its size before a large request
  (measured: a tiny MegaMolBART encoder instance kept ~170 MiB after one 32 x 510-token request
  with the arena kept, ~2 MiB without it), while a run's layers reuse one another's pages (1.2x to
  1.4x an ESM-2 150M's throughput against no arena).
- Length buckets of 16 tokens and a token budget of 8192 tokens per graph call (see
  bionemo_export/serving/batching.py): rows of every request the batcher hands over are sorted by
  length and padded to a multiple of 16 tokens, so requests of different lengths run together with
  little padding; a sub-batch holds at most 8192 tokens (e.g. 64 rows of 128, 8 of 1024), which
  bounds the attention memory of long sequences.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from bionemo_export.choices import Device, Layout, MemoryArena
from bionemo_export.errors import UserError
from bionemo_export.tasks import DEFAULT_MAX_ATTENTION_VALUES, TASKS, Instances

from .backends import BACKENDS, ServingBackend, get_backend
from .plan import DynamicBatching

INTERNAL_ROLES = ("tokenizer", "encoder", "cross_kv", "decoder_step", "lm_head", "classifier", "labels",
                  "contact_graph", "layer_graph", "attention_graph")
"""The roles of models no task is served by directly; each task's model plays the task's `role`."""
AUTO_THREADS = "auto"


def roles() -> tuple[str, ...]:
    """Every role a model may play: the internal ones and those of the task table's entries."""
    return (*INTERNAL_ROLES, *(task.role for task in TASKS.values() if task.role not in INTERNAL_ROLES))


class OptionsError(UserError, ValueError):
    """Serving options that cannot work together or are out of range; the message names the fields
    (in backticks: errors.py) and what to change."""


@dataclass(frozen=True)
class RoleOptions:
    """The settings of one served model (see the module docstring for who gets what)."""

    instances: int = 1
    """Model instances (Triton's instance_group count)."""
    threads: int = 0
    """ONNX Runtime intra-op threads per instance; 0: auto, resolved by the serving host."""
    batching: DynamicBatching | None = None
    """Triton's dynamic batcher; None: not batched by Triton."""
    length_bucket: int = 0
    """Rows are padded to a multiple of this many tokens (1: to their own length; 0: all to the
    longest row, plain dynamic batching)."""
    token_budget: int = 0
    """Most tokens (rows x padded length) in one graph call; 0: no limit."""
    max_sub_batch: int = 0
    """Most rows in one graph call (the largest sub-batch); 0: only the token budget bounds it."""
    allow_spinning: bool = False
    """Let ONNX Runtime's idle threads spin (lower latency on a host with nothing else to run)."""
    memory_arena: MemoryArena = MemoryArena.RUN
    """ONNX Runtime's CPU memory arena (choices.MemoryArena): by default used within each run and
    shrunk at its end, so memory goes back to the system after every run."""
    response_cache: bool = False

    def __post_init__(self) -> None:
        for name in ("instances",):
            if getattr(self, name) < 1:
                raise OptionsError(f"`{name}` must be at least 1")
        for name in ("threads", "length_bucket", "token_budget", "max_sub_batch"):
            if getattr(self, name) < 0:
                raise OptionsError(f"`{name}` must be 0 or more")

    def session_parameters(self) -> dict[str, str]:
        """Config `parameters` that serving/onnx_session.py reads to open an ONNX Runtime session."""
        return {
            "intra_op_threads": str(self.threads) if self.threads else AUTO_THREADS,
            "allow_spinning": "true" if self.allow_spinning else "false",
            "memory_arena": MemoryArena(self.memory_arena).value,
        }

    def batching_parameters(self) -> dict[str, str]:
        """Config `parameters` that say how a model batches rows of different lengths (the
        encoder's model.py; the tokenizer model's padding in the ensemble layout)."""
        return {"length_bucket": str(self.length_bucket), "token_budget": str(self.token_budget),
                "max_sub_batch": str(self.max_sub_batch)}


@dataclass(frozen=True)
class GenerationLimits:
    """The most work one decoding request may ask for: written into the `parameters` of the
    samplings (and decodes) configs and enforced there before any work, with INVALID_ARGUMENT
    naming the limit. Without them one in-limit request (64 samples x 64 beams) decoded for a
    minute, held an instance the whole time and left the server gigabytes larger."""

    max_num_samples: int = 32
    """Most `num_samples` per request."""
    max_beam_size: int = 16
    """Most `beam_size` per request."""
    max_samples_x_beams: int = 64
    """Most hypotheses decoded side by side per input sequence (num_samples x beam_size for the
    beam-search-perturbate methods, num_samples otherwise)."""
    max_decode_tokens: int = 32768
    """Most tokens of hidden states one decode attends to: rows (sequences x hypotheses) x source
    length, per request and per batch of requests decoded together. It bounds the decoder's
    key/value caches, which cross Triton's shared memory at every step (BLS calls), and the
    Python backend's shared-memory pools keep their high-water mark for good. 32768 tokens: e.g.
    32 sequences of 512 tokens x 2 samples, or 64 hypotheses of one 512-token sequence."""
    max_hidden_magnitude: float = 1e4
    """Largest |value| of the hidden states a decode accepts (decodes' input, samplings' perturbed
    states). Encoder outputs come from a layer norm (tens at most); far larger ones make the
    decoder compute garbage (1e38 decoded to empty strings) or overflow."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 1:
                raise OptionsError(f"`{name}` must be at least 1, got {value}")

    def parameters(self, *names: str) -> dict[str, str]:
        """Config `parameters`: the limits `names` (all of them when none is named)."""
        return {name: str(value) for name, value in vars(self).items() if not names or name in names}


@dataclass(frozen=True)
class ServingOptions:
    """How the repository's models are scheduled; every field has a sensible CPU default.

    The flat fields are what the command line sets; `role()` turns them into each model's
    settings, and `roles` overrides a role's settings outright (e.g. `{"decodes": RoleOptions(
    instances=2, batching=...)}`)."""

    backend: str = "python"
    """Where the graphs run (backends.py): python (ONNX Runtime inside a Python-backend model),
    native (Triton's onnxruntime_onnx), tensorrt (Triton's tensorrt_plan)."""
    device: str | None = None
    """cpu or gpu (a `Device`; a plain string is read as one): the instance kind of the models that
    run graphs (None: the backend's default, gpu for tensorrt, cpu otherwise)."""
    max_batch_size: int = 32
    tokenizer_instances: int = 1
    """Instances of the tokenizer model (ensemble layout)."""
    encoder_instances: int = 1
    """Instances of each graph-running model (encoder; cross_kv and decoder_step in the ensemble layout)."""
    decode_instances: int = 1
    """Instances of N_decodes: one, so that the dynamic batcher hands it every queued request and
    they decode as one batch (two instances split them: 0.63x of in-process batch-8 decoding at
    concurrency 8 against 0.81x with one, benchmarks/results/serving.md). A decode's work is
    bounded (max_decode_tokens) and ends between steps when its client gives up."""
    sampling_instances: int = 2
    """Instances of N_samplings: while one runs a long request (many samples or beams), the other
    answers the rest."""
    limits: GenerationLimits = GenerationLimits()
    """Bounds on one decoding request's work (samplings)."""
    max_attention_values: int = DEFAULT_MAX_ATTENTION_VALUES
    """N_attentions: the largest answer (rows x blocks x heads x T^2 values) one request gets; its
    config parameter of the same name."""
    max_queue_delay_microseconds: int = 0
    max_queue_size: int = 64
    """Admission control: most requests waiting for each batched model (encoder, tokenizer, decode
    loops); Triton answers the next one at once with UNAVAILABLE / HTTP 503 instead of letting the
    queue and every client's latency grow without bound. 64 requests of up to max_batch_size rows
    are far more than a CPU instance finishes within the queue timeout. 0: no bound."""
    queue_timeout_s: float = 30.0
    """Admission control: most seconds a request waits in a queue before Triton rejects it
    (UNAVAILABLE / 503): abandoned requests (an HTTP client that hung up is not cancelled by
    Triton 2.51) leave the queue by then. Clients may ask for less. 0: no bound."""
    response_cache: bool = False
    truncate: bool = False
    """Cut sequences over the maximum length instead of refusing them."""
    intra_op_threads: int = 0
    """ONNX Runtime threads per graph-model instance (0: auto, from the serving host's cores)."""
    warmup: bool = True
    layout: str = Layout.AUTO
    """fused: the encoder model tokenizes (python backend); ensemble: tokenizer model -> encoder
    model; auto: fused with the python backend, ensemble with native."""
    length_bucket: int = 16
    """Encoder rows are padded to a multiple of this many tokens (1: to their own length; 0: all to
    the longest row of the batch, plain dynamic batching)."""
    token_budget: int = 8192
    """Most tokens (rows x padded length) in one encoder graph call (0: no limit)."""
    max_sub_batch: int = 0
    """Most rows in one encoder graph call (0: no row limit, the token budget alone bounds it).
    `bionemo-export tune` finds the host's best (2-4 rows for the real AntiBERTy on 2 cores)."""
    max_residues: int = 0
    """Proteins longer than the model's window (e.g. 10000): such sequences run as overlapping
    windows merged by serving/windows.py's documented rule (the fused layout, --backend python).
    0: no windows; over-long input is the error it always was."""
    window_overlap: int = 0
    """Residues consecutive windows share at least (0: a quarter of the window)."""
    roles: Mapping[str, RoleOptions] = field(default_factory=dict)
    """Per-role overrides of what the fields above decide."""

    def __post_init__(self) -> None:
        # Plain strings are accepted (library callers, manifests): stored as the choices they name.
        if self.device is not None:
            object.__setattr__(self, "device", Device.parse(self.device, "device"))
        object.__setattr__(self, "layout", Layout.parse(self.layout, "layout"))
        backend = self.serving_backend  # checks the backend's name and device
        if self.layout == Layout.FUSED and not backend.runs_python:
            raise OptionsError(f"the fused layout runs the graph in a Python-backend model: use `backend` "
                               f"{_python_backends()}")
        if self.max_batch_size < 1:
            raise OptionsError("`max_batch_size` must be at least 1")
        for name in ("tokenizer_instances", "encoder_instances", "decode_instances", "sampling_instances"):
            if getattr(self, name) < 1:
                raise OptionsError(f"`{name}` must be at least 1")
        if self.max_residues and not self.fused:
            raise OptionsError("`max_residues` runs windows inside the encoder model, which the fused layout has: "
                               f"use `backend` {_python_backends()}")
        if self.window_overlap and not self.max_residues:
            raise OptionsError("`window_overlap` needs `max_residues` (windows are off)")
        for name in ("max_queue_delay_microseconds", "intra_op_threads", "length_bucket", "token_budget",
                     "max_sub_batch", "max_queue_size", "queue_timeout_s", "max_residues", "window_overlap"):
            if getattr(self, name) < 0:
                raise OptionsError(f"`{name}` must be 0 or more")
        unknown = set(self.roles) - set(roles())
        if unknown:
            raise OptionsError(f"unknown roles {sorted(unknown)} in `roles`; roles are {roles()}")

    @property
    def serving_backend(self) -> ServingBackend:
        """The backend object that plans the graph models (backends.py)."""
        return get_backend(self.backend, self.device)

    @property
    def fused(self) -> bool:
        """True when the encoder model tokenizes itself (no separate tokenizer model)."""
        return self.layout == Layout.FUSED or (self.layout == Layout.AUTO and self.serving_backend.runs_python)

    def preferred_batch_sizes(self) -> tuple[int, ...]:
        return tuple(sorted({s for s in (8, 16, 32, 64) if s < self.max_batch_size} | {self.max_batch_size}))

    def dynamic_batching(self) -> DynamicBatching:
        return DynamicBatching(self.preferred_batch_sizes(), self.max_queue_delay_microseconds,
                               self.max_queue_size, round(self.queue_timeout_s * 1e6))

    def role(self, name: str) -> RoleOptions:
        """The settings of the model playing role `name`."""
        if name not in roles():
            raise OptionsError(f"unknown role {name!r}; roles are {roles()}")
        if name in self.roles:
            return self.roles[name]
        if name == "encoder":
            return RoleOptions(instances=self.encoder_instances, threads=self.intra_op_threads,
                               batching=self.dynamic_batching(), length_bucket=self.length_bucket,
                               token_budget=self.token_budget, max_sub_batch=self.max_sub_batch)
        # called by BLS, batched by their callers
        if name in ("cross_kv", "decoder_step", "contact_graph", "layer_graph", "attention_graph"):
            return RoleOptions(instances=self.encoder_instances, threads=self.intra_op_threads)
        if name in ("lm_head", "classifier"):  # batched like the encoder, whose outputs they take
            return RoleOptions(instances=self.encoder_instances, threads=self.intra_op_threads,
                               batching=self.dynamic_batching(), token_budget=self.token_budget)
        if name in INTERNAL_ROLES:  # the tokenizer, the labels
            return RoleOptions(instances=self.tokenizer_instances, batching=self.dynamic_batching())
        defaults = next(task.role_defaults for task in TASKS.values() if task.role == name)
        instances = 1 if defaults.instances is Instances.ONE else getattr(self, defaults.instances.value)
        return RoleOptions(instances=instances, batching=self.dynamic_batching() if defaults.batched else None,
                           response_cache=self.response_cache if defaults.response_cache else False)

    def with_role(self, name: str, **changes) -> ServingOptions:
        """A copy whose role `name` has `changes` applied on top of its current settings."""
        return replace(self, roles={**self.roles, name: replace(self.role(name), **changes)})


def _python_backends() -> str:
    """The backends whose graphs run in Python-backend models (the fused layout's, windows')."""
    return " or ".join(name for name, cls in BACKENDS.items() if cls.runs_python)
