"""docs/developing.md's "Adding a task" recipe, followed for a made-up task: `norms`, the length
(L2 norm) of each sequence's embedding, checkable by brute force from the PyTorch reference.

Everything the recipe lists is done inside this test, registered only for its duration
(monkeypatch): the entry in `TASKS`, the task's name in the family's `tasks`, its planner in
`build.PLANNERS` (a Python model after the encoder, and the public ensemble), its dev-server
method, its check in `verify.CHECKS`. No other module is edited, so a layer that still listed
the tasks itself would leave `norms` out and fail here. One build (a tiny random ESM-2, without
graph optimization) and one tritonserver.
"""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export import build, verify
from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.dev_server import DevModels
from bionemo_export.model_repository.encoder import ensemble_model
from bionemo_export.model_repository.options import roles
from bionemo_export.model_repository.plan import EnsembleStep, ModelPlan
from bionemo_export.models import get_family, load_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.tasks import SEQUENCES, TASKS, Task, served_api_table
from bionemo_export.tensors import DType, TensorSpec
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import TaskCheck, compare_outputs, verify_repository

NAME = "made"

NORMS = Task("norms", "the L2 norm of each sequence's embedding", (SEQUENCES,),
             (TensorSpec("norms", DType.FP32, (1,), doc="|embedding|"),), role="norms", planner="norms", check="norms")

# The serving module: what Triton's Python backend runs as N_norm (standard library + numpy).
NORM_MODEL = '''"""N_norm: the L2 norm of each row of `embeddings` (the made-up task of test_adding_a_task.py)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            embeddings = pb_utils.get_input_tensor_by_name(request, "embeddings").as_numpy()
            norms = np.linalg.norm(embeddings, axis=1, keepdims=True).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("norms", norms)]))
        return responses
'''


def plan_norms(request, loaded, tasks, serving, graphs) -> list[ModelPlan]:
    """The planner: N_norm (Python) after the encoder's embeddings, and the public ensemble N_norms."""
    outputs = [TensorSpec(t.name, t.dtype, t.shape()) for t in NORMS.outputs]
    norm = ModelPlan(f"{request.name}_norm", [TensorSpec("embeddings", DType.FP32, (loaded.hidden_size,))], outputs,
                     max_batch_size=serving.max_batch_size, backend="python", files={"model.py": NORM_MODEL},
                     description="norm of the embeddings (Python)")
    public = ensemble_model(request.name, "norms", outputs, serving, {"embeddings": "embeddings"},
                            after=[EnsembleStep(norm.name, {"embeddings": "embeddings"}, {"norms": "norms"})])
    return [norm, public]


def dev_norms(self: DevModels, requests):
    """The dev-server method: the PyTorch answers, named after the task."""
    return [{"norms": np.linalg.norm(answer["embeddings"], axis=1, keepdims=True)}
            for answer in self.embeddings(requests)]


def check_norms(served, tasks) -> list[TaskCheck]:
    """verify's check: the served norms against the norms of PyTorch's embeddings."""
    checks = []
    for batch in served.batches:
        expected = np.linalg.norm(verify._reference(served.loaded, batch)[1], axis=1)
        found = compare_outputs(served.client.ask("norms", batch)["norms"].reshape(1, -1), expected[None, :])
        checks.append(TaskCheck(served.client.model("norms"), verify._describe(batch), found.max_abs_error, None,
                                None, found.problem is None and found.max_abs_error <= 1e-4, "brute force"))
    return checks


@pytest.fixture()
def norms_registered(monkeypatch):
    family = type(get_family("esm2"))
    monkeypatch.setitem(TASKS, "norms", NORMS)
    monkeypatch.setattr(family, "tasks", (*family.tasks, "norms"))
    monkeypatch.setitem(build.PLANNERS, "norms", plan_norms)
    monkeypatch.setattr(DevModels, "norms", dev_norms, raising=False)
    monkeypatch.setitem(verify.CHECKS, "norms", check_norms)


def test_a_made_up_task_is_built_served_and_verified(norms_registered, tmp_path, triton_install):
    checkpoint = save_random_checkpoint("esm2", tmp_path / "checkpoint", seed=0)  # the others' seed: a cached graph
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=tmp_path / "repo",
                                           tasks=("embeddings", "norms"), backend="python", optimize=False))
    # Read from the entry: the manifest's public models, the role, the dev server's bindings, the API table.
    assert result.manifest.public_models == [f"{NAME}_embeddings", f"{NAME}_norms"]
    assert {f"{NAME}_norm", f"{NAME}_norms"} <= set(result.models) and "norms" in roles()
    assert "norms" in DevModels(load_checkpoint(checkpoint, "esm2")).tasks
    assert "`N_norms` | `sequences` BYTES [1] | `norms` FP32 [1]" in served_api_table()
    other = save_random_checkpoint("esm2", tmp_path / "other", seed=4)
    with TritonServer(tmp_path / "repo", install=triton_install, log_file=tmp_path / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        checks = verify_repository(tmp_path / "repo", checkpoint, url=url)
        norms = [check for check in checks if check.model == f"{NAME}_norms"]
        assert norms and all(check.passed for check in checks), checks
        # A wrong answer fails the check: the same served norms against another checkpoint's.
        wrong = [check for check in verify_repository(tmp_path / "repo", other, url=url)
                 if check.model == f"{NAME}_norms"]
        assert wrong and not any(check.passed for check in wrong)
