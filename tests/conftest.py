"""The markers of the folders (tests/e2e: `e2e`, tests/export: `export`; tests/unit: none), and the
shared fixtures: one real tritonserver per test module, on free loopback ports; a tiny random
ESM-2 checkpoint and its repository built once per session without graph optimization; the real
AntiBERTy loaded."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from bionemo_export.runtime import TritonServer, find_tritonserver
from tests.helpers.made_once import made_once, run_folder
from tests.helpers.tiny_repository import tiny_repository

if TYPE_CHECKING:  # torch and transformers load only in the modules that ask for a model
    from bionemo_export.models import LoadedModel

TESTS = Path(__file__).resolve().parent
FOLDER_MARKERS = {"e2e": pytest.mark.e2e, "export": pytest.mark.export}
"""The marker every test in a folder carries: a test's kind is where it sits, so `-m` selects by folder."""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each worker's PyTorch (and everything it starts: CLI builds, scripts)
    computes on its share of the cores. Two workers each running two intra-op threads on two cores
    spin against each other: the MegaMolBART training fixture took 283 s that way, against 55 s alone
    on two threads and 95 s alone on one."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    share = str(max(1, (os.cpu_count() or 1) // int(workers)))
    os.environ.setdefault("OMP_NUM_THREADS", share)
    if "torch" in sys.modules:  # read OMP_NUM_THREADS when it was imported; say it again
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


MODULE_SECONDS = {
    "e2e/test_serve_supervision.py": 205,
    "e2e/test_encode_jobs.py": 75,
    "e2e/test_answers_unchanged.py": 70,
    "e2e/test_job_chaos.py": 65,
    "export/test_layer_states.py": 65,
    "export/test_optimize.py": 60,
    "e2e/test_load_fault.py": 55,
    "e2e/test_e2e_predictions.py": 55,
    "e2e/test_e2e_masked_lm.py": 50,
    "e2e/test_runtime_server.py": 50,
    "e2e/test_e2e_ensemble.py": 45,
    "e2e/test_scripts.py": 45,
    "e2e/test_clients.py": 45,
    "e2e/test_e2e_encoders.py": 45,
    "e2e/test_transient_failures.py": 40,
    "e2e/test_tune.py": 40,
    "export/test_streamed_build.py": 40,
    "e2e/test_integrity.py": 35,
    "e2e/test_batching.py": 35,
    "e2e/test_golden.py": 35,
    "export/test_bounded_build.py": 30,
    "e2e/test_e2e_nemo.py": 30,
    "e2e/test_e2e_nvidia_esm2.py": 30,
    "e2e/test_rxnfp.py": 30,
    "e2e/test_dev_server.py": 30,
    "e2e/test_bench.py": 30,
    "export/test_shared_weights.py": 25,
    "export/test_build.py": 25,
    "e2e/test_served_errors.py": 25,
    "export/test_megamolbart.py": 25,
    "e2e/test_esm1.py": 25,
    "e2e/test_cli_edges.py": 25,
    "e2e/test_job_memory.py": 25,
    "e2e/test_serve_recovery.py": 20,
    "e2e/test_adding_a_task.py": 20,
    "e2e/test_e2e_layers.py": 20,
    "e2e/test_e2e_megamolbart.py": 20,
    "e2e/test_prott5.py": 20,
    "e2e/test_object_storage.py": 20,
    "e2e/test_saprot.py": 20,
    "e2e/test_job_object_storage.py": 15,
    "export/test_graph_cache.py": 15,
    "e2e/test_e2e_esm1v_ensemble.py": 15,
    "e2e/test_snakemake_workflow.py": 15,
    "e2e/test_e2e_contacts.py": 15,
    "export/test_exporters.py": 15,
    "export/test_tune_rebuild.py": 15,
    "e2e/test_esmc.py": 15,
    "e2e/test_serving_host.py": 10,
    "e2e/test_admission.py": 10,
    "e2e/test_cli.py": 10,
    "e2e/test_e2e_windows.py": 10,
    "export/test_nemo2.py": 10,
}
"""Seconds each slow module took in a three-worker `make test` on a 2-core host (the sum of its tests'
times, rounded to 5 s; measured 2026-11-30 on the AVX-512 VNNI AMD kind, test_answers_unchanged
after its build of this code came to use the run's graph cache). Under pytest-xdist the modules run
longest first (see pytest_collection_modifyitems)."""
UNLISTED_SECONDS = {"unit": 0, "export": 5, "e2e": 5}
"""A module not in MODULE_SECONDS: a unit module takes about a second, any other under 8 s."""


def _module_seconds(relative: Path) -> float:
    return MODULE_SECONDS.get(relative.as_posix(), UNLISTED_SECONDS.get(relative.parts[0], 0))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test by its folder; under pytest-xdist, orders the modules longest first.

    `make test` runs `--dist loadfile --no-loadscope-reorder`: each module goes whole to the next
    worker that runs short of work, in collection order (pytest-xdist's own order is by number of
    tests, which put few-test slow modules such as test_load_fault.py and test_scripts.py at the
    end, one worker left running them while the other had nothing). Longest first leaves only
    short modules for the end, so both workers finish within seconds of each other. The tests of
    a module keep their order."""
    relative: dict[pytest.Item, Path] = {}
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS):
            relative[item] = path.relative_to(TESTS)
            if marker := FOLDER_MARKERS.get(relative[item].parts[0]):
                item.add_marker(marker)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker collects the same order (xdist checks it)
        items.sort(key=lambda item: -_module_seconds(relative[item]) if item in relative else 0)


@pytest.fixture(scope="session", autouse=True)
def graph_cache(tmp_path_factory) -> Iterator[Path]:
    """One graph cache for the run's builds (exporters/graph_cache.py), in-process and in the CLI
    processes tests start: the suite builds the same tiny checkpoints with different serving
    options over and over (117 graph exports, 62 distinct, measured). Every cached graph is still
    checked against PyTorch by the build. Tests of the export itself call export_onnx without it."""
    from bionemo_export.exporters.graph_cache import ENVIRONMENT_VARIABLE  # imports torch, as every build does

    folder = run_folder(tmp_path_factory) / "graph-cache"
    previous = os.environ.get(ENVIRONMENT_VARIABLE)
    os.environ[ENVIRONMENT_VARIABLE] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(ENVIRONMENT_VARIABLE, None)
    else:
        os.environ[ENVIRONMENT_VARIABLE] = previous


@pytest.fixture(scope="session")
def esm2_checkpoint(tmp_path_factory) -> Path:
    """A tiny random ESM-2 (Hugging Face folder, seed 0, with its masked-LM head), written once for
    the run: tests only read it."""
    from bionemo_export.testing.checkpoints import save_random_checkpoint  # torch: only where a test asks for it

    return made_once(tmp_path_factory, "esm2",
                     lambda folder: save_random_checkpoint("esm2", folder / "checkpoint", seed=0)) / "checkpoint"


@pytest.fixture(scope="session")
def esm2_repository(tmp_path_factory, esm2_checkpoint) -> Path:
    """`esm2_checkpoint` built once for the session as the repository `esm2nv` (Python backend, the
    fused layout, every task the checkpoint supports: embeddings, hiddens, logits, scores, contacts,
    layers, attentions, the last three hosted by N_encoder over its weights.bin), WITHOUT
    graph optimization: for the tests that need a built repository and not its optimization (those
    build their own). Tests only read it; a test that changes it changes a copy
    (shutil.copytree(esm2_repository, tmp_path / "repo"))."""
    from bionemo_export.build import BuildRequest, build_repository  # torch: only where a test asks for it

    def build(folder: Path) -> None:
        build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="esm2nv", out=folder / "repo",
                                      backend="python", optimize=False))

    return made_once(tmp_path_factory, "esm2-repository", build) / "repo"


COPY_MODEL = TESTS / "data" / "megamolbart-copy"
"""The small MegaMolBART copy model (models/megamolbart_training.py's defaults, seed 0), trained by
scripts/train_megamolbart_copy_model.py and committed: training it in every run cost a minute of
CPU on a fast host. Tests only read it."""


@pytest.fixture(scope="session")
def trained_megamolbart() -> Path:
    """The committed copy model (`COPY_MODEL`): the tests that decode need a model that
    reconstructs SMILES, not a random one."""
    if not (COPY_MODEL / "model.safetensors").is_file():
        pytest.fail(f"{COPY_MODEL} holds no model: run `python scripts/train_megamolbart_copy_model.py`")
    return COPY_MODEL


@pytest.fixture(scope="module")
def antiberty() -> LoadedModel:
    """The real AntiBERTy (shipped in the antiberty wheel) loaded as the bert family."""
    from bionemo_export.models import get_family  # torch: only where a test asks for it
    from bionemo_export.models.bert import antiberty_checkpoint

    return get_family("bert").load(antiberty_checkpoint())


@pytest.fixture(scope="module")
def rxnfp() -> LoadedModel:
    """rxnfp's real pretrained reaction-SMILES BERT (shipped in the rxnfp wheel) loaded as the bert family."""
    from bionemo_export.models import get_family  # torch: only where a test asks for it
    from bionemo_export.models.bert import rxnfp_checkpoint

    return get_family("bert").load(rxnfp_checkpoint())


@pytest.fixture(scope="session")
def triton_install():
    return find_tritonserver()


@pytest.fixture(scope="module")
def tiny_repo(tmp_path_factory) -> Path:
    """The tiny hand-made repository (tests/helpers/tiny_repository.py), for the module's tests."""
    return tiny_repository(tmp_path_factory.mktemp("tiny") / "models")


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, triton_install):
    """The tiny hand-made repository served by the real embedded tritonserver."""
    repo = tiny_repository(tmp_path_factory.mktemp("tiny") / "models")
    server = TritonServer(repo, install=triton_install, log_file=repo.parent / "tritonserver.log")
    server.start(timeout=120)
    try:
        yield server
    finally:
        server.stop()
