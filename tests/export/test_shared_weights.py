"""The weights once per repository (issue 46, item 2): a default build of a tiny random ESM-2 with a
contact head serves layers, contacts and attentions from N_encoder, all four graphs over one
weights.bin; its weight bytes stay within 1.25x one copy; each graph served through the generated
N_encoder model.py (in a process of its own, with the fake pb_utils) answers as PyTorch does; every
consistency check of the shared file fails on a repository that breaks it. The served end to end
path (tritonserver) is tests/e2e/test_e2e_contacts.py, whose build is a default build now.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from google.protobuf.json_format import MessageToDict

from bionemo_export.build import BuildRequest, _check_tasks, build_repository
from bionemo_export.exporters.shared_weights import SMALL_TENSOR_BYTES, SharedWeightsWriter, share_weights
from bionemo_export.kits import kit_of
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.graph_io import external_references, initializer_bytes, repository_weight_bytes
from bionemo_export.model_repository.hosted_graphs import HOSTED_GRAPHS, SHARED_WEIGHTS
from bionemo_export.model_repository.integrity import check_repository_files
from bionemo_export.model_repository.pbtxt import read_config, write_config
from bionemo_export.models import get_family, load_checkpoint
from bionemo_export.tasks import HOSTED_GRAPHS as HOSTED
from bionemo_export.testing.checkpoints import save_random_checkpoint, set_contact_head
from tests.helpers import fake_pb_utils

NAME = "sw"
PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "GVE", "MSLKRKNIALIPAAGIGVRFG"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shared")
    # test_e2e_contacts.py's checkpoint: its plain graphs come from the run's graph cache when that module or
    # test_encode_jobs.py exported them first (this build then optimizes and shares them itself).
    checkpoint = set_contact_head(save_random_checkpoint("esm2", folder / "ck", seed=41), seed=42)
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=folder / "repo",
                                           backend="python"))
    return checkpoint, result


@pytest.fixture
def repository(built, tmp_path) -> Path:
    """A copy of the built repository, for a test to break."""
    return Path(shutil.copytree(built[1].repository, tmp_path / "repo"))


def test_a_default_build_serves_every_task_over_one_copy_of_the_weights(built):
    _, result = built
    for task in ("layers", "contacts", "attentions"):
        assert task in result.manifest.tasks and f"{NAME}_{task}" in result.models
    assert not [model for model in result.models if model.endswith("_graph")]
    version = result.repository / f"{NAME}_encoder" / "1"
    assert sorted(p.name for p in version.glob("*.onnx")) == ["attentions.onnx", "contacts.onnx", "layers.onnx",
                                                               "model.onnx"]
    for graph in version.glob("*.onnx"):  # every large tensor of every graph is in the one file
        assert {ref.location for ref in external_references(graph)} == {"weights.bin"}
    one_copy = initializer_bytes(version / "model.onnx")  # the encoder graph's weights alone, fp32
    separate = sum(initializer_bytes(graph) for graph in version.glob("*.onnx"))
    stored = repository_weight_bytes(result.repository)  # the head's graph included
    assert separate > 3 * one_copy  # what the graphs would store apart
    assert stored <= 1.25 * one_copy, (stored, one_copy)
    config = read_config(result.repository / f"{NAME}_encoder")
    assert set(json.loads(config.parameters[HOSTED_GRAPHS].string_value)) == {"layers", "contacts", "attentions"}
    callers = [read_config(result.repository / f"{NAME}_{task}").parameters["graph_model"].string_value
               for task in ("layers", "contacts", "attentions")]
    assert set(callers) == {f"{NAME}_encoder"}
    assert check_repository(result.repository) == [] and check_repository_files(result.repository) == []


def test_default_tasks_leave_the_hosted_graphs_out_where_each_would_copy_the_weights():
    family = get_family("esm2")
    hosted = {task for task in family.possible_tasks() if set(kit_of(task).graphs) & set(HOSTED)}
    assert hosted == {"layers", "contacts", "attentions"}
    assert hosted <= set(_check_tasks(family, None, hosts_graphs=True))
    assert not hosted & set(_check_tasks(family, None, hosts_graphs=False))
    assert "layers" in _check_tasks(family, ("embeddings", "layers"), hosts_graphs=False)  # named: built


SERVE = """
import numpy as np
model = module.TritonPythonModel()
model.initialize({{"model_config": open({config!r}).read(), "model_name": {name!r}, "model_instance_kind": "CPU"}})
feeds = np.load({feeds!r})
tokens = {{"input_ids": feeds["input_ids"], "attention_mask": feeds["attention_mask"]}}
sequences = np.array([[protein.encode()] for protein in {proteins!r}], dtype=object)
requests = [pb.request({{"sequences": sequences}}, requested=["embeddings"]),
            pb.request(tokens, requested=["hiddens_0", "hiddens_2"]),
            pb.request(tokens, requested=["contacts"]),
            pb.request(tokens, requested=["attentions_1"]),
            pb.request(tokens, requested=["hiddens", "contacts"])]
responses = model.execute(requests)
out = {{}}
for index, response in enumerate(responses):
    if response.has_error():
        out[f"{{index}}/error"] = np.array(response.error().message())
        continue
    for tensor in response.output_tensors():
        out[f"{{index}}/{{tensor.name()}}"] = tensor.as_numpy()
np.savez({out!r}, **out)
"""


def test_the_hosted_graphs_answer_through_n_encoder_as_pytorch_does(built, tmp_path):
    """One execute() of the generated N_encoder with a sequences request (the encoder's), requests
    for two layers, the contacts and block 1's attentions (each on its graph), and one mixing the
    encoder's output with a hosted one (refused alone, naming them)."""
    checkpoint, result = built
    loaded = load_checkpoint(checkpoint, "esm2")
    encoded = loaded.tokenizer.encode(PROTEINS)
    np.savez(tmp_path / "feeds.npz", input_ids=encoded.input_ids, attention_mask=encoded.attention_mask)
    folder = result.repository / f"{NAME}_encoder"
    (tmp_path / "config.json").write_text(json.dumps(MessageToDict(read_config(folder),
                                                                   preserving_proto_field_name=True)))
    code = fake_pb_utils.standalone_import(folder / "1" / "model.py") + SERVE.format(
        config=str(tmp_path / "config.json"), name=f"{NAME}_encoder", feeds=str(tmp_path / "feeds.npz"),
        out=str(tmp_path / "out.npz"), proteins=PROTEINS)
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=folder / "1")
    assert run.returncode == 0, run.stderr[-3000:]
    served = dict(np.load(tmp_path / "out.npz", allow_pickle=False))
    ids, mask = torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask)
    real = encoded.attention_mask.astype(bool)
    with torch.inference_mode():
        states = loaded.layer_states(ids, mask)
        assert loaded.contacts is not None  # the checkpoint carries the head (set_contact_head)
        contacts = loaded.contacts(ids, mask)
        attentions = loaded.attention_maps(ids, mask)
    for layer in (0, 2):
        assert np.abs((served[f"1/hiddens_{layer}"] - states[layer].numpy())[real]).max() <= ATOL
    assert np.abs(served["2/contacts"] - contacts.numpy()).max() <= ATOL
    assert np.abs(served["3/attentions_1"] - attentions[0].numpy()).max() <= ATOL
    residues = encoded.residue_mask.astype(bool)
    expected = np.stack([states[-1][row][residues[row]].mean(0).numpy() for row in range(len(PROTEINS))])
    assert np.abs(served["0/embeddings"] - expected).max() <= ATOL
    assert "different graphs" in str(served["4/error"])


# ---------------------------------------------------------------------------- consistency of the shared file
def test_verify_without_a_checkpoint_runs_the_hosted_graphs_golden_answers(repository):
    """`verify REPO` (no checkpoint) runs every stored graph's golden answers here: the graphs
    N_encoder hosts too (<stem>.golden.npz beside <stem>.onnx), each named; one whose references
    are wrong fails alone."""
    from bionemo_export.serving.golden import read_golden, write_golden
    from bionemo_export.verify import verify_golden

    checks = verify_golden(repository)
    assert all(check.passed for check in checks), [check.to_dict() for check in checks]
    encoder = f"{NAME}_encoder"
    models = {check.model.split(":")[0] for check in checks}
    assert {encoder, *(f"{encoder} ({graph})" for graph in ("layers", "contacts", "attentions"))} <= models
    path = repository / encoder / "1" / "layers.golden.npz"
    golden = read_golden(str(path))
    write_golden(str(path), golden.inputs, {name: -value for name, value in golden.references.items()},
                 mask_input=golden.mask_input, tolerances=golden.tolerances)
    failed = {check.model.split(":")[0] for check in verify_golden(repository, check_files=False) if not check.passed}
    assert failed == {f"{encoder} (layers)"}


def _finding(repository: Path, words: str) -> list[str]:
    found = [line for line in check_repository(repository) if words in line]
    assert found, check_repository(repository)
    return found


def test_a_changed_shared_weights_file_is_found(repository):
    weights = repository / f"{NAME}_encoder" / "1" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    _finding(repository, "is not the file its graphs were built over")
    assert any("weights.bin changed since the build" in line for line in check_repository_files(repository))


def test_a_missing_shared_weights_file_is_found(repository):
    (repository / f"{NAME}_encoder" / "1" / "weights.bin").unlink()
    _finding(repository, "its weights file weights.bin is missing")
    _finding(repository, "its shared weights file 1/weights.bin is missing")


def test_a_truncated_shared_weights_file_is_found(repository):
    weights = repository / f"{NAME}_encoder" / "1" / "weights.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    _finding(repository, "reaches byte")


def test_external_data_outside_the_graphs_folder_is_found(repository):
    graph = repository / f"{NAME}_encoder" / "1" / "layers.onnx"
    model = onnx.load(str(graph), load_external_data=False)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = f"../../{NAME}_encoder/1/weights.bin"
    onnx.save_model(model, str(graph))
    _finding(repository, "outside the graph's folder")


def test_a_missing_hosted_graph_is_found(repository):
    (repository / f"{NAME}_encoder" / "1" / "contacts.onnx").unlink()
    _finding(repository, "hosted graph contacts's 1/contacts.onnx is missing")


def test_a_hosted_output_the_config_does_not_serve_is_found(repository):
    folder = repository / f"{NAME}_encoder"
    config = read_config(folder)
    kept = [output for output in config.output if output.name != "attentions_2"]
    del config.output[:]
    config.output.extend(kept)
    write_config(folder, config)
    _finding(repository, "the config has no outputs ['attentions_2'] of hosted graph attentions")


def test_a_hosted_output_of_other_dims_is_found(repository):
    folder = repository / f"{NAME}_encoder"
    config = read_config(folder)
    for output in config.output:
        if output.name == "contacts":
            output.dims.append(-1)  # [-1, -1, -1]: the graph's is [batch, residues, residues]
    write_config(folder, config)
    _finding(repository, "output 'contacts' has dims")


def test_a_recorded_digest_for_no_file_is_found(repository):
    folder = repository / f"{NAME}_encoder"
    config = read_config(folder)
    recorded = json.loads(config.parameters[SHARED_WEIGHTS].string_value)
    config.parameters[SHARED_WEIGHTS].string_value = json.dumps({**recorded, "bytes": recorded["bytes"] + 1})
    write_config(folder, config)
    _finding(repository, "is not the file its graphs were built over")


# ---------------------------------------------------------------------------- the writer
def _graph(tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
    """y = x + sum of `tensors` (each [4, n]), its weights inline."""
    nodes, current = [], "x"
    for index, name in enumerate(tensors):
        nodes.append(onnx.helper.make_node("Add", [current, name], [f"s{index}"]))
        current = f"s{index}"
    width = next(iter(tensors.values())).shape[1]
    graph = onnx.helper.make_graph(
        nodes, "g", [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, width])],
        [onnx.helper.make_tensor_value_info(current, onnx.TensorProto.FLOAT, [4, width])],
        [onnx.numpy_helper.from_array(value, name) for name, value in tensors.items()])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def test_share_weights_stores_each_distinct_tensor_once_and_the_graphs_answer_as_before(tmp_path):
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    big, other, small = (rng.standard_normal((4, 512)).astype(np.float32) for _ in range(3))
    small = small[:, :8].copy()  # 128 bytes: stays inline
    graphs = {"a": _graph({"w": big, "u": other}), "b": _graph({"same_as_w": big.copy()})}
    graphs["c"] = _graph({"tiny": small})
    sources = {}
    for name, model in graphs.items():  # b's weights in an external-data file of its own, as a large export's
        if name == "b":
            onnx.save_model(model, str(tmp_path / "b.onnx"), save_as_external_data=True, location="b.data",
                            size_threshold=0)
        else:
            onnx.save_model(model, str(tmp_path / f"{name}.onnx"))
        sources[name] = tmp_path / f"{name}.onnx"
    shared = share_weights(sources, tmp_path / "out", {name: f"{name}.onnx" for name in graphs})
    with SharedWeightsWriter(tmp_path / "one_at_a_time") as writer:  # as a build adds them
        for name, source in sources.items():
            written = writer.add(name, source, f"{name}.onnx")
            ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])  # opens before close
    assert (writer.result.weights.read_bytes() == shared.weights.read_bytes()
            and writer.result.stored_bytes == shared.stored_bytes and writer.result.tensors == shared.tensors)
    assert shared.tensors == 2 and shared.stored_bytes < 2 * big.nbytes + 64
    assert shared.referenced_bytes == 3 * big.nbytes and small.nbytes < SMALL_TENSOR_BYTES
    offsets = {ref.offset for graph in shared.graphs.values() for ref in external_references(graph)}
    assert len(offsets) == 2 and all(offset % 64 == 0 for offset in offsets)
    assert external_references(shared.graphs["c"]) == []
    x = rng.standard_normal((4, 512)).astype(np.float32)
    for name in ("a", "b"):
        before = ort.InferenceSession(str(sources[name]), providers=["CPUExecutionProvider"])
        after = ort.InferenceSession(str(shared.graphs[name]), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(np.asarray(before.run(None, {"x": x})[0]),
                                      np.asarray(after.run(None, {"x": x})[0]))
