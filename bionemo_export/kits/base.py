"""What a task kit is, and the registry of kits by task.

A served task is an entry in `tasks.TASKS` (its public tensors, what a checkpoint must carry) and a
kit: a class in a module of this package, registered with `@register_kit`, that owns the rest of
the task. Its `graphs` say which ONNX graphs the build exports for it and how (`GraphExport`), its
`plan` adds its models to the repository from those graphs (model_repository/ writes them), its
`check` compares the served answers with the checkpoint's PyTorch model for `verify`, and its
`answer` is the dev server's PyTorch answer. Tasks that share all of these share a kit (embeddings
and hiddens: one encoder graph, one planner, one comparison).

The build, `verify` and the dev server look each task's kit up here (`kit_of`); none of them lists
the tasks. The package imports every module in it, so a new kit registers itself by being one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from bionemo_export.build_records import GraphRecord, GraphVerification
from bionemo_export.errors import InvalidInputError
from bionemo_export.tasks import TASKS, Graph, get_task

if TYPE_CHECKING:
    import numpy as np

    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.model_repository.plan import ModelPlan
    from bionemo_export.models import LoadedModel

    from .comparison import TaskCheck, VerifyContext
    from .dev import DevAnswers


@dataclass(frozen=True)
class GraphExport:
    """Where a graph of tasks.Graph comes from: `source(loaded, encoder check batches)` gives the
    module, its input and output specs and the batches that check the export against it."""

    source: Callable[[LoadedModel, list[dict]], tuple[Any, Any, Any, list[dict]]]
    mask_input: str = "attention_mask"
    """The input whose zeros mark padding in the check (""): outputs compared whole)."""
    encoder: bool = False
    """Exported in the request's precision and graph-optimized (the encoder's graph only)."""
    optimized: bool = False
    """Graph-optimized as the encoder's is, but kept in fp32 (a second copy of the encoder that serves
    its states: the same fusions apply, measured 1.22x faster for the real AntiBERTy's layers graph)."""


@dataclass(frozen=True)
class ExportedGraph:
    """One graph exported and checked; `files` are what goes into its model's version folder."""

    name: str
    files: dict[str, Path]
    record: GraphRecord
    verification: GraphVerification


@dataclass(frozen=True)
class PlanContext:
    """What a kit's `plan` reads: the repository's `--name`, the loaded checkpoint, every task the
    build serves, the serving options and the graphs exported for them (by name: "encoder",
    "lm_head", ...)."""

    name: str
    loaded: LoadedModel
    tasks: tuple[str, ...]
    serving: ServingOptions
    graphs: Mapping[str, ExportedGraph]
    max_decode_length: int | None = None
    """Most tokens per decode (encoder-decoder families; None: the model's limit)."""

    def graph_files(self, graph: Graph) -> dict[str, Path]:
        """The files of an exported graph (its version folder's)."""
        return self.graphs[graph.value].files


Requests = Sequence[Mapping[str, "np.ndarray"]]
"""What the dev server (PyTriton) hands an inference callable: one mapping of input name -> array per request."""
Answers = list[dict[str, "np.ndarray"]]


class TaskKit(ABC):
    """One kit: the tasks it serves and, for them, the graphs, the plan, the check and the dev answer."""

    tasks: ClassVar[tuple[str, ...]]
    """Entries of tasks.TASKS this kit serves."""
    graphs: ClassVar[Mapping[Graph, GraphExport]] = {}
    """The graphs the build exports for these tasks and how (every build also exports the encoder's,
    which the embeddings kit owns)."""
    plans_base: ClassVar[bool] = False
    """Whether `plan` lays out the repository itself (tokenizer, encoder, the public embeddings and
    hiddens) when `is_base` says so for the checkpoint; other kits add their models to it."""

    def is_base(self, loaded: LoadedModel) -> bool:
        """Whether this kit plans the repository's base for `loaded` (kits with `plans_base` only)."""
        return False

    @abstractmethod
    def plan(self, context: PlanContext) -> list[ModelPlan]:
        """The models that serve this kit's tasks of `context.tasks` (model_repository/ plans them)."""

    @abstractmethod
    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        """`verify`: the served answers of `tasks` (this kit's, those the checkpoint carries) against PyTorch."""

    @abstractmethod
    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        """The dev server's answers to `requests` of `task` from the PyTorch model, one dict per request."""


KITS: dict[str, TaskKit] = {}
"""Each task's kit by task name (filled by `register_kit` when the package imports its modules)."""

Kit = TypeVar("Kit", bound=TaskKit)


def register_kit(cls: type[Kit]) -> type[Kit]:
    """Class decorator: make `cls` the kit of each of its `tasks` (each an entry of tasks.TASKS, no
    other kit's)."""
    kit = cls()
    for task in cls.tasks:
        get_task(task)  # an entry of the table: InvalidInputError listing them otherwise
        if task in KITS:
            raise ValueError(f"task {task!r} has two kits: {type(KITS[task]).__name__} and {cls.__name__}")
        KITS[task] = kit
    return cls


def kit_of(task: str) -> TaskKit:
    """The kit of `task` (an entry of tasks.TASKS); the error says how to add one."""
    get_task(task)
    if task not in KITS:
        raise InvalidInputError(f"task {task!r} has no kit: add a module to bionemo_export/kits/ with a TaskKit for "
                                "it (docs/developing.md, Adding a task)")
    return KITS[task]


def kits_of(tasks: Iterable[str]) -> list[TaskKit]:
    """The kits of `tasks`, each once, in the order of the task table."""
    wanted = set(tasks)
    return list({id(kit): kit for kit in (kit_of(t) for t in TASKS if t in wanted)}.values())


def graph_exports() -> dict[Graph, GraphExport]:
    """Every kit's graph exports, in the order of tasks.Graph (the order a build exports them in)."""
    found = {graph: export for kit in KITS.values() for graph, export in kit.graphs.items()}
    return {graph: found[graph] for graph in Graph if graph in found}


def needed_graphs(tasks: Iterable[str]) -> set[Graph]:
    """The graphs a build of `tasks` exports: the encoder's, and each task's kit's."""
    return {Graph.ENCODER} | {graph for task in tasks for graph in kit_of(task).graphs}
