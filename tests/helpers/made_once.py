"""Artifacts made once per test run and read by every module that asks, in one pytest process or
across pytest-xdist's workers (each worker has its own session: without this, each would export
or train the same thing again)."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".made"
"""Written last: a folder without it is what a worker left when it failed, and is made again."""


def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary folder: pytest's basetemp, or with pytest-xdist the folder above the
    workers' own (so that every worker finds the same things there)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, made by `make(folder)` the first time any worker of this run asks for it;
    later callers wait for that maker and get the same folder. Callers only read it: a test that
    changes it works on a copy."""
    shared = run_folder(tmp_path_factory) / "made-once"
    shared.mkdir(exist_ok=True)
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (folder / DONE).is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            (folder / DONE).touch()
    return folder
