"""What the tool sees in a checkpoint before it builds anything (`bionemo-export inspect`).

The report runs the same steps as `build repo` up to the PyTorch modules, and stops there: the
reader (form, parallel layout, entries it skipped), the family's conversion (sizes, tokenizer,
heads, the stored tensors it leaves out and why) and the strict load (missing, unexpected or
mis-shaped keys, reported as problems instead of raised), then the tasks a build would serve
(`build.servable_tasks`, the rule `build repo` applies) and the command that builds them, and
the memory a build needs here (`build.estimate_build_memory`, by the path the build will take) against
what this host has available.
"""

from __future__ import annotations

import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bionemo_export.build import estimate_build_disk, estimate_build_memory, servable_tasks, unserved_tasks
from bionemo_export.memory_plan import serve_memory
from bionemo_export.models.base import REGISTRY, LoadedModel, ModelDescription, get_family, infer_family
from bionemo_export.models.readers import READERS, Checkpoint, CheckpointError, read_checkpoint
from bionemo_export.models.readers.base import KeyMismatchError
from bionemo_export.tasks import get_task

MOST_LISTED = 12
"""Keys listed per group on screen (--json lists them all)."""


@dataclass
class CheckpointReport:
    """Everything `inspect` reports; `to_dict` is its --json form."""

    checkpoint: str
    form: str
    form_description: str
    model_class: str | None
    family: str | None
    sizes: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    parallel: dict[str, int] = field(default_factory=dict)
    keys: dict[str, Any] = field(default_factory=dict)
    heads: dict[str, Any] = field(default_factory=dict)
    tasks: list[str] = field(default_factory=list)
    on_request: list[str] = field(default_factory=list)
    """Tasks it can serve that a build serves only when `--tasks` names them (Task.by_default)."""
    not_served: dict[str, str] = field(default_factory=dict)
    """The family's tasks this checkpoint cannot serve, with why (what it lacks)."""
    problems: list[str] = field(default_factory=list)
    command: str | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    """What a build needs at its peak, per precision ("fp32", and "quantized" where that differs),
    what serving the built repository needs (fp32 and int4, one encoder instance), and the memory
    available here (`memory_report`)."""

    @property
    def ok(self) -> bool:
        """Whether `build repo` would get past loading this checkpoint."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

    def render(self) -> str:
        """One screen of text."""
        lines = [f"checkpoint  {self.checkpoint}",
                 f"form        {self.form}: {self.form_description}",
                 f"family      {self.family or '(unknown: name it with --model)'}"
                 + (f"  [{self.model_class}]" if self.model_class else "")]
        if self.sizes:
            lines.append("sizes       " + ", ".join(f"{k} {v}" for k, v in self.sizes.items()))
        if self.tokenizer:
            lines.append("tokenizer   " + ", ".join(f"{k} {v}" for k, v in self.tokenizer.items()))
        parallel = (" x ".join(f"{size} {kind}" for kind, size in self.parallel.items()) + " ranks, merged on import"
                    if self.parallel else "single rank")
        lines.append(f"parallel    {parallel}")
        if self.keys:
            keys = self.keys
            lines.append(f"keys        {keys['stored']} stored, {len(keys['skipped'])} skipped by the reader, "
                         f"{len(keys['left_out'])} left out by the family; the rest mapped to the model's "
                         f"{keys['mapped']} tensors (fused ones split)")
            for title in ("skipped", "left_out"):
                lines += _listed(title.replace("_", " "), keys[title])
            for title in ("missing", "unexpected", "wrong_shapes"):
                if keys.get(title):
                    shown = ", ".join(keys[title][:MOST_LISTED])
                    more = f" and {len(keys[title]) - MOST_LISTED} more" if len(keys[title]) > MOST_LISTED else ""
                    lines.append(f"  {title.replace('_', ' ')}: {len(keys[title])}: {shown}{more}")
        if self.heads:
            lines.append("heads       " + ", ".join(f"{k} {v}" for k, v in self.heads.items()))
        lines.append(f"tasks       {', '.join(self.tasks) if self.tasks else '(none: see the problems)'}")
        if self.on_request:
            lines.append(f"            and when --tasks names them: {', '.join(self.on_request)}")
        for why in dict.fromkeys(self.not_served.values()):
            lines.append(f"not served  {why}")
        available = self.memory.get("available_bytes")
        for precision, estimate in self.memory.get("builds", {}).items():
            fits = "fits" if estimate["fits"] else "does NOT fit"
            here = "" if available is None else f"; {fits} the {available / 2**30:.1f} GiB available here"
            lines.append(f"memory      {precision}: about {estimate['needed_bytes'] / 2**30:.1f} GiB "
                         f"({estimate['factor']} x {estimate['weights_bytes'] / 2**30:.1f} GiB of fp32 weights, "
                         f"{estimate['path']}){here}; writes about {estimate['disk_bytes'] / 2**30:.1f} GiB of "
                         "disk beside its --out")
        for precision, estimate in self.memory.get("serves", {}).items():
            fits = "fits" if estimate["fits"] else "does NOT fit"
            here = "" if available is None else f"; {fits} here"
            lines.append(f"serving     {precision}: {estimate['text']}{here}")
        for problem in self.problems:
            lines.append(f"problem     {problem}")
        if self.command:
            lines.append(f"build with  {self.command}")
        return "\n".join(lines)


def memory_report(path: Path, available: int | None = -1) -> dict[str, Any]:
    """The memory a build of `path` needs (build.estimate_build_memory; with the disk it writes,
    build.estimate_build_disk) in fp32 and, where it differs, in int4 (streamed where the other
    path does not fit), and what serving it needs built in fp32 and in int4
    (memory_plan.serve_memory), each with whether it fits `available` bytes (-1: the memory
    available here; None: unknown)."""
    from bionemo_export.procfs import available_memory_bytes

    if available == -1:
        available = available_memory_bytes()
    builds: dict[str, Any] = {}
    for label, precision in (("fp32", "fp32"), ("quantized", "int4")):
        estimate = estimate_build_memory(path, precision, available)  # by the path a build here takes
        entry = {"path": estimate.path, "factor": estimate.factor, "weights_bytes": estimate.weights,
                 "needed_bytes": estimate.needed, "why": estimate.why,
                 "fits": available is None or estimate.needed <= available,
                 "disk_bytes": estimate_build_disk(path, estimate, precision).needed}
        fp32 = builds.get("fp32")
        if fp32 and (entry["needed_bytes"], entry["path"]) == (fp32["needed_bytes"], fp32["path"]):
            continue  # the same memory by the same path: one line says it
        builds[label] = entry
    serves: dict[str, Any] = {}
    for precision in ("fp32", "int4"):
        served = serve_memory(builds["fp32"]["weights_bytes"], precision)
        serves[precision] = {"needed_bytes": served.needed, "weights_bytes": served.weights, "text": served.text(),
                             "fits": available is None or served.needed <= available}
    return {"available_bytes": available, "builds": builds, "serves": serves}


def _listed(title: str, entries: dict[str, str]) -> list[str]:
    """Keys grouped by reason, a few of each shown."""
    by_reason: dict[str, list[str]] = {}
    for key, why in entries.items():
        by_reason.setdefault(why, []).append(key)
    lines = []
    for why, keys in by_reason.items():
        shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        lines.append(f"  {title}: {len(keys)} ({why}): {shown}")
    return lines[:MOST_LISTED]


def inspect_checkpoint(path: Path, family: str | None = None, max_length: int | None = None) -> CheckpointReport:
    """The report of the checkpoint at `path` read as `family` (inferred when the checkpoint says
    what it is, or when one family alone reads it). CheckpointError only when the checkpoint
    cannot be read at all; what stops a build is in `problems`."""
    return _inspect(Path(path), family, max_length)[0]


@dataclass
class EnsembleReport:
    """What `inspect` reports for several checkpoints: each member's report, and whether they can be
    served as one ensemble (models/members.py)."""

    members: list[CheckpointReport]
    tasks: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    command: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems and all(member.ok for member in self.members)

    def to_dict(self) -> dict[str, Any]:
        return {"members": [member.to_dict() for member in self.members], "tasks": self.tasks,
                "problems": self.problems, "command": self.command, "ok": self.ok}

    def render(self) -> str:
        lines = []
        for number, member in enumerate(self.members, 1):
            lines += [f"== member {number} of {len(self.members)}", member.render(), ""]
        lines.append(f"ensemble    {len(self.members)} members: "
                     + ("they can be served as one" if self.ok else "they cannot be served as one"))
        if self.tasks:
            lines.append(f"tasks       {', '.join(self.tasks)} (the mean of the members' log-probabilities; each "
                         "member's on request)")
        for problem in self.problems:
            lines.append(f"problem     {problem}")
        if self.command:
            lines.append(f"build with  {self.command}")
        return "\n".join(lines)


def inspect_ensemble(paths: list[Path], family: str | None = None, max_length: int | None = None) -> EnsembleReport:
    """The reports of several checkpoints given as one ensemble, and whether a build would serve
    them as one: every member readable and buildable, and each agreeing with the first in family,
    masked-LM head, alphabet and tokenizer (models/members.py says why; `problems` names the member
    and what differs)."""
    from bionemo_export.models.members import ENSEMBLE_TASKS, MemberFacts, MemberMismatch, check_member

    report = EnsembleReport(members=[])
    first: MemberFacts | None = None
    for number, path in enumerate(paths, 1):
        member, loaded = _inspect(Path(path), family, max_length)
        report.members.append(member)
        if loaded is None:
            report.problems.append(f"member {number} ({path}) cannot be built: see its problems above")
            continue
        facts = MemberFacts.of(loaded)
        if number == 1:
            first = facts
            report.tasks = [task for task in ENSEMBLE_TASKS if task in member.tasks]
            if "logits" not in report.tasks:
                report.problems.append(f"member 1 ({path}) has no masked-LM head: an ensemble serves the mean of "
                                       "the members' log-probabilities")
        elif first is not None:
            try:
                check_member(first, facts, number)
            except MemberMismatch as err:
                report.problems.append(str(err))
    if len({Path(p).resolve() for p in paths}) != len(paths):
        report.problems.append("a checkpoint is given twice: an ensemble of one checkpoint twice weighs it twice; "
                               "give each once")
    if report.ok and report.members[0].family:
        name = report.members[0].family
        command = ["bionemo-export", "build", "repo"]
        for path in paths:
            command += ["--checkpoint", str(path)]
        report.command = shlex.join(command + ["--model", name, "--name", name, "--out", f"{name}_repository"])
    return report


def _inspect(path: Path, family: str | None, max_length: int | None) -> tuple[CheckpointReport, LoadedModel | None]:
    """inspect_checkpoint's report, and the model loaded (None where the report stops before)."""
    checkpoint = read_checkpoint(path)
    report = CheckpointReport(checkpoint=str(path), form=checkpoint.form,
                              form_description=READERS[checkpoint.form].description,
                              model_class=checkpoint.model_class, family=None, parallel=dict(checkpoint.parallel),
                              memory=memory_report(path))
    try:
        name = family or _family_of(checkpoint)
    except CheckpointError as err:
        report.problems.append(str(err))
        return report, None
    if name is None:
        report.problems.append(f"no family reads this {checkpoint.form} checkpoint as it is; name one with --model "
                               f"({', '.join(sorted(REGISTRY))}) to see why")
        return report, None
    report.family = name
    reader = get_family(name)
    try:
        description = reader.describe(checkpoint, max_length)
    except (CheckpointError, ValueError) as err:
        report.problems.append(str(err))
        return report, None
    _describe_keys(report, checkpoint, description)
    try:
        loaded = reader.build(description)
    except KeyMismatchError as err:
        report.keys.update(missing=err.missing, unexpected=err.unexpected, wrong_shapes=err.wrong_shapes)
        report.problems.append(str(err))
        return report, None
    except (CheckpointError, ValueError) as err:
        report.problems.append(str(err))
        return report, None
    _describe_model(report, loaded)
    servable = servable_tasks(loaded, reader.possible_tasks(), asked=False)
    report.tasks = [task for task in servable if get_task(task).by_default]
    report.on_request = [task for task in servable if not get_task(task).by_default]
    report.not_served = unserved_tasks(loaded, reader.possible_tasks())
    command = ["bionemo-export", "build", "repo", "--checkpoint", str(path), "--model", name,
               "--name", name, "--out", f"{name}_repository"]
    builds = report.memory["builds"]
    if not builds["fp32"]["fits"] and builds.get("quantized", {}).get("fits"):
        command += ["--precision", "int4"]  # what builds here: fp32 would be refused
    report.command = shlex.join(command)
    return report, loaded


def _family_of(checkpoint: Checkpoint) -> str | None:
    """The family a checkpoint names (a .nemo target, a form only one family reads), else the one
    family that describes it without error; None when none or several do."""
    from bionemo_export.models.base import CONFIG_FILES, form_family

    if checkpoint.form in CONFIG_FILES:
        return infer_family(checkpoint)
    if (found := form_family(checkpoint)) is not None:
        return found
    readers = [name for name, cls in sorted(REGISTRY.items()) if checkpoint.form in cls.forms()]
    fitting = []
    for name in readers:
        try:
            get_family(name).describe(checkpoint)
        except (CheckpointError, ValueError):
            continue
        fitting.append(name)
    return fitting[0] if len(fitting) == 1 else None


def _describe_keys(report: CheckpointReport, checkpoint: Checkpoint, description: ModelDescription) -> None:
    heads = [head.weights for head in (description.lm_head, description.classifier, description.contact_head)
             if head is not None]
    report.keys = {
        "stored": len(checkpoint.weights) + len(checkpoint.skipped),
        "mapped": len(description.state_dict) + sum(len(weights) for weights in heads),
        "skipped": dict(checkpoint.skipped),
        "left_out": dict(description.left_out),
    }


def _describe_model(report: CheckpointReport, loaded: LoadedModel) -> None:
    sizes = {key: loaded.description[key] for key in ("architecture", "layers", "hidden", "heads", "parameters")
             if key in loaded.description}
    if "parameters" in sizes:
        sizes["parameters"] = f"{sizes['parameters'] / 1e6:.2f}M"
    report.sizes = sizes
    tokenizer = loaded.tokenizer
    report.tokenizer = {"kind": type(tokenizer).__name__, "vocabulary": tokenizer.vocab_size,
                        "max tokens": tokenizer.max_length,
                        "specials": " ".join(t for t in (tokenizer.bos_token, tokenizer.eos_token) if t) or "none"}
    report.heads = {"masked-LM": "yes" if loaded.lm_head is not None else "no",
                    "contact": "yes" if loaded.contacts is not None else "no",
                    "fine-tuned": (f"{loaded.classifier.num_labels} labels"
                                   f"{' per residue' if loaded.classifier.per_token else ''}"
                                   if loaded.classifier is not None else "no"),
                    "decoder": "yes" if loaded.seq2seq is not None else "no"}
    for key in ("output_head", "activation"):
        if key in loaded.description:
            report.heads[key.replace("_", " ")] = loaded.description[key]
