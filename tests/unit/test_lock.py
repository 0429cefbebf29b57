"""requirements/lock.txt, the environment scripts/setup.sh installs, is a lock: every line one package at
an exact version with its sha256 hashes; the ranges pyproject.toml publishes for pip users admit the
lock's versions; and the environment the tests run in is the lock, package for package, compiled to
bytecode."""

from __future__ import annotations

import importlib.util
import re
from importlib.metadata import distributions
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
PROJECT = "bionemo-export"
PIN = re.compile(r"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)==(?P<version>[A-Za-z0-9.+!_-]+)")
HASH = re.compile(r"--hash=sha256:[0-9a-f]{64}")


def lock_entries(text: str) -> list[str]:
    """The lock's requirement lines, each with its continuation lines joined; comments and blank
    lines dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def lock_problems(text: str) -> tuple[dict[str, str], list[str]]:
    """(name -> version, problems): a line that is not `name==version --hash=sha256:...` (at least one
    hash, nothing else) or a package listed twice is a problem."""
    pins: dict[str, str] = {}
    problems = []
    for entry in lock_entries(text):
        first, *rest = entry.split()
        pin = PIN.fullmatch(first)
        if pin is None:
            problems.append(f"not name==version: {first!r}")
            continue
        if not rest or not all(HASH.fullmatch(token) for token in rest):
            problems.append(f"{first}: needs one or more --hash=sha256:<64 hex> and nothing else, has {rest!r}")
        name = canonicalize_name(pin["name"])
        if name in pins:
            problems.append(f"{name} is listed twice")
        pins[name] = pin["version"]
    return pins, problems


def published_requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) for pyproject.toml's dependencies and every extra's."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [("dependencies", Requirement(line)) for line in project["dependencies"]]
    for extra, lines in project.get("optional-dependencies", {}).items():
        found += [(f"optional-dependencies.{extra}", Requirement(line)) for line in lines]
    return found


def range_problems(pins: dict[str, str], requirements: list[tuple[str, Requirement]]) -> list[str]:
    """Each published requirement is in the lock, at a version its range admits."""
    problems = []
    for where, requirement in requirements:
        name = canonicalize_name(requirement.name)
        if name == PROJECT:  # an extra naming another extra of the project
            continue
        if name not in pins:
            problems.append(f"{where}: {requirement} is not in the lock")
        elif not requirement.specifier.contains(Version(pins[name]), prereleases=True):
            problems.append(f"{where}: {requirement} does not admit the lock's {name}=={pins[name]}")
    return problems


def environment_problems(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    """The installed packages are the lock's, at the lock's versions (the project itself aside)."""
    problems = []
    for name in sorted(pins.keys() | installed.keys()):
        if name == PROJECT:
            continue
        if name not in installed:
            problems.append(f"{name}=={pins[name]} is locked but not installed")
        elif name not in pins:
            problems.append(f"{name}=={installed[name]} is installed but not in the lock")
        elif Version(installed[name]) != Version(pins[name]):
            problems.append(f"{name}: installed {installed[name]}, locked {pins[name]}")
    return problems


HEAVY_PACKAGES = ("torch", "transformers", "sympy", "onnx", "onnxruntime", "numpy", "tritonclient")
"""Packages most processes of a test run import: uncompiled, each process compiles them again."""


def uncompiled_packages(names: tuple[str, ...]) -> list[str]:
    """The packages whose __init__.py has no bytecode beside it. setup.sh installs with
    `uv pip sync --compile-bytecode`: uv writes no .pyc files otherwise, and these hosts set
    PYTHONDONTWRITEBYTECODE=1, so without them every process compiles torch and transformers anew
    (7.3 s of CPU instead of 3.8 s to import the package's model code)."""
    missing = []
    for name in names:
        spec = importlib.util.find_spec(name)  # finds the package without importing it
        origin = spec.origin if spec else None
        if origin is None or not Path(importlib.util.cache_from_source(origin)).is_file():
            missing.append(name)
    return missing


def installed_packages() -> dict[str, str]:
    return {canonicalize_name(dist.metadata["Name"]): dist.version for dist in distributions()}


def test_every_lock_line_is_an_exact_version_with_hashes():
    pins, problems = lock_problems(LOCK.read_text(encoding="utf-8"))
    assert not problems, "\n".join(problems)
    assert len(pins) > 100  # the whole environment, not a handful of pins
    assert {"torch", "nvidia-pytriton", "tritonclient", "onnxruntime", "triton-model-navigator", "rxnfp",
            "kserve", "pip", "setuptools", "wheel"} <= pins.keys()
    assert pins["torch"].endswith("+cpu")  # the local CPU build


def test_the_published_ranges_admit_the_locked_versions():
    pins, _ = lock_problems(LOCK.read_text(encoding="utf-8"))
    requirements = published_requirements()
    assert {"torch", "nvidia-pytriton", "pytest"} <= {canonicalize_name(r.name) for _, r in requirements}
    problems = range_problems(pins, requirements)
    assert not problems, "\n".join(problems)


def test_the_running_environment_is_the_lock():
    pins, _ = lock_problems(LOCK.read_text(encoding="utf-8"))
    problems = environment_problems(pins, installed_packages())
    assert not problems, "\n".join(problems) + "\n(scripts/setup.sh installs the lock; `make lock` refreshes it)"


def test_the_environment_is_compiled_to_bytecode():
    missing = uncompiled_packages(HEAVY_PACKAGES)
    assert not missing, f"no bytecode for {missing}: scripts/setup.sh installs with --compile-bytecode"


def test_the_bytecode_check_sees_a_package_without_bytecode(tmp_path, monkeypatch):
    for name in ("compiled_pkg", "plain_pkg"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("VALUE = 1\n")
    compiled = tmp_path / "compiled_pkg" / "__init__.py"
    cached = Path(importlib.util.cache_from_source(str(compiled)))
    cached.parent.mkdir()
    cached.write_bytes(b"")  # only its presence is checked
    monkeypatch.syspath_prepend(str(tmp_path))
    assert uncompiled_packages(("compiled_pkg", "plain_pkg", "no_such_package_here")) == [
        "plain_pkg", "no_such_package_here"]


def test_the_checks_catch_a_changed_lock():
    text = LOCK.read_text(encoding="utf-8")
    pins, _ = lock_problems(text)
    installed = dict(pins)

    # a version changed in the lock: the environment no longer matches, and numpy<2 refuses it
    changed = re.sub(r"^numpy==\S+", "numpy==2.0.0", text, flags=re.M)
    changed_pins, problems = lock_problems(changed)
    assert not problems
    assert environment_problems(changed_pins, installed) == [f"numpy: installed {pins['numpy']}, locked 2.0.0"]
    assert any("numpy<2" in p for p in range_problems(changed_pins, published_requirements()))

    # a line without hashes, a range instead of a version, a package missing from the lock
    _, problems = lock_problems(text + "six==1.17.0\nrich>=13 --hash=sha256:" + "0" * 64 + "\n")
    assert len(problems) == 3, problems  # no hash; six listed twice; not name==version
    assert range_problems({}, [("dependencies", Requirement("rich>=13"))]) == [
        "dependencies: rich>=13 is not in the lock"]
    assert environment_problems(pins, {**installed, "tomli": "2.0.0"}) == [
        "tomli==2.0.0 is installed but not in the lock"]
