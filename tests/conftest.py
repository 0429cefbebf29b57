"""Shared fixtures: one real tritonserver per test module, on free loopback ports."""

from __future__ import annotations

import pytest

from bionemo_export.runtime import TritonServer, find_tritonserver
from tests.helpers.tiny_repository import tiny_repository


@pytest.fixture(scope="session")
def triton_install():
    return find_tritonserver()


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
