"""The package's layers hold (no server: the end-to-end half, the serving host's commands run without
torch, is tests/e2e/test_serving_host.py).

Every import of the package, read with `ast`, goes down the layers of `bionemo_export/_layers.py`
and no import circle remains; the checker itself fails on a made-up package that climbs or circles.
The modules the serving host's commands load import none of torch, onnx, transformers, Model
Navigator, safetensors, ONNX Runtime or TensorRT at module level.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import bionemo_export
from bionemo_export._layers import (
    LAYERS,
    Import,
    Layer,
    check,
    circles,
    climbs,
    heavy_imports,
    import_graph,
    module_name,
    package_imports,
)

PACKAGE_ROOT = Path(bionemo_export.__file__).parent


def _modules(root: Path) -> set[str]:
    return {module_name(path, root) for path in root.rglob("*.py")}


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return package_imports(PACKAGE_ROOT)


# -- the package ----------------------------------------------------------------------------------------------------

def test_the_package_keeps_its_layers_and_has_no_import_circle(imports):
    problems = check(imports, _modules(PACKAGE_ROOT))
    assert problems == [], "\n".join(problems)


def test_each_part_sits_in_one_layer():
    units = [unit for layer in LAYERS for unit in layer.units]
    assert len(units) == len(set(units)), units


# The modules `serve`, `health`, `client`, `deploy`, `repo push`, `doctor` and `engines build` load:
# the whole CLI (main imports every command module) and what those commands import when they run.
SERVING_HOST_MODULES = (
    "bionemo_export.cli.main",
    "bionemo_export.runtime.lifecycle",
    "bionemo_export.runtime.object_storage",
    "bionemo_export.doctor",
    "bionemo_export.runtime.engines",
    "bionemo_export.exporters.navigator",  # doctor asks it whether Model Navigator is usable
    "bionemo_export.deploy.kubernetes",
    "bionemo_export.client",
    "bionemo_export.client.files",
    "bionemo_export.client.repository",
    "bionemo_export.client.variants",
)


@pytest.mark.parametrize("module", SERVING_HOST_MODULES)
def test_the_serving_hosts_modules_import_no_heavy_package(imports, module):
    assert module in _modules(PACKAGE_ROOT)
    assert heavy_imports(imports, module) == []


# -- the checker can fail -------------------------------------------------------------------------------------------

def _package(root: Path, files: dict[str, str]) -> Path:
    """A made-up `bionemo_export` package under `root`: relative path -> source."""
    package = root / "bionemo_export"
    for relative, source in {"__init__.py": "", **files}.items():
        path = package / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for folder in [package, *(p for p in package.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").touch()
    return package


def _problems(package: Path) -> list[str]:
    return check(package_imports(package), _modules(package))


def test_a_planner_importing_the_runtime_is_a_climb(tmp_path):
    package = _package(tmp_path, {
        "runtime/supervisor.py": "BLS_MODELS = 'bls_models'\n",
        "model_repository/masked_lm.py": "from bionemo_export.runtime.supervisor import BLS_MODELS\n",
    })
    assert _problems(package) == [
        "bionemo_export.model_repository.masked_lm -> bionemo_export.runtime.supervisor (line 1): "
        "climbs from planners and clients to runtime"]


def test_a_climb_inside_a_function_or_for_type_checkers_is_still_a_climb(tmp_path):
    package = _package(tmp_path, {
        "cli/serve.py": "",
        "runtime/server.py": """\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from ..cli import serve
            def start():
                from bionemo_export.cli.serve import main
            """,
    })
    problems = _problems(package)
    assert len(problems) == 2
    assert problems[0].endswith("(line 3) (if TYPE_CHECKING): climbs from runtime to cli")
    assert problems[1].endswith("(line 5) (inside a function): climbs from runtime to cli")


def test_parts_of_one_layer_are_independent(tmp_path):
    package = _package(tmp_path, {"client/triton.py": "", "model_repository/plan.py": "from ..client import triton\n"})
    assert _problems(package) == [
        "bionemo_export.model_repository.plan -> bionemo_export.client.triton (line 1): model_repository and "
        "client share the layer planners and clients and are independent"]


def test_an_import_circle_is_found_at_module_level_and_through_a_package(tmp_path):
    package = _package(tmp_path, {
        "runtime/a.py": "from . import b\n",
        "runtime/b.py": "from bionemo_export.runtime.a import x\n",
        # runtime/server.py takes a name from runtime/__init__.py, which imports server.py.
        "runtime/__init__.py": "from .server import start\n",
        "runtime/server.py": "from bionemo_export.runtime import free_ports\n",
    })
    assert _problems(package) == [
        "import circle: bionemo_export.runtime <-> bionemo_export.runtime.server",
        "import circle: bionemo_export.runtime.a <-> bionemo_export.runtime.b"]


def test_a_circle_for_type_checkers_or_inside_functions_counts(tmp_path):
    package = _package(tmp_path, {
        "model_repository/backends.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from .options import RoleOptions\n",
        "model_repository/options.py": "from .backends import get_backend\n",
        # A registry looked up from below: the package imports its modules, and one of them imports
        # the package again when called (as models/base.py's lookups once did).
        "models/__init__.py": "from .base import REGISTRY\n",
        "models/base.py": "def get_family():\n    from bionemo_export import models\n",
    })
    assert _problems(package) == [
        "import circle: bionemo_export.model_repository.backends <-> bionemo_export.model_repository.options",
        "import circle: bionemo_export.models <-> bionemo_export.models.base"]


def test_the_served_package_may_import_only_itself_the_standard_library_and_numpy(tmp_path):
    package = _package(tmp_path, {
        "serving/responses.py": "import json\nimport numpy\nfrom .parameters import x\n",
        "serving/parameters.py": "def read():\n    import torch\n",
        "serving/scores.py": "from bionemo_export.tasks import TASKS\n",
        "tasks.py": "",
    })
    assert _problems(package) == [
        "bionemo_export.serving.parameters -> torch (line 2) (inside a function): the served package imports only "
        "the standard library and numpy, onnxruntime, triton_python_backend_utils",
        "bionemo_export.serving.scores -> bionemo_export.tasks (line 1): the served package imports only itself "
        "(it is copied alone into repositories)"]


def test_a_part_in_no_layer_is_reported(tmp_path):
    package = _package(tmp_path, {"plugins/extra.py": "from bionemo_export.tasks import TASKS\n", "tasks.py": ""})
    assert _problems(package) == ["plugins: a part of the package in no layer: add it to LAYERS"]


def test_a_made_up_layer_order_decides_what_climbs(tmp_path):
    package = _package(tmp_path, {"low.py": "", "high.py": "from bionemo_export import low\n"})
    imports = package_imports(package)
    upward = (Layer("a", ("low",), ""), Layer("b", ("high",), ""))
    assert climbs(imports, upward) == []
    assert climbs(imports, upward[::-1]) == [
        "bionemo_export.high -> bionemo_export.low (line 1): climbs from b to a"]


def test_a_heavy_import_is_found_through_the_modules_a_command_loads(tmp_path):
    package = _package(tmp_path, {
        "cli/engines.py": "from bionemo_export.runtime import engines\n",
        "runtime/engines.py": "from bionemo_export.model_repository.consistency import check\n",
        "model_repository/consistency.py": "import onnx\n\ndef read():\n    import torch\n",
    })
    imports = package_imports(package)
    assert heavy_imports(imports, "bionemo_export.cli.engines") == [
        "bionemo_export.model_repository.consistency -> onnx (line 1)"]  # torch: only when read() runs
    assert circles(import_graph(imports)) == []
