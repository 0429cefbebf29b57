"""Golden answers asked of a running server, for the graph models that cannot check themselves.

A Python-backend model that runs a graph checks its golden answers when it loads (serving/golden.py).
A model served by Triton's own ONNX Runtime backend (`--backend native`, `platform:
"onnxruntime_onnx"`) runs no code of ours, so `serve` sends it the golden inputs once the server is
ready and compares the answers before it reports the repository as served: outside the tolerance,
serve stops (or, with `--golden-check warn`, says so and serves). TensorRT engines are left out:
they run at the precision their engine was built with, which the fp32 golden tolerance does not
describe, and nothing checks their answers (`engines build` checks each engine's inputs and
outputs against its config.pbtxt, not its answers).

    for found in served_golden_checks(repository, "grpc://127.0.0.1:8001"):
        if not found.passed: print(found.refusal())
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bionemo_export.client.triton import TritonClient
from bionemo_export.model_repository.pbtxt import read_config
from bionemo_export.serving.golden import GOLDEN_FILE, GoldenCheck, read_golden, refusal

ASKED_PLATFORMS = ("onnxruntime_onnx",)
"""The graph models whose golden answers serve asks for: those that run no code of ours."""


@dataclass(frozen=True)
class ServedGolden:
    """One model's golden answers as the server gave them."""

    model: str
    graph: str
    checks: list[GoldenCheck]
    build: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def refusal(self) -> str:
        """Why the model's answers cannot be trusted on this host (serving/golden.refusal's words)."""
        return refusal(self.model, self.graph, [check for check in self.checks if not check.passed], self.build)


def native_platform(model_dir: Path) -> bool:
    """Whether the model is served by Triton's own ONNX Runtime backend."""
    return read_config(model_dir).platform in ASKED_PLATFORMS


def served_golden_checks(repository: Path, url: str,
                         asked: Callable[[Path], bool] = native_platform) -> list[ServedGolden]:
    """Ask the server at `url` for the golden answers of every model of `repository` that has them
    (version 1's golden.npz), takes exactly the golden inputs and is `asked` (default: served by
    Triton's ONNX Runtime backend), and compare them with the references."""
    found = []
    client = None
    for model_dir in sorted(path for path in repository.iterdir() if (path / "1" / GOLDEN_FILE).is_file()):
        if not (model_dir / "config.pbtxt").is_file() or not asked(model_dir):
            continue
        golden = read_golden(str(model_dir / "1" / GOLDEN_FILE))
        if {tensor.name for tensor in read_config(model_dir).input} != set(golden.inputs):
            continue  # a model that tokenizes for itself: it is not the graph's inputs it takes
        client = client or TritonClient(url)
        answers = client.infer(model_dir.name, golden.inputs, list(golden.references))
        found.append(ServedGolden(model_dir.name, f"{model_dir.name}/1/model.onnx as served at {url}",
                                  golden.check(answers), golden.build))
    return found
