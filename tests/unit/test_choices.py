"""Choices as enums, the command line's defaults from the options' dataclasses, library errors that
name fields (worded as flags by the command line, in one place), and one exception hierarchy whose
user-error branch decides what the user sees."""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil

import pytest
from typer.main import get_command
from typer.testing import CliRunner

import bionemo_export
from bionemo_export.choices import AUTO_PRECISION, ChoiceError, Device, Exporter, Layout, Precision
from bionemo_export.cli import option_flags
from bionemo_export.cli.main import app, error_line
from bionemo_export.errors import STANDALONE_USER_ERRORS, BionemoExportError, UserError, reason
from bionemo_export.model_repository.backends import get_backend
from bionemo_export.model_repository.options import GenerationLimits, ServingOptions

runner = CliRunner()
WIDE = {"COLUMNS": "250"}


def _command(*path: str):
    command = get_command(app)
    for name in path:
        command = command.commands[name]  # pyright: ignore[reportAttributeAccessIssue] - a group's subcommands
    return command


def test_a_choice_equals_and_serializes_as_its_value():
    assert Precision("int8") == "int8" and f"{Device.GPU}" == "gpu" and json.dumps([Layout.FUSED]) == '["fused"]'
    assert ServingOptions(device="gpu", layout="ensemble").device is Device.GPU  # plain strings are read
    with pytest.raises(ChoiceError, match="`layout` 'sideways': choose one of auto, fused, ensemble"):
        ServingOptions(layout="sideways")


def test_the_build_options_take_their_defaults_from_the_dataclasses():
    options = {param.name: param for param in _command("build", "repo").params}
    serving = {field.name: field.default for field in dataclasses.fields(ServingOptions)}
    limits = {field.name: field.default for field in dataclasses.fields(GenerationLimits)}
    # --backend is the build's (BuildRequest: auto, resolved for the host), not ServingOptions'.
    shared = {name: default for name, default in {**serving, **limits}.items() if name in options and name != "backend"}
    assert len(shared) >= 20, sorted(shared)  # every flat ServingOptions field the command line sets
    for name, default in shared.items():
        assert options[name].default == default, name


def test_a_build_request_holds_its_choices_as_enums_checked_where_it_is_made(tmp_path):
    """BuildRequest reads a library caller's strings once, when it is made: below it, the build
    compares members (the graph cache once missed entries because "torch" and Exporter.TORCH were
    keyed apart); a bad value is refused before anything is read, naming the field."""
    from bionemo_export.build import BuildError, BuildRequest

    def request(**changes) -> BuildRequest:
        return BuildRequest(family="esm2", checkpoint=tmp_path / "nowhere", name="m", out=tmp_path / "r", **changes)

    made = request(exporter="navigator", precision="int8")  # pyright: ignore[reportArgumentType] - as a caller may
    assert made.exporter is Exporter.NAVIGATOR and made.precision is Precision.INT8
    assert made.graph_precision is Precision.INT8
    assert dataclasses.replace(made, precision="fp16").precision is Precision.FP16  # pyright: ignore[reportArgumentType]
    assert request(precision="auto").precision == AUTO_PRECISION  # pyright: ignore[reportArgumentType]
    for changes, message in [({"exporter": "onnxmltools"}, "`exporter` 'onnxmltools': choose one of torch, navigator"),
                             ({"precision": "int2"}, "`precision` 'int2': choose one of fp32, int8, int8w, int4, fp16, "
                                                     "auto"),
                             ({"backend": "vllm"}, "`backend` 'vllm': choose one of auto, "),
                             ({"block_size": 48}, "`block_size` 48"),
                             ({"precision": Precision.INT8, "streamed": True}, "`stream-weights` writes")]:
        with pytest.raises(BuildError, match=message.replace("(", r"\(")):
            request(**changes)


def test_no_parameter_name_means_two_flags():
    seen: dict[str, set[str]] = {}

    def visit(command) -> None:
        for param in command.params:
            seen.setdefault(param.name, set()).update(opt for opt in param.opts[:1] if opt.startswith("--"))
        for sub in getattr(command, "commands", {}).values():
            visit(sub)

    visit(get_command(app))
    assert {name: flags for name, flags in seen.items() if len(flags) > 1} == {}
    assert option_flags()["max_queue_delay_microseconds"] == "--queue-delay-us"
    assert option_flags()["family"] == "--model" and option_flags()["storage"] == "--storage-uri"
    # Fields library errors name: bench's InputSpec.file, `repo push`'s replace, the tritonserver to use.
    assert option_flags()["file"] == "--input" and option_flags()["lengths"] == "--lengths"
    assert option_flags()["replace"] == "--replace" and option_flags()["tritonserver"] == "--tritonserver"
    assert option_flags()["max_decode_length"] == "--max-decode-length" and option_flags()["precision"] == "--precision"


def test_library_errors_name_fields_and_the_command_line_words_them_as_flags(tmp_path):
    with pytest.raises(ChoiceError) as refused:
        get_backend("tensorrt", "cpu")
    assert str(refused.value) == "`backend` tensorrt runs on gpu, not cpu: pass `device` gpu"
    assert error_line(refused.value) == "error: --backend tensorrt runs on gpu, not cpu: pass --device gpu"
    with pytest.raises(ValueError) as small:  # still a ValueError for callers that catch those
        ServingOptions(max_batch_size=0)
    assert error_line(small.value) == "error: --max-batch-size must be at least 1"
    from bionemo_export.client.variants import read_variant_table

    (tmp_path / "v.csv").write_text("variant\nM1A\n")
    with pytest.raises(ValueError) as column:
        read_variant_table(tmp_path / "v.csv")
    assert error_line(column.value).endswith("no 'mutant' column (columns: variant); name it with --column")
    # A field no option sets keeps its name; a library error's text outside backticks is left alone.
    assert reason(UserError("`roles` and --debug"), option_flags().get) == "`roles` and --debug"


def test_the_build_command_words_a_refused_combination_with_its_flags(tmp_path):
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(tmp_path), "--name", "m",
                                 "--out", str(tmp_path / "repo"), "--backend", "tensorrt", "--device", "cpu"], env=WIDE)
    assert result.exit_code == 1
    assert "build failed: --backend tensorrt runs on gpu, not cpu: pass --device gpu" in result.output
    windows = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(tmp_path), "--name", "m",
                                  "--out", str(tmp_path / "repo"), "--backend", "native", "--max-residues", "100"],
                            env=WIDE)
    assert windows.exit_code == 1 and "--max-residues runs windows" in windows.output
    assert "use --backend python" in windows.output


def test_a_value_none_of_the_choices_is_one_line_naming_the_option(tmp_path):
    result = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(tmp_path), "--name", "m",
                                 "--out", str(tmp_path / "repo"), "--precision", "int2"], env=WIDE)
    assert result.exit_code == 1
    assert result.output == "error: --precision int2: choose one of fp32, int8, int8w, int4, fp16, auto\n"
    backend = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(tmp_path), "--name", "m",
                                  "--out", str(tmp_path / "repo"), "--backend", "onnx"], env=WIDE)
    assert backend.output == "error: --backend onnx: choose one of auto, python, native, tensorrt\n"


def test_engines_build_names_the_precision_setting_and_its_choices(tmp_path):
    from bionemo_export.runtime.engines import build_engines

    with pytest.raises(ChoiceError) as refused:  # before the repository is looked at
        build_engines(tmp_path, precision="fp8")
    assert str(refused.value) == "`precision` 'fp8': choose one of fp16, fp32"
    assert error_line(refused.value) == "error: --precision 'fp8': choose one of fp16, fp32"
    result = runner.invoke(app, ["engines", "build", str(tmp_path), "--precision", "fp8"], env=WIDE)
    assert result.exit_code == 1 and result.output == "error: --precision fp8: choose one of fp16, fp32\n"


def test_a_decode_length_beyond_the_models_names_the_setting(tmp_path):
    from bionemo_export.dev_server import DevModels
    from bionemo_export.model_repository.seq2seq import plan_seq2seq_repository
    from bionemo_export.models import load_checkpoint
    from bionemo_export.testing.checkpoints import save_random_checkpoint

    checkpoint = save_random_checkpoint("megamolbart", tmp_path / "checkpoint")
    loaded = load_checkpoint(checkpoint, "megamolbart")
    assert loaded.seq2seq is not None, "megamolbart decodes"
    limit = loaded.seq2seq.max_decode_length
    message = f"must be between 1 and the model's {limit}, got {limit + 1}"
    with pytest.raises(ValueError) as planned:  # the build's planner
        plan_seq2seq_repository("m", family="megamolbart", hidden_size=loaded.hidden_size, tokenizer=loaded.tokenizer,
                                seq2seq=loaded.seq2seq, graph_specs={}, onnx_files={}, max_decode_length=limit + 1)
    assert str(planned.value) == f"`max_decode_length` {message}"
    assert error_line(planned.value) == f"error: --max-decode-length {message}"
    with pytest.raises(ValueError) as dev:
        DevModels(loaded, max_decode_length=limit + 1)
    assert str(dev.value) == f"`max_decode_length` {message}"
    result = runner.invoke(app, ["dev-server", "--checkpoint", str(checkpoint), "--model", "megamolbart", "--name", "m",
                                 "--max-decode-length", str(limit + 1)], env=WIDE)
    assert result.exit_code == 1 and result.output.endswith(f"error: --max-decode-length {message}\n"), result.output


def _exception_classes():
    """Every exception class the package defines (its modules imported: torch included)."""
    for info in pkgutil.walk_packages(bionemo_export.__path__, "bionemo_export."):
        if ".templates" in info.name:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                yield value


def test_every_error_the_package_raises_on_purpose_shares_one_base():
    # Modules copied into repositories cannot import errors.py: their user errors are listed instead.
    outside = {f"{cls.__module__}.{cls.__qualname__}" for cls in _exception_classes()
               if not issubclass(cls, BionemoExportError) and not cls.__name__.startswith("_")
               and not any((base.__module__, base.__qualname__) in STANDALONE_USER_ERRORS for base in cls.__mro__)}
    # Signals (a build's, serve's), the served models' own error responses, and the bounded readers'
    # refusals (which the .nemo reader words as a CheckpointError naming the archive) are not errors
    # for the command line to word.
    assert {name.rsplit(".", 1)[1] for name in outside} == {"BuildInterrupted", "StopServing", "RequestError",
                                                            "RefusedArchive", "RefusedConfig"}, outside
