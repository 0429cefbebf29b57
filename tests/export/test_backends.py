"""Serving backends (python, native, tensorrt) and the consistency of what they write.

Neither Triton's onnxruntime nor its tensorrt backend exists on this machine (docs/reference/platform.md), so
native and TensorRT repositories are checked the way those servers would check them at load time:
every config parses as Triton's ModelConfig; its inputs and outputs equal the ONNX graph's (ONNX
shape inference, and ONNX Runtime's own view of the graph); TensorRT's optimization profiles
cover every batch the dynamic batcher and the decode loops can send; the ensembles' steps agree.
Each inconsistency the checker reports is also produced on purpose, so the checks can fail.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
from tritonclient.grpc import model_config_pb2 as mc
from typer.testing import CliRunner

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.choices import Precision
from bionemo_export.cli.main import app
from bionemo_export.model_repository.backends import BACKENDS, ENGINE_FILE, ShapeRange, get_backend
from bionemo_export.model_repository.consistency import check_repository
from bionemo_export.model_repository.encoder import ServingOptions, plan_encoder_repository
from bionemo_export.model_repository.graph_io import graph_io
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.model_repository.pbtxt import parse_pbtxt, read_config, write_config
from bionemo_export.models import load_checkpoint
from bionemo_export.testing.checkpoints import save_random_checkpoint

runner = CliRunner()
ORT_TO_TRITON = {"tensor(int64)": "INT64", "tensor(float)": "FP32", "tensor(bool)": "BOOL"}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    # The seeds the other modules build these families with: their graphs come from the run's graph cache.
    return {family: save_random_checkpoint(family, root / family, seed=seed)
            for family, seed in (("esm2", 0), ("megamolbart", 5))}


def _build(checkpoints, family, out, backend, **serving):
    return build_repository(BuildRequest(family=family, checkpoint=checkpoints[family], name="m", out=out,
                                         backend=backend, serving=ServingOptions(max_batch_size=8, **serving)))


@pytest.fixture(scope="module")
def repositories(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("repositories")
    built = {}
    for family, backend in (("esm2", "native"), ("esm2", "tensorrt"), ("megamolbart", "tensorrt")):
        out = root / f"{family}-{backend}"
        _build(checkpoints, family, out, backend)
        built[family, backend] = out
    return built


def _copy(repository, tmp_path):
    return shutil.copytree(repository, tmp_path / "copy")


# -- what each backend writes ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("key", [("esm2", "native"), ("esm2", "tensorrt"), ("megamolbart", "tensorrt")])
def test_every_config_parses_and_the_repository_is_consistent(repositories, key):
    repository = repositories[key]
    for config in repository.glob("*/config.pbtxt"):
        parsed = parse_pbtxt(config.read_text())
        assert parsed.name == config.parent.name
    assert check_repository(repository) == []


@pytest.mark.parametrize("key", [("esm2", "native"), ("esm2", "tensorrt"), ("megamolbart", "tensorrt")])
def test_graph_configs_match_what_onnx_runtime_sees_in_the_graph(repositories, key):
    """A second, independent reading of each graph: ONNX Runtime's session inputs and outputs."""
    checked = 0
    for folder in sorted(repositories[key].iterdir()):
        if not (folder / "config.pbtxt").is_file():
            continue
        config = read_config(folder)
        if config.platform not in ("onnxruntime_onnx", "tensorrt_plan"):
            continue
        session = ort.InferenceSession(str(folder / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
        for declared, seen in ((config.input, session.get_inputs()), (config.output, session.get_outputs())):
            assert [t.name for t in declared] == [t.name for t in seen]
            for tensor, graph_tensor in zip(declared, seen):
                assert mc.DataType.Name(tensor.data_type) == f"TYPE_{ORT_TO_TRITON[graph_tensor.type]}"
                graph_dims = [d if isinstance(d, int) else -1 for d in graph_tensor.shape]
                assert list(tensor.dims) == (graph_dims[1:] if config.max_batch_size else graph_dims)
        checked += 1
    # esm2: the encoder and the masked-LM head (a random ESM-2 is an EsmForMaskedLM); megamolbart: encoder,
    # cross_kv, decoder_step.
    assert checked == (2 if key[0] == "esm2" else 3)


def test_tensorrt_models_are_gpu_plans_built_from_standard_onnx_with_a_profile_for_every_length(repositories):
    repository = repositories["esm2", "tensorrt"]
    encoder = read_config(repository / "m_encoder")
    assert encoder.platform == "tensorrt_plan" and encoder.default_model_filename == "model.plan"
    assert encoder.instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU
    recipe = json.loads((repository / "m_encoder" / "1" / ENGINE_FILE).read_text())
    assert list(encoder.instance_group[0].profile) == [str(i) for i in range(len(recipe["profiles"]))]
    assert recipe["precision"] == "fp16" and recipe["built"] is None
    # Lengths are split into profiles; together they reach the tokenizer's limit at the full batch.
    maxima = [profile["input_ids"]["max"] for profile in recipe["profiles"]]
    manifest = json.loads((repository / "manifest.json").read_text())
    assert maxima[-1] == [8, manifest["max_length"]] and len(maxima) > 1
    assert manifest["backend"] == "tensorrt" and manifest["device"] == "gpu"
    # TensorRT parses standard ONNX only: no ONNX Runtime contrib operators in its graphs.
    for graph in repository.glob("*/1/model.onnx"):
        domains = {node.domain for node in onnx.load(str(graph), load_external_data=False).graph.node}
        assert domains <= {"", "ai.onnx"}, (graph, domains)
    # The tokenizer pads to the length bucket, so that close lengths share a shape and batch.
    assert read_config(repository / "m_tokenizer").parameters["length_bucket"].string_value == "16"
    assert read_config(repository / "m_tokenizer").instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


def test_decoder_graph_profiles_cover_every_row_count_the_decode_loops_can_send(repositories):
    repository = repositories["megamolbart", "tensorrt"]
    samplings = read_config(repository / "m_samplings").parameters
    rows = min(8 * int(samplings["max_samples_x_beams"].string_value),
               int(samplings["max_decode_tokens"].string_value))
    decode_length = int(samplings["max_decode_length"].string_value)
    recipe = json.loads((repository / "m_decoder_step" / "1" / ENGINE_FILE).read_text())
    (profile,) = recipe["profiles"]
    assert profile["past_k"]["min"][3] == 0 and profile["past_k"]["max"][3] >= decode_length
    assert profile["tokens"]["max"][0] == rows and profile["tokens"]["min"] == [1, 1]
    # Decode loops call the graphs through BLS, so they only run Python: CPU instances.
    assert read_config(repository / "m_decodes").instance_group[0].kind == mc.ModelInstanceGroup.KIND_CPU


# -- the checker finds what a server would refuse ---------------------------------------------------------------

def _edit_config(folder, change):
    config = read_config(folder)
    change(config)
    write_config(folder, config)


def test_a_config_dim_that_disagrees_with_the_graph_is_found(repositories, tmp_path):
    repository = _copy(repositories["esm2", "native"], tmp_path)
    _edit_config(repository / "m_encoder", lambda c: c.output[0].dims.__setitem__(1, 31))
    findings = check_repository(repository)
    assert "m_encoder: output 'hiddens' has dims [-1, 31] in the config but [-1, 32] in the graph" in findings[-1]
    assert "ensemble m_hiddens: tensor 'hiddens' has dims [-1, 31] but [-1, 32] is expected" in findings[0]


def test_a_dtype_or_name_that_disagrees_with_the_graph_is_found(repositories, tmp_path):
    repository = _copy(repositories["esm2", "native"], tmp_path)
    _edit_config(repository / "m_encoder", lambda c: setattr(c.input[2], "data_type", mc.TYPE_INT64))
    findings = check_repository(repository)
    assert any("input 'residue_mask' is INT64 in the config but BOOL in the graph" in f for f in findings)
    _edit_config(repository / "m_encoder", lambda c: setattr(c.output[1], "name", "pooled"))
    assert any("config outputs ['hiddens', 'pooled'] differ" in f for f in check_repository(repository))


def test_a_batch_larger_than_the_profiles_is_found(repositories, tmp_path):
    repository = _copy(repositories["esm2", "tensorrt"], tmp_path)
    for model in ("m_encoder", "m_tokenizer", "m_embeddings", "m_hiddens"):
        _edit_config(repository / model, lambda c: setattr(c, "max_batch_size", 16))
    findings = check_repository(repository)
    assert len(findings) == 1 and "no profile covers {'batch': 9" in findings[0]


def test_a_length_gap_between_profiles_and_an_unlisted_profile_are_found(repositories, tmp_path):
    repository = _copy(repositories["esm2", "tensorrt"], tmp_path)
    path = repository / "m_encoder" / "1" / ENGINE_FILE
    recipe = json.loads(path.read_text())
    del recipe["profiles"][1]  # lengths 65..128
    path.write_text(json.dumps(recipe))
    findings = check_repository(repository)
    assert any("instance_group profile ['0', '1', '2', '3', '4'] should list all 4 profiles" in f for f in findings)
    _edit_config(repository / "m_encoder", lambda c: c.instance_group[0].profile.pop())
    (finding,) = check_repository(repository)
    assert "no profile covers {'batch': 1, 'length': 65}" in finding


def test_a_profile_that_disagrees_with_the_graph_is_found(repositories, tmp_path):
    repository = _copy(repositories["megamolbart", "tensorrt"], tmp_path)
    path = repository / "m_decoder_step" / "1" / ENGINE_FILE
    recipe = json.loads(path.read_text())
    recipe["profiles"][0]["past_k"]["max"][0] += 1  # the layer axis is fixed in the graph
    recipe["profiles"][0]["past_v"]["max"][3] -= 1  # past_length differs between past_k and past_v
    path.write_text(json.dumps(recipe))
    findings = check_repository(repository)
    assert any("input 'past_k': fixed axis 2 given 2..3" in f for f in findings)
    assert any("axis 'past_length' has different ranges across inputs" in f for f in findings)


def test_an_ensemble_step_that_disagrees_with_its_model_is_found(repositories, tmp_path):
    repository = _copy(repositories["esm2", "tensorrt"], tmp_path)
    _edit_config(repository / "m_tokenizer", lambda c: setattr(c.output[0], "data_type", mc.TYPE_INT32))
    assert any("ensemble m_embeddings, step m_encoder: tensor 'input_ids' is INT32 but INT64 is expected" in f
               for f in check_repository(repository))


def test_graphs_with_external_data_keep_it_beside_them_and_are_checked_without_reading_it(repositories, tmp_path):
    """Graphs over 2 GiB are stored as model.onnx + model.onnx.data; here a small one, the same way."""
    source = repositories["esm2", "native"] / "m_encoder" / "1" / "model.onnx"
    exported = tmp_path / "export"
    exported.mkdir()
    onnx.save(onnx.load(str(source)), str(exported / "model.onnx"), save_as_external_data=True,
              all_tensors_to_one_file=True, location="model.onnx.data", size_threshold=0)
    manifest = json.loads((repositories["esm2", "native"] / "manifest.json").read_text())
    loaded = load_checkpoint(Path(manifest["checkpoint"]["path"]), "esm2")
    tokenizer = loaded.tokenizer
    plan = plan_encoder_repository("m", family="esm2", hidden_size=loaded.hidden_size, tokenizer=tokenizer,
                                   onnx_files={p.name: p for p in exported.iterdir()},
                                   options=ServingOptions(backend="tensorrt", max_batch_size=8))
    out = tmp_path / "repo"
    out.mkdir()
    plan.write(out)
    Manifest(name="m", family="esm2", tasks=["embeddings", "hiddens"], max_length=tokenizer.max_length).write(out)
    version = out / "m_encoder" / "1"
    assert sorted(p.name for p in version.iterdir()) == [ENGINE_FILE, "model.onnx", "model.onnx.data"]
    assert graph_io(version / "model.onnx")[0][0].dims == ("batch", "length")
    assert check_repository(out) == []


# -- backends and devices -----------------------------------------------------------------------------------------

def test_each_backend_is_a_class_with_its_devices():
    assert set(BACKENDS) == {"python", "native", "tensorrt"}
    assert get_backend("tensorrt").device == "gpu" and get_backend("native").device == "cpu"
    assert get_backend("python", "gpu").instance_kind == mc.ModelInstanceGroup.KIND_GPU
    # Library errors name the settings by field (the command line words them as flags: test_choices.py).
    with pytest.raises(ValueError, match="`backend` tensorrt runs on gpu, not cpu: pass `device` gpu"):
        get_backend("tensorrt", "cpu")
    with pytest.raises(ValueError, match="`device` 'tpu': choose one of cpu, gpu"):
        get_backend("python", "tpu")
    with pytest.raises(ValueError, match="`backend` 'onnx': choose one of python, native, tensorrt"):
        get_backend("onnx")
    with pytest.raises(ValueError, match="fused layout runs the graph in a Python-backend model"):
        ServingOptions(backend="tensorrt", layout="fused")


def test_python_backend_on_gpu_places_graph_models_on_the_gpu(checkpoints, tmp_path):
    out = tmp_path / "repo"
    _build(checkpoints, "megamolbart", out, "python", device="gpu")
    for model in ("m_encoder", "m_decodes", "m_samplings"):  # fused: the decode loops run the decoder graphs
        assert read_config(out / model).instance_group[0].kind == mc.ModelInstanceGroup.KIND_GPU, model
    # The served package's session module picks the CUDA provider for a KIND_GPU instance.
    assert "CUDAExecutionProvider" in (out / "m_encoder" / "1" / "bionemo_serving" / "onnx_session.py").read_text()
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["device"] == "gpu"
    # GPU execution providers optimize for themselves: the stored graph is the plain export.
    assert manifest["export"]["encoder"]["optimization"]["level"] == "none"


def test_impossible_backend_device_precision_combinations_are_refused(checkpoints, tmp_path):
    with pytest.raises(BuildError, match="`backend` tensorrt runs on gpu, not cpu"):
        _build(checkpoints, "esm2", tmp_path / "a", "tensorrt", device="cpu")
    with pytest.raises(BuildError, match="`precision` int8 is ONNX Runtime's CPU quantization"):
        build_repository(BuildRequest(family="esm2", checkpoint=checkpoints["esm2"], name="m", out=tmp_path / "b",
                                      backend="tensorrt", precision=Precision.INT8))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_shape_ranges_split_lengths_at_bucket_multiples_and_cover_the_range():
    shapes = ShapeRange(axes={"ids": ("batch", "length")}, sizes={"batch": (1, 32), "length": (1, 1026)},
                        split_axis="length", bucket=16, opt={"batch": 32})
    assert shapes.segments() == [(1, 64), (65, 128), (129, 256), (257, 512), (513, 1026)]
    profiles = shapes.profiles()
    assert profiles[0]["ids"] == {"min": [1, 1], "opt": [32, 64], "max": [32, 64]}
    assert profiles[-1]["ids"]["max"] == [32, 1026]
    short = ShapeRange(axes={"ids": ("batch", "length")}, sizes={"batch": (1, 4), "length": (1, 40)},
                       split_axis="length")
    assert short.segments() == [(1, 40)]


# -- engines build ------------------------------------------------------------------------------------------------

def _tensorrt_installed() -> bool:
    return importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(_tensorrt_installed(), reason="TensorRT is installed: the real build is tested instead")
def test_engines_build_without_tensorrt_says_where_to_build(repositories):
    result = runner.invoke(app, ["engines", "build", str(repositories["esm2", "tensorrt"])])
    assert result.exit_code == 1
    assert "TensorRT is not installed here" in result.output and "nvcr.io/nvidia/tritonserver" in result.output


def test_engines_build_refuses_a_repository_without_tensorrt_models(repositories):
    result = runner.invoke(app, ["engines", "build", str(repositories["esm2", "native"])])
    assert result.exit_code == 1 and "has no TensorRT models" in result.output


def test_engines_build_refuses_an_inconsistent_repository(repositories, tmp_path):
    repository = _copy(repositories["esm2", "tensorrt"], tmp_path)
    _edit_config(repository / "m_encoder", lambda c: c.output[0].dims.__setitem__(1, 31))
    result = runner.invoke(app, ["engines", "build", str(repository)])
    assert result.exit_code == 1 and "is inconsistent; no engine built" in result.output


@pytest.mark.skipif(not _tensorrt_installed(), reason="TensorRT is not installed on this machine "
                    "(docs/reference/platform.md); engines are built inside NVIDIA's Triton container")
def test_engines_build_makes_plans_once_and_records_them(repositories, tmp_path):
    repository = _copy(repositories["esm2", "tensorrt"], tmp_path)
    first = runner.invoke(app, ["engines", "build", str(repository)])
    assert first.exit_code == 0, first.output
    assert (repository / "m_encoder" / "1" / "model.plan").stat().st_size > 0
    manifest = json.loads((repository / "manifest.json").read_text())
    assert manifest["engines"]["tensorrt"] and manifest["engines"]["models"]["m_encoder"]["precision"] == "fp16"
    again = runner.invoke(app, ["engines", "build", str(repository)])
    assert "up to date" in again.output
