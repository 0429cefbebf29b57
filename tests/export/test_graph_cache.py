"""The graph cache with real exports: a second export of the same module is copied, a damaged
entry is exported again, and a build whose cached graph disagrees with PyTorch removes it and
exports afresh instead of failing or storing it."""

from __future__ import annotations

import json
import logging

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.exporters import export_onnx
from bionemo_export.exporters.graph_cache import RECORD, GraphCache
from bionemo_export.models.base import ENCODER_INPUTS, encoder_outputs
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.export.test_exporters import HIDDEN, TinyEncoder, make_batch


@pytest.fixture
def cache(tmp_path) -> GraphCache:
    return GraphCache(tmp_path / "graphs")


def export(module, cache, out):
    return export_onnx(module, ENCODER_INPUTS, encoder_outputs(HIDDEN), make_batch(2, 9), out, cache=cache)


def test_the_same_module_is_exported_once_and_copied_after(cache, tmp_path):
    first = export(TinyEncoder().eval(), cache, tmp_path / "a" / "model.onnx")
    assert first.graph_cache_key and not first.from_graph_cache
    assert "from_graph_cache" not in first.to_dict()  # a miss records what an export always recorded
    second = export(TinyEncoder().eval(), cache, tmp_path / "b" / "model.onnx")
    assert second.from_graph_cache and second.graph_cache_key == first.graph_cache_key
    assert second.path.read_bytes() == first.path.read_bytes()
    assert second.to_dict()["from_graph_cache"] is True
    same = {k: v for k, v in first.to_dict().items() if k != "path"}
    cache_fields = ("path", "from_graph_cache", "graph_cache_key")
    assert {k: v for k, v in second.to_dict().items() if k not in cache_fields} == same

    other = TinyEncoder().eval()
    with torch.no_grad():
        other.embed.weight.mul_(2)
    third = export(other, cache, tmp_path / "c" / "model.onnx")
    assert not third.from_graph_cache and third.graph_cache_key != first.graph_cache_key


def test_a_damaged_entry_is_exported_again(cache, tmp_path):
    first = export(TinyEncoder().eval(), cache, tmp_path / "a" / "model.onnx")
    with cache.entry(first.graph_cache_key or "") as entry:
        (entry.folder / "model.onnx").write_bytes(b"not a graph")
    again = export(TinyEncoder().eval(), cache, tmp_path / "b" / "model.onnx")
    assert not again.from_graph_cache
    onnx.checker.check_model(str(again.path))
    with cache.entry(again.graph_cache_key or "") as entry:  # stored whole again
        assert (entry.folder / "model.onnx").read_bytes() == again.path.read_bytes()


def test_a_build_removes_a_cached_graph_that_disagrees_with_pytorch(tmp_path, caplog):
    """The cache's key missing something would give a build another model's graph: the build's
    check against PyTorch catches it, and the build exports afresh instead of failing."""
    cache = tmp_path / "graphs"
    checkpoint = save_random_checkpoint("esm2", tmp_path / "esm2", seed=0)
    request = BuildRequest(family="esm2", checkpoint=checkpoint, name="esm2nv", out=tmp_path / "first",
                           tasks=("embeddings",), backend="python", optimize=False, graph_cache=cache)
    built = build_repository(request).manifest.export["encoder"]
    entries = [p for p in cache.glob("??/*") if (p / RECORD).is_file()]
    assert "graph_cache_key" not in built and len(entries) == 1  # stored on the miss, recorded as a plain export
    # Put another model's encoder graph in its place: the same graph with one weight doubled (the
    # same signature, other answers).
    graph = onnx.load(str(entries[0] / "model.onnx"))
    weight = max(graph.graph.initializer, key=lambda tensor: int(np.prod(tensor.dims)))
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight) * 2, weight.name))
    onnx.save(graph, str(entries[0] / "model.onnx"))
    with caplog.at_level(logging.WARNING, logger="bionemo_export.build"):
        again = build_repository(BuildRequest(**{**request.__dict__, "out": tmp_path / "again"}))
    assert "failed its check against PyTorch; removed from the cache and exported again" in caplog.text
    record = again.manifest.export["encoder"]
    assert "from_graph_cache" not in record  # exported afresh
    assert again.manifest.verification["graphs"]["encoder"]["passed"]
    served = next((tmp_path / "again").rglob("model.onnx")).read_bytes()
    assert served == next((tmp_path / "first").rglob("model.onnx")).read_bytes()
    assert (entries[0] / "model.onnx").read_bytes() == served  # the entry holds the right graph again
    assert json.loads((entries[0] / RECORD).read_text())["files"] == ["model.onnx"]
