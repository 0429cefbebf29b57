"""docs/developing.md's "Adding a task" recipe, followed for a made-up task: `norms`, the length
(L2 norm) of each sequence's embedding, checkable by brute force from the PyTorch reference.

The recipe is followed on a copy of the package, as a developer would: the task's entry appended
to `TASKS` in tasks.py, its kit (kits/norms.py) and its served module (serving/norms.py: the
`NormsModel` that the static model.py's class hands N_norm to, named by its config parameter
`served_model`), and nothing else of the package changed (README.md's served-API table and the task's tests are the
recipe's other two files). No registry is patched: a subprocess importing the copy builds a
repository with the task, serves it with the real tritonserver, verifies it against PyTorch (and
fails it against another checkpoint), and asks the dev server's answer, so a layer that still
listed the tasks itself would leave `norms` out and fail here. One build (a tiny random ESM-2,
without graph optimization).
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import bionemo_export
from bionemo_export.tasks import TASKS

PACKAGE = Path(bionemo_export.__file__).resolve().parent
TABLE_END = ')}\n"""Every served task by name, in the order the docs list them."""'

ENTRY = '''    Task("norms", "the L2 norm of each sequence's embedding", (SEQUENCES,),
         (TensorSpec("norms", DType.FP32, (1,), doc="|embedding|"),), role="norms"),
'''

KIT = '''"""norms: the L2 norm of each sequence's embedding, by a Python model after the encoder."""

from __future__ import annotations

import numpy as np

from bionemo_export.model_repository.encoder import ensemble_model, python_model
from bionemo_export.model_repository.plan import EnsembleStep, ModelPlan
from bionemo_export.tasks import TASKS
from bionemo_export.tensors import DType, TensorSpec

from .base import Answers, PlanContext, Requests, TaskKit, register_kit
from .comparison import TaskCheck, VerifyContext, compare_outputs, reference_encoding, task_check
from .dev import DevAnswers


@register_kit
class NormsKit(TaskKit):
    tasks = ("norms",)

    def plan(self, context: PlanContext) -> list[ModelPlan]:
        outputs = [TensorSpec(t.name, t.dtype, t.shape()) for t in TASKS["norms"].outputs]
        served, files = python_model("norms.NormsModel", model_name=f"{context.name}_norm")
        norm = ModelPlan(f"{context.name}_norm",
                         [TensorSpec("embeddings", DType.FP32, (context.loaded.hidden_size,))], outputs,
                         max_batch_size=context.serving.max_batch_size, backend="python", parameters=served,
                         files=files, description="norm of the embeddings (Python)")
        public = ensemble_model(context.name, "norms", outputs, context.serving, {"embeddings": "embeddings"},
                                after=[EnsembleStep(norm.name, {"embeddings": "embeddings"}, {"norms": "norms"})])
        return [norm, public]

    def check(self, context: VerifyContext, tasks: list[str]) -> list[TaskCheck]:
        checks = []
        for batch in context.batches:
            expected = np.linalg.norm(reference_encoding(context.loaded, batch)[1], axis=1)
            served = context.client.ask("norms", batch)["norms"].reshape(-1)
            checks.append(task_check(context.client.model("norms"), batch,
                                     compare_outputs(served[None, :], expected[None, :]), None,
                                     context.family_limits(), "brute force: the norm of PyTorch's embedding"))
        return checks

    def answer(self, dev: DevAnswers, task: str, requests: Requests) -> Answers:
        return [{"norms": np.linalg.norm(embeddings, axis=1, keepdims=True)}
                for _, embeddings, _ in dev.encode(requests)]
'''

SERVED = '''"""N_norm: the L2 norm of each row of `embeddings` (numpy; the served package's `norms.NormsModel`)."""

import numpy as np

from .models import Args, ServedModel
from .responses import Responder, input_array, triton


class NormsModel(ServedModel):
    def initialize(self, args: Args, folder: str) -> None:
        self.responder = Responder(args["model_name"])
        self.model = self

    def execute(self, requests: list) -> list:
        return self.responder.answer_all(requests, self.answer)

    def answer(self, requests: list) -> tuple[list, int]:
        """(responses, bytes of work), as Responder.answer_all takes them."""
        pb_utils = triton()
        norms = [np.linalg.norm(input_array(request, "embeddings"), axis=1, keepdims=True).astype(np.float32)
                 for request in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("norms", row)]) for row in norms], 0
'''

# Run on the copy: build, serve and verify, verify against another checkpoint, the dev server's answer.
SCRIPT = '''
import json, sys
from pathlib import Path

import numpy as np

import bionemo_export
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.dev_server import DevModels
from bionemo_export.models import load_checkpoint
from bionemo_export.tasks import served_api_table
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository

work = Path(sys.argv[1])
checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
other = save_random_checkpoint("esm2", work / "other", seed=4)
result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name="made", out=work / "repo",
                                       tasks=("embeddings", "norms"), backend="python", optimize=False))
checks = verify_repository(work / "repo", checkpoint)
wrong = verify_repository(work / "repo", other)
dev = DevModels(load_checkpoint(checkpoint, "esm2"))
rows = np.array([[b"MKTAYIAKQR"], [b"GVLE"]], dtype=np.object_)
(answer,) = dev.answer("norms", [{"sequences": rows}])
(embedded,) = dev.answer("embeddings", [{"sequences": rows}])
print(json.dumps({
    "package": bionemo_export.__file__,
    "public": result.manifest.public_models, "models": result.models,
    "checks": [[c.model, c.passed] for c in checks], "wrong": [[c.model, c.passed] for c in wrong],
    "dev_tasks": list(dev.tasks),
    "dev_error": float(np.max(np.abs(answer["norms"][:, 0] - np.linalg.norm(embedded["embeddings"], axis=1)))),
    "table": served_api_table(),
}))
'''


def _follow_the_recipe(copy: Path) -> None:
    """The recipe's package files: the entry, the kit, the served module."""
    tasks = copy / "tasks.py"
    text = tasks.read_text()
    assert text.count(TABLE_END) == 1, "tasks.py's table no longer ends as this test expects: update TABLE_END"
    tasks.write_text(text.replace(TABLE_END, ENTRY + TABLE_END))
    (copy / "kits" / "norms.py").write_text(KIT)
    (copy / "serving" / "norms.py").write_text(SERVED)


def _changed(original: Path, copy: Path) -> list[str]:
    """The files of `copy` that differ from `original` or are new (relative paths)."""
    changed = []
    for path in sorted(copy.rglob("*.py")):
        relative = path.relative_to(copy)
        before = original / relative
        if not before.exists() or not filecmp.cmp(before, path, shallow=False):
            changed.append(str(relative))
    return changed


def test_a_made_up_task_is_built_served_and_verified_from_three_package_files(tmp_path):
    copy = tmp_path / "src" / "bionemo_export"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    _follow_the_recipe(copy)
    assert _changed(PACKAGE, copy) == ["kits/norms.py", "serving/norms.py", "tasks.py"]

    env = {**os.environ, "PYTHONPATH": str(copy.parent)}
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT), str(tmp_path)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(found["package"]).resolve().is_relative_to(copy)  # the copy ran, not the installed package
    # Read from the entry and the kit: the public models, the dev server's bindings, the API table.
    assert found["public"] == ["made_embeddings", "made_norms"]
    assert {"made_norm", "made_norms"} <= set(found["models"])
    assert "norms" in found["dev_tasks"] and found["dev_error"] < 1e-5
    assert "`N_norms` | `sequences` BYTES [1] | `norms` FP32 [1]" in found["table"]
    norms = [passed for model, passed in found["checks"] if model == "made_norms"]
    assert norms and all(passed for _, passed in found["checks"]), found["checks"]
    # A wrong answer fails the kit's check: the same served norms against another checkpoint's.
    wrong = [passed for model, passed in found["wrong"] if model == "made_norms"]
    assert wrong and not any(wrong)
    # The installed package never learned the task.
    assert "norms" not in TASKS
