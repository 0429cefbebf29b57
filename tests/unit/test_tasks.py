"""The task table (bionemo_export/tasks.py): typed, consistent with Triton's and numpy's types, and
the one source of the served API that the README, the clients and the probes show."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.client.repository import SAMPLING_INPUTS
from bionemo_export.model_repository.reader import PUBLIC_SUFFIXES, is_public
from bionemo_export.tasks import TASKS, Graph, Task, get_task, public_suffixes, served_api_table, task_of
from bionemo_export.tensors import DType, TensorSpec

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_dtype_names_a_triton_config_type_and_round_trips():
    for dtype in DType:
        assert mc.DataType.Value(dtype.config) > 0
        assert DType.of(dtype.value) is dtype and DType.of(dtype.config) is dtype
        assert DType.from_onnx(dtype.onnx) is dtype
    assert DType.of("TYPE_STRING") is DType.BYTES and DType.BYTES.numpy is np.object_
    assert DType.FP32.numpy is np.float32 and DType.BOOL.numpy is np.bool_


def test_onnx_numbers_are_onnxs_own():
    onnx = pytest.importorskip("onnx")
    assert DType.FP32.onnx == onnx.TensorProto.FLOAT and DType.FP16.onnx == onnx.TensorProto.FLOAT16
    assert DType.INT64.onnx == onnx.TensorProto.INT64 and DType.BOOL.onnx == onnx.TensorProto.BOOL
    assert DType.BF16.onnx == onnx.TensorProto.BFLOAT16 and DType.BYTES.onnx == onnx.TensorProto.STRING


MISPLACED_DOC: Any = "a doc given where `optional` goes"


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown tensor type 'FP8'; known: FP32, FP16"):
        DType.of("FP8")
    with pytest.raises(ValueError, match=r"unknown task 'fold'; tasks are embeddings, hiddens"):
        get_task("fold")
    with pytest.raises(ValueError, match="unknown size 'Q'"):
        Task("x", "", (TensorSpec("x", DType.FP32, ("Q",)),), (), role="x")
    with pytest.raises(TypeError, match="the doc is the keyword `doc`"):
        TensorSpec("x", DType.FP32, (1,), MISPLACED_DOC)
    with pytest.raises(KeyError, match="no samplings input 'radius'"):
        TASKS["samplings"].input("radius")


def test_tasks_are_consistent():
    for name, task in TASKS.items():
        assert task.name == name and task.doc and task.role
        names = [t.name for t in task.inputs]
        assert len(names) == len(set(names)), name
        assert task.required_inputs, f"{name} has no required input"
        for tensor in task.optional_inputs:  # a default must be of the tensor's type
            if tensor.default is not None:
                np.array(tensor.default, dtype=tensor.dtype.numpy if tensor.dtype is not DType.BYTES else object)
    assert TASKS["hiddens"].output("hiddens").shape({"H": 8}) == (-1, 8)
    assert TASKS["samplings"].input("sampling_method").default == "greedy-perturbate"


def test_public_names_come_from_the_table():
    assert PUBLIC_SUFFIXES == public_suffixes() == tuple(f"_{t}" for t in TASKS)
    assert is_public("esm2nv_embeddings") and not is_public("esm2nv_encoder")
    assert task_of("m_samplings") is TASKS["samplings"] and task_of("m_tokenizer") is None


def test_the_clients_sampling_options_are_the_tables():
    optional = {t.name: t.dtype.numpy for t in TASKS["samplings"].optional_inputs if t.dtype is not DType.BYTES}
    assert SAMPLING_INPUTS == optional and SAMPLING_INPUTS["seed"] is np.int64


def test_the_readme_shows_the_tables_served_api():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"<!-- served-api:[^>]*-->\n(.*?)<!-- /served-api -->", text, re.S)
    assert block, "the README lost its served-api markers"
    assert block.group(1) == served_api_table(), (
        "README's served-API table differs from tasks.py: paste served_api_table()")


def test_a_build_asking_for_a_task_the_table_does_not_know_names_the_known_ones():
    from bionemo_export.build import BuildError, _check_tasks
    from bionemo_export.models import get_family

    with pytest.raises(BuildError,
                       match=r"unknown task 'fold'; tasks are embeddings, hiddens, decodes, samplings, logits, scores"):
        _check_tasks(get_family("esm2"), ("embeddings", "fold"))
    with pytest.raises(BuildError,
                       match=r"family 'esm2' serves embeddings, hiddens, logits, scores, predictions, contacts, "
                             "layers, attentions; not samplings"):
        _check_tasks(get_family("esm2"), ("samplings",))


def test_every_task_has_its_kit_and_every_name_an_entry_declares_its_code():
    """Every entry has a kit (its graphs, planner, check and dev answer), and each registry keyed
    by the entries' declarations has an entry for every task (a task whose kit or client method is
    missing would fail only when built, verified or asked)."""
    from bionemo_export.build import MISSING
    from bionemo_export.client.repository import RepositoryClient
    from bionemo_export.kits import KITS, graph_exports, kit_of
    from bionemo_export.model_repository.options import ServingOptions, roles

    assert set(KITS) == set(TASKS)
    assert list(graph_exports()) == list(Graph)  # every graph has its export, in the enum's order
    for name, task in TASKS.items():
        assert name in kit_of(name).tasks and set(task.requires) <= set(MISSING), name
        assert callable(getattr(RepositoryClient, task.client_method)), name
        assert task.role in roles() and set(task.calls) <= set(TASKS), name
    options = ServingOptions(response_cache=True, sampling_instances=3, decode_instances=2)
    assert options.role("embeddings").response_cache and options.role("embeddings").batching is None
    assert options.role("scores").instances == 3 and options.role("scores").batching is not None
    assert options.role("decodes").instances == 2 and not options.role("decodes").response_cache
