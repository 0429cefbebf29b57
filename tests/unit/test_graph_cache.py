"""The graph cache's key and entries (exporters/graph_cache.py), without exporting anything: the
key changes with everything that decides the graph and with nothing that does not; an entry is
read only when it is whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bionemo_export.choices import Exporter
from bionemo_export.exporters.graph_cache import (
    ENVIRONMENT_VARIABLE,
    FORMAT,
    RECORD,
    GraphCache,
    default_graph_cache,
)
from bionemo_export.tensors import DType, TensorSpec

INPUTS = (TensorSpec("input_ids", DType.INT64, ("batch", "length")),)
OUTPUTS = (TensorSpec("hiddens", DType.FP32, ("batch", "length", 8)),)


class Config:
    """Like a Hugging Face config: settings, and where it was read from."""

    def __init__(self, scale: float, path: str) -> None:
        self.scale = scale
        self._name_or_path = path


class Scaled(torch.nn.Module):
    def __init__(self, seed: int = 0, scale: float = 1.0, path: str = "/data/a") -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(10, 8)
        self.config = Config(scale, path)
        self.register_buffer("offset", torch.zeros(8))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids) * self.config.scale + self.offset


def key(module: torch.nn.Module, arguments=(torch.ones(2, 3, dtype=torch.int64),), inputs=INPUTS, outputs=OUTPUTS,
        **changes) -> str:
    settings = {"file_name": "model.onnx", "exporter": Exporter.TORCH, "opset": 18, "external": False, **changes}
    return GraphCache(Path("/unused")).key(module, inputs, outputs, arguments, **settings)


def test_the_key_follows_what_decides_the_graph():
    base = key(Scaled())
    assert key(Scaled()) == base  # the same model built again
    assert key(Scaled(path="/elsewhere/b")) == base  # read from another folder: the same graph
    changed = Scaled()
    with torch.no_grad():
        changed.embed.weight[3, 4] += 1e-6
    assert key(changed) != base  # one weight
    buffered = Scaled()
    buffered.get_buffer("offset").add_(1)
    assert key(buffered) != base  # a buffer
    assert key(Scaled(scale=2.0)) != base  # a setting the forward reads
    assert key(Scaled(), arguments=(torch.ones(2, 4, dtype=torch.int64),)) != base  # the traced shape
    assert key(Scaled(), arguments=(torch.zeros(2, 3, dtype=torch.int64),)) != base  # the traced values
    assert key(Scaled(), opset=17) != base
    assert key(Scaled(), external=True) != base
    assert key(Scaled(), exporter=Exporter.NAVIGATOR) != base
    assert key(Scaled(), file_name="lm_head.onnx") != base  # external data names its file
    other_outputs = (TensorSpec("embeddings", DType.FP32, ("batch", "length", 8)),)
    assert key(Scaled(), outputs=other_outputs) != base


def test_the_key_follows_the_class_that_computes():
    class Doubled(Scaled):
        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(input_ids)

    assert key(Doubled()) != key(Scaled())


def test_an_entry_is_read_only_when_whole(tmp_path):
    cache = GraphCache(tmp_path / "cache")
    graph, weights = tmp_path / "model.onnx", tmp_path / "model.onnx.data"
    graph.write_bytes(b"graph")
    weights.write_bytes(b"weights")
    out = tmp_path / "out" / "model.onnx"
    out.parent.mkdir()
    with cache.entry("ab" * 32) as entry:
        assert entry.restore(out) is None  # nothing stored
        entry.store([graph, weights], {"seconds": 1.5})
        assert entry.restore(out) == {"seconds": 1.5}
    assert out.read_bytes() == b"graph" and out.with_name("model.onnx.data").read_bytes() == b"weights"
    assert not any((tmp_path / "cache" / "staging").iterdir())  # the staging folder was renamed into place

    record = entry.folder / RECORD
    stored = json.loads(record.read_text())
    record.write_text(json.dumps({**stored, "graph_cache_format": FORMAT + 1}))
    with cache.entry(entry.key) as again:
        assert again.restore(out) is None  # another format
    record.write_text(json.dumps(stored))
    (entry.folder / "model.onnx.data").unlink()
    with cache.entry(entry.key) as again:
        assert again.restore(out) is None  # a file missing
    record.write_text("{ half written")
    with cache.entry(entry.key) as again:
        assert again.restore(out) is None
    cache.evict(entry.key)
    assert not entry.folder.exists()


@pytest.mark.parametrize(("value", "expected"), [("", None), ("  ", None), ("/var/cache/graphs", "/var/cache/graphs")])
def test_the_default_folder_comes_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv(ENVIRONMENT_VARIABLE, value)
    assert default_graph_cache() == (Path(expected) if expected else None)
    monkeypatch.delenv(ENVIRONMENT_VARIABLE)
    assert default_graph_cache() is None
