"""Check a served repository against the PyTorch reference of the same checkpoint.

Sample sequences of several lengths go through the public models (`N_embeddings`, `N_hiddens`) of
a running server, or of the embedded tritonserver started for the purpose; the answers are
compared with the checkpoint's PyTorch model: max abs error and minimum cosine per task, and for
`hiddens` the exact `mask`. Each task's kit (kits/) makes its comparison (`TaskKit.check`); this
module serves the repository, loads the checkpoint and chooses the tolerances.

The tolerance follows manifest.json's `precision`: the family's (atol and cosine) for fp32; for an
int8 or fp16 encoder, the precision's minimum cosine per output (exporters/verification.py), the
figures then being the accuracy cost of that precision against PyTorch fp32 (each check's note
says so, with what the build measured).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

import numpy as np

from bionemo_export.client import Seq2SeqClient
from bionemo_export.errors import InvalidInputError, reason
from bionemo_export.kits import kits_of
from bionemo_export.kits.comparison import Comparison, TaskCheck, VerifyContext, compare_outputs
from bionemo_export.model_repository.integrity import require_intact
from bionemo_export.model_repository.manifest import Manifest

__all__ = ["Comparison", "TaskCheck", "compare_outputs", "precision_checks", "verify_golden", "verify_repository"]


def verify_repository(repository: Path, checkpoint: Path | Sequence[Path], url: str | None = None,
                      tritonserver: str | None = None, check_files: bool = True) -> list[TaskCheck]:
    """Serve `repository` (unless `url` names a running server) and check it against `checkpoint`
    (a checkpoint ensemble's: every member, in the build's order, each loaded as its family).

    First (unless not `check_files`: the caller checked them) its files are compared with the
    digests manifest.json records: integrity.IntegrityError naming any that changed."""
    from bionemo_export.models import get_family
    from bionemo_export.runtime import TritonServer, find_tritonserver

    if check_files:
        require_intact(repository)
    manifest = Manifest.read(repository)
    family = get_family(manifest.family)
    checkpoints = [Path(checkpoint)] if isinstance(checkpoint, str | Path) else [Path(p) for p in checkpoint]
    built_from = len(manifest.members or ()) or 1
    if len(checkpoints) != built_from:
        listed = ", ".join(str(m.get("path")) for m in manifest.members or ())
        raise InvalidInputError(
            f"{repository} was built from {built_from} checkpoint{'s' if built_from > 1 else ''}"
            f"{f' (an ensemble: {listed})' if listed else ''}; got {len(checkpoints)}: give `checkpoint` once per "
            "member, in the build's order")
    loaded_members = []
    for path in checkpoints:
        try:
            loaded_members.append(family.load(path, max_length=manifest.max_length))
        except Exception as err:  # a malformed checkpoint breaks readers and families in many ways: name it
            raise InvalidInputError(f"cannot load {path} as {family.name}: {reason(err)}") from err
    loaded = loaded_members[0]
    samples = loaded.family.sample_sequences()  # fits the checkpoint (bert: protein or SMILES)
    batches = [samples] + [[s] for s in sorted(samples, key=len)[:: max(1, len(samples) // 3)]]
    with ExitStack() as stack:
        if url is None:
            server = stack.enter_context(TritonServer(repository, install=find_tritonserver(tritonserver)))
            url = f"grpc://{server.endpoints.grpc_url}"
        client = stack.enter_context(Seq2SeqClient(manifest.name, url))
        tolerances, notes = precision_checks(manifest, family)
        served = VerifyContext(client, loaded, manifest, batches, samples, tolerances, notes,
                               tuple(loaded_members) if manifest.members else ())
        carried = loaded.servable(manifest.tasks)
        checks: list[TaskCheck] = []
        for kit in kits_of(carried):  # in the table's order: the report lists them so
            checks += kit.check(served, [t for t in carried if t in kit.tasks])
        return checks


def precision_checks(manifest: Manifest, family) -> tuple[dict, dict[str, str]]:
    """(task -> Tolerance, task -> note) for the repository's precision: the family's tolerance for
    fp32; for the reduced precisions the minimum cosine the build held the graph to (manifest.json's
    `accuracy`: the precision's, or the build's `min-cosine`), and a note with the accuracy cost
    the build measured."""
    from bionemo_export.exporters.verification import Tolerance, precision_tolerances

    precision = manifest.precision
    tolerances = precision_tolerances(precision, ["embeddings", "hiddens"], family.atol, family.min_cosine)
    if precision == "fp32":
        return tolerances, {}
    measured = manifest.accuracy.get("outputs", {})
    for task in tolerances:
        held = measured.get(task, {}).get("tolerance", {}).get("min_cosine")
        if isinstance(held, float):
            tolerances[task] = Tolerance(tolerances[task].atol, held)
    notes = {}
    for task, tolerance in tolerances.items():
        built = measured.get(task)
        at_build = (f"; build: min cosine {built['min_cosine']:.6f}, max abs error {built['max_abs_error']:.2e}"
                    if built and isinstance(built.get("min_cosine"), float) else "")
        notes[task] = f"{precision} vs fp32 PyTorch: min cosine >= {tolerance.min_cosine:g} required{at_build}"
    return tolerances, notes


def verify_golden(repository: Path, check_files: bool = True) -> list[TaskCheck]:
    """Without the checkpoint: every stored graph's golden answers (the build's verified inputs and
    PyTorch outputs, serving/golden.py) run on this host with ONNX Runtime, through the graph a
    served model would open here (an int8 repository's VNNI or no-VNNI graph), against the tolerance
    the build held it to: what each served model checks when it loads. InvalidInputError when the
    repository has no golden answers (built before they were stored)."""
    import onnxruntime as ort

    from bionemo_export.exporters.runtime_session import session_options
    from bionemo_export.serving.golden import GOLDEN_FILE, read_golden
    from bionemo_export.serving.host import cpu_description
    from bionemo_export.serving.onnx_session import graph_for_this_host

    if check_files:
        require_intact(repository)
    found = sorted(repository.glob(f"*/*/{GOLDEN_FILE}")) + sorted(repository.glob(f"*/*/*/{GOLDEN_FILE}"))
    # The graphs N_encoder hosts beside its own (layers, contacts, attentions: one weights file)
    # keep theirs as <stem>.golden.npz (serving/golden.golden_path).
    hosted = sorted(repository.glob(f"*/*/*.{GOLDEN_FILE}"))
    if not found + hosted:
        raise InvalidInputError(f"{repository} has no golden answers ({GOLDEN_FILE} beside its graphs): it was "
                                "built before they were stored; pass --checkpoint to verify it against PyTorch, "
                                "or rebuild it")
    vnni = "VNNI" if cpu_description()["vnni"] else "no VNNI"
    checks = []
    graphs = [(path, graph_for_this_host(str(path.parent), ["CPUExecutionProvider"])) for path in found]
    graphs += [(path, str(path.parent / f"{path.name.removesuffix('.' + GOLDEN_FILE)}.onnx")) for path in hosted]
    for path, graph in graphs:
        session = ort.InferenceSession(graph, session_options(), providers=["CPUExecutionProvider"])
        golden = read_golden(str(path))
        shape = next(iter(golden.inputs.values())).shape
        model = path.relative_to(repository).parts[0] + ("" if path in found else f" ({Path(graph).stem})")
        for check in golden.run(session):
            checks.append(TaskCheck(
                model=f"{model}:{check.name}", batch=f"golden inputs {list(shape)}",
                max_abs_error=check.figures.max_abs_error, min_cosine=check.figures.min_cosine, mask_exact=None,
                passed=check.passed, problem=check.figures.problem,
                note=f"{Path(graph).relative_to(path.parent)} on this host ({vnni}); cosine >= {check.min_cosine:g}"
                     + (f", max abs <= {check.atol:g}" if np.isfinite(check.atol) else "")))
    return checks
