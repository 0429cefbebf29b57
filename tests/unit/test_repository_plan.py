"""The repository plan: configs are schema-valid ModelConfigs and inconsistent ensembles are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2 as mc

from bionemo_export.model_repository.encoder import plan_encoder_repository
from bionemo_export.model_repository.options import RoleOptions, ServingOptions
from bionemo_export.model_repository.pbtxt import parse_pbtxt, read_config, to_pbtxt
from bionemo_export.model_repository.plan import EnsembleStep, ModelPlan, PlanError, RepositoryPlan
from bionemo_export.serving.tokenizers.character import CharacterTokenizer
from bionemo_export.tensors import DType, TensorSpec
from bionemo_export.testing.checkpoints import save_random_checkpoint

TOKENIZER = CharacterTokenizer(["<cls>", "<pad>", "<eos>", "A", "C"], residues="AC", pad_token="<pad>",
                               bos_token="<cls>", eos_token="<eos>", unk_token=None, max_length=16)


def _plan(tmp_path: Path, **options) -> RepositoryPlan:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"not really onnx")
    return plan_encoder_repository(
        "esm2nv", family="esm2", hidden_size=32, tokenizer=TOKENIZER, onnx_files={"model.onnx": onnx},
        options=ServingOptions(**options),
    )


def _code(model: ModelPlan) -> str:
    """The model.py `model` writes, checked to be generated text (not a file copied in) that compiles."""
    code = model.files["model.py"]
    assert isinstance(code, str), f"{model.name}'s model.py is a {type(code).__name__}, not generated text"
    compile(code, f"{model.name}/model.py", "exec")
    return code


def test_encoder_plan_has_the_public_models_and_valid_configs(tmp_path):
    plan = _plan(tmp_path)  # python backend: the fused layout
    names = [m.name for m in plan.models]
    assert names == ["esm2nv_encoder", "esm2nv_embeddings", "esm2nv_hiddens"]
    for model in plan.models:
        text = to_pbtxt(model.to_config())
        assert parse_pbtxt(text) == model.to_config()
    encoder = plan.model("esm2nv_encoder").to_config()
    assert [i.name for i in encoder.input] == ["sequences"] and encoder.input[0].data_type == mc.TYPE_STRING
    assert [o.name for o in encoder.output] == ["hiddens", "embeddings", "mask"]
    hiddens = plan.model("esm2nv_hiddens").to_config()
    assert hiddens.platform == "ensemble"
    assert [o.name for o in hiddens.output] == ["hiddens", "mask"]
    assert hiddens.output[1].data_type == mc.TYPE_BOOL
    assert [s.model_name for s in hiddens.ensemble_scheduling.step] == ["esm2nv_encoder"]
    assert dict(hiddens.ensemble_scheduling.step[0].output_map) == {"hiddens": "hiddens", "mask": "mask"}


def test_ensemble_layout_has_a_tokenizer_step_and_ragged_token_inputs(tmp_path):
    plan = _plan(tmp_path, layout="ensemble")
    assert [m.name for m in plan.models] == ["esm2nv_tokenizer", "esm2nv_encoder", "esm2nv_embeddings",
                                             "esm2nv_hiddens"]
    hiddens = plan.model("esm2nv_hiddens").to_config()
    assert [s.model_name for s in hiddens.ensemble_scheduling.step] == ["esm2nv_tokenizer", "esm2nv_encoder"]
    encoder = plan.model("esm2nv_encoder").to_config()
    assert [i.name for i in encoder.input] == ["input_ids", "attention_mask", "residue_mask"]
    assert all(i.allow_ragged_batch for i in encoder.input)
    assert encoder.parameters["pad_id"].string_value == str(TOKENIZER.pad_id)
    _code(plan.model("esm2nv_encoder"))


def test_native_backend_uses_onnxruntime_platform(tmp_path):
    plan = _plan(tmp_path, backend="native")
    assert "esm2nv_tokenizer" in [m.name for m in plan.models]  # native: always the ensemble layout
    encoder = plan.model("esm2nv_encoder")
    config = encoder.to_config()
    assert config.platform == "onnxruntime_onnx" and not config.backend
    assert config.default_model_filename == "model.onnx"
    assert not any(i.allow_ragged_batch for i in config.input)  # Triton's ORT backend would flatten them
    assert "model.py" not in encoder.files
    with pytest.raises(ValueError, match="fused layout"):
        ServingOptions(backend="native", layout="fused")


def test_python_backend_ships_a_model_py_that_compiles(tmp_path):
    encoder = _plan(tmp_path, backend="python").model("esm2nv_encoder")
    assert encoder.to_config().backend == "python"
    assert "import bionemo_export" not in _code(encoder)
    # The served package is copied beside it whole, with the tokenizer's vocabulary; the config names its class.
    assert {"bionemo_serving/batching.py", "bionemo_serving/host.py", "bionemo_serving/tokenizers/character.py",
            "tokenizer.json", "model.onnx"} <= set(encoder.files)
    assert encoder.parameters["served_model"] == "models.EncoderModel"
    tokenizer = _plan(tmp_path, layout="ensemble").model("esm2nv_tokenizer")
    assert "import bionemo_export" not in _code(tokenizer)


def test_batching_and_cache_options_reach_the_configs(tmp_path):
    plan = _plan(tmp_path, max_batch_size=48, response_cache=True, encoder_instances=2, length_bucket=32,
                 token_budget=4096, max_queue_delay_microseconds=500)
    encoder = plan.model("esm2nv_encoder").to_config()
    assert encoder.max_batch_size == 48
    assert list(encoder.dynamic_batching.preferred_batch_size) == [8, 16, 32, 48]
    assert encoder.dynamic_batching.max_queue_delay_microseconds == 500
    assert encoder.instance_group[0].count == 2
    parameters = {key: value.string_value for key, value in encoder.parameters.items()}
    assert parameters["length_bucket"] == "32" and parameters["token_budget"] == "4096"
    assert parameters["intra_op_threads"] == "auto"  # resolved by the serving host
    assert plan.model("esm2nv_embeddings").to_config().response_cache.enable


def test_each_role_owns_its_settings():
    options = ServingOptions(tokenizer_instances=3, decode_instances=3, sampling_instances=3, encoder_instances=2,
                             intra_op_threads=4)
    assert options.role("encoder").instances == 2 and options.role("encoder").threads == 4
    assert options.role("encoder").token_budget == 8192 and options.role("encoder").length_bucket == 16
    assert options.role("decoder_step").batching is None and options.role("cross_kv").instances == 2
    assert options.role("samplings").instances == 3 and options.role("samplings").batching is not None
    assert options.role("encoder").session_parameters()["intra_op_threads"] == "4"
    defaults = ServingOptions().role("encoder")
    assert defaults.instances == 1 and defaults.session_parameters()["intra_op_threads"] == "auto"
    assert defaults.session_parameters()["allow_spinning"] == "false"
    tuned = options.with_role("decodes", instances=5)
    assert tuned.role("decodes").instances == 5 and tuned.role("samplings").instances == 3
    assert ServingOptions(roles={"encoder": RoleOptions(instances=4)}).role("encoder").instances == 4
    with pytest.raises(ValueError, match="unknown role"):
        options.role("pooler")
    with pytest.raises(ValueError, match="token_budget"):
        ServingOptions(token_budget=-1)


def test_write_creates_folders_configs_and_files(tmp_path):
    plan = _plan(tmp_path)
    root = tmp_path / "repo"
    root.mkdir()
    plan.write(root)
    for model in plan.models:
        assert read_config(root / model.name).name == model.name
        assert (root / model.name / "1").is_dir()
    assert (root / "esm2nv_encoder" / "1" / "model.onnx").read_bytes() == b"not really onnx"
    assert (root / "esm2nv_encoder" / "1" / "bionemo_serving" / "tokenizers" / "character.py").is_file()
    assert (root / "esm2nv_encoder" / "1" / "bionemo_serving" / "batching.py").is_file()


def test_write_links_the_builds_own_files_and_copies_the_others(tmp_path):
    build_files = tmp_path / "build"
    build_files.mkdir()
    plan = _plan(build_files)  # its model.onnx is a file of the build's folder
    root = tmp_path / "repo"
    root.mkdir()
    plan.write(root, link_from=build_files)
    written = root / "esm2nv_encoder" / "1" / "model.onnx"
    assert written.stat().st_ino == (build_files / "model.onnx").stat().st_ino  # on disk once
    other = tmp_path / "elsewhere"
    other.mkdir()
    plan = _plan(other)  # the user's file, say: never linked, so the repository never changes with it
    again = tmp_path / "repo2"
    again.mkdir()
    plan.write(again, link_from=build_files)
    copied = again / "esm2nv_encoder" / "1" / "model.onnx"
    assert copied.stat().st_ino != (other / "model.onnx").stat().st_ino
    assert copied.read_bytes() == b"not really onnx"


def _two_step(out_dtype: str = "FP32", mapped: str = "y", ensemble_batch: int = 4) -> RepositoryPlan:
    first = ModelPlan("first", [TensorSpec("x", DType.BYTES, (1,))], [TensorSpec("y", DType.FP32, (-1,))], 8,
                      backend="python")
    second = ModelPlan("second", [TensorSpec("y", DType.of(out_dtype), (-1,))], [TensorSpec("z", DType.FP32, (3,))], 8,
                       backend="python")
    ensemble = ModelPlan("ens", [TensorSpec("x", DType.BYTES, (1,))], [TensorSpec("z", DType.FP32, (3,))],
                         ensemble_batch,
                         platform="ensemble", steps=[
                             EnsembleStep("first", {"x": "x"}, {"y": "y_t"}),
                             EnsembleStep("second", {"y": mapped}, {"z": "z"}),
                         ])
    return RepositoryPlan([first, second, ensemble])


def test_a_consistent_ensemble_validates():
    _two_step(mapped="y_t").validate()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mapped": "nowhere"}, "'nowhere' is not produced before this step"),
        ({"mapped": "y_t", "out_dtype": "INT64"}, "'y_t' is FP32 but INT64 is expected"),
        ({"mapped": "y_t", "ensemble_batch": 16}, "max_batch_size 16 exceeds the model's 8"),
    ],
)
def test_inconsistent_ensembles_are_refused_with_the_reason(kwargs, message):
    with pytest.raises(PlanError, match=message):
        _two_step(**kwargs).validate()


@pytest.fixture(scope="module")
def megamolbart(tmp_path_factory):
    """A tiny random MegaMolBART: its tokenizer, decoding modules and graph specs (nothing exported)."""
    from bionemo_export.models import get_family
    from bionemo_export.models.base import seq2seq_graph_specs

    family = get_family("megamolbart")
    loaded = family.load(save_random_checkpoint(family.name, tmp_path_factory.mktemp("mmb") / "ckpt", seed=0))
    assert loaded.seq2seq is not None
    return loaded, seq2seq_graph_specs(loaded.seq2seq, loaded.hidden_size)


def _seq2seq_plan(tmp_path: Path, megamolbart, **options) -> RepositoryPlan:
    from bionemo_export.model_repository.seq2seq import plan_seq2seq_repository

    loaded, specs = megamolbart
    files = {}
    for graph in ("encoder", "cross_kv", "decoder_step"):
        (tmp_path / graph).mkdir(exist_ok=True)
        (tmp_path / graph / "model.onnx").write_bytes(b"not really onnx")
        files[graph] = {"model.onnx": tmp_path / graph / "model.onnx"}
    return plan_seq2seq_repository("mmb", family="megamolbart", hidden_size=loaded.hidden_size,
                                   tokenizer=loaded.tokenizer, seq2seq=loaded.seq2seq, graph_specs=specs,
                                   onnx_files=files, options=ServingOptions(**options))


def test_fused_decode_loops_run_the_decoder_graphs_themselves(tmp_path, megamolbart):
    """Fused (python backend default): no N_cross_kv / N_decoder_step models; each decode loop has
    both graphs beside its model.py, ONNX Runtime settings in its parameters, no BLS callee but the
    encoder; decodes' inputs are ragged so requests of different lengths batch together."""
    plan = _seq2seq_plan(tmp_path, megamolbart)
    models = {model.name: model for model in plan.models}
    assert "mmb_cross_kv" not in models and "mmb_decoder_step" not in models
    for name in ("mmb_decodes", "mmb_samplings"):
        model = models[name]
        assert {"cross_kv/model.onnx", "decoder_step/model.onnx", "bionemo_serving/host.py"} <= set(model.files)
        assert model.parameters["intra_op_threads"] == "auto" and model.parameters["memory_arena"] == "run"
        assert model.parameters["decoder_graphs"] == "in_process" and "cross_kv_model" not in model.parameters
    assert "bls_models" not in models["mmb_decodes"].parameters  # it calls no other model
    assert models["mmb_samplings"].parameters["bls_models"] == "mmb_encoder"
    assert all(tensor.ragged for tensor in models["mmb_decodes"].inputs)
    plan.write(tmp_path / "repo")
    assert (tmp_path / "repo" / "mmb_decodes" / "1" / "decoder_step" / "model.onnx").is_file()


def test_ensemble_layout_calls_the_decoder_graph_models_through_bls(tmp_path, megamolbart):
    plan = _seq2seq_plan(tmp_path, megamolbart, layout="ensemble")
    models = {model.name: model for model in plan.models}
    assert {"mmb_cross_kv", "mmb_decoder_step", "mmb_tokenizer"} <= set(models)
    for name in ("mmb_decodes", "mmb_samplings"):
        parameters = models[name].parameters
        assert (parameters["decoder_graphs"], parameters["cross_kv_model"], parameters["decoder_step_model"]) == (
            "bls", "mmb_cross_kv", "mmb_decoder_step")
        assert "cross_kv/model.onnx" not in models[name].files
    assert models["mmb_decodes"].parameters["bls_models"] == "mmb_cross_kv,mmb_decoder_step"


def test_every_batched_model_bounds_its_queue(tmp_path):
    """Admission control: each model Triton batches (the encoder; the tokenizer in the ensemble
    layout) refuses work past max_queue_size or queue_timeout_s with a REJECT policy clients may
    shorten; the public ensembles have no queue of their own."""
    for layout, batched in (("fused", ["esm2nv_encoder"]), ("ensemble", ["esm2nv_tokenizer", "esm2nv_encoder"])):
        options = {"layout": layout, "backend": "python" if layout == "fused" else "native"}
        (tmp_path / layout).mkdir()
        plan = _plan(tmp_path / layout, **options)
        for name in batched:
            policy = plan.model(name).to_config().dynamic_batching.default_queue_policy
            assert policy.max_queue_size == ServingOptions.max_queue_size == 64
            assert policy.default_timeout_microseconds == 30_000_000
            assert policy.timeout_action == mc.ModelQueuePolicy.REJECT and policy.allow_timeout_override
        assert not plan.model("esm2nv_embeddings").to_config().HasField("dynamic_batching")
    (tmp_path / "tight").mkdir()
    (tmp_path / "off").mkdir()
    tight = _plan(tmp_path / "tight", max_queue_size=3, queue_timeout_s=0.25).model("esm2nv_encoder").to_config()
    assert tight.dynamic_batching.default_queue_policy.max_queue_size == 3
    assert tight.dynamic_batching.default_queue_policy.default_timeout_microseconds == 250_000
    unbounded = _plan(tmp_path / "off", max_queue_size=0, queue_timeout_s=0).model("esm2nv_encoder").to_config()
    assert not unbounded.dynamic_batching.HasField("default_queue_policy")
    written = ModelPlan.from_config(tight).dynamic_batching
    assert written is not None
    assert (written.max_queue_size, written.queue_timeout_microseconds) == (3, 250_000)


@pytest.mark.parametrize("field", ["max_queue_size", "queue_timeout_s"])
def test_queue_limits_are_checked_where_they_are_made(field):
    settings: dict[str, Any] = {field: -1}
    with pytest.raises(ValueError, match=field):
        ServingOptions(**settings)


def test_the_build_command_takes_the_queue_limits():
    import typer.main

    from bionemo_export.cli.build import repo

    options = {param.name: param for param in typer.main.get_command_from_info(
        typer.models.CommandInfo(callback=repo), pretty_exceptions_short=True, rich_markup_mode=None).params}
    assert options["max_queue_size"].default == ServingOptions.max_queue_size
    assert options["queue_timeout_s"].default == ServingOptions.queue_timeout_s


def _served_code(model: ModelPlan) -> str:
    """model.py without its module docstring: the code Triton runs."""
    code = _code(model)
    assert code.startswith('"""'), f"{model.name}'s model.py does not open with its docstring"
    return code[code.index('"""', 3) + 3:]


def test_every_generated_model_py_is_the_same_code_whatever_the_model(tmp_path, megamolbart):
    """The templates render a docstring only: every setting (tokenizer class, layout, callee names,
    graph tables) reaches model.py through config parameters, so each kind of model runs one piece
    of static code, and the tests of serving/ test what is served."""
    for folder in ("fused", "ensemble", "windows", "mmb-fused", "mmb-ensemble"):
        (tmp_path / folder).mkdir()
    plans = {"fused": _plan(tmp_path / "fused"), "ensemble": _plan(tmp_path / "ensemble", layout="ensemble"),
             "windows": _plan(tmp_path / "windows", max_residues=100),
             "mmb-fused": _seq2seq_plan(tmp_path / "mmb-fused", megamolbart),
             "mmb-ensemble": _seq2seq_plan(tmp_path / "mmb-ensemble", megamolbart, layout="ensemble")}
    kinds: dict[str, set[str]] = {}
    for plan in plans.values():
        for model in plan.models:
            if isinstance(model.files.get("model.py"), str):
                code = _served_code(model)
                assert "{{" not in code and "{%" not in code, f"{model.name}: template syntax left in model.py"
                kinds.setdefault(model.name.rsplit("_", 1)[-1], set()).add(code)
    assert {"encoder", "tokenizer", "decodes", "samplings", "step", "kv"} <= set(kinds), sorted(kinds)
    assert {kind: len(codes) for kind, codes in kinds.items() if len(codes) > 1} == {}
