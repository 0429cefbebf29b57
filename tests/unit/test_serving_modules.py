"""The served models' logic (bionemo_export/serving/), run without a server through a fake of
`triton_python_backend_utils` (tests/helpers/fake_pb_utils.py): request options, error responses
and their codes, BLS error codes, config parameters, sampling jobs and their decodes, and the
N_samplings / N_decodes models end to end over a stand-in decoder. The same files are copied into
generated repositories (test_e2e_megamolbart.py and test_served_errors.py serve them for real).
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from bionemo_export.serving import decoding, request_options, responses, sampling
from bionemo_export.serving.kv_decoder import CROSS_KV_OUTPUTS
from bionemo_export.serving.parameters import flag_parameter, model_parameters, number_parameter
from bionemo_export.serving.search import LIMITS, SAMPLING_DEFAULTS, GenerationError
from bionemo_export.serving.tokenizers.smiles import SPECIAL_TOKENS, SmilesTokenizer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils

LIMIT_VALUES = {"max_num_samples": 8, "max_beam_size": 8, "max_samples_x_beams": 40, "max_decode_tokens": 4096}


@pytest.fixture
def pb(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def _options(**arrays):
    return request_options.parse_options(arrays, 2, LIMIT_VALUES)


def _column(value, dtype, rows=2):
    return np.full((rows, 1), value, dtype=dtype)


# ------------------------------------------------------------------------------ request options
def test_absent_options_get_the_defaults():
    assert _options() == {**SAMPLING_DEFAULTS, "seed": None}
    assert _options(num_samples=None, seed=None) == {**SAMPLING_DEFAULTS, "seed": None}  # PyTriton's absent inputs


def test_options_become_python_values():
    options = _options(num_samples=_column(3, np.int32), scaled_radius=_column(0.5, np.float32),
                       sampling_method=_column(b"beam-search-perturbate", np.object_), seed=_column(7, np.int64))
    assert options["num_samples"] == 3 and type(options["num_samples"]) is int
    assert options["scaled_radius"] == 0.5 and type(options["scaled_radius"]) is float
    assert options["sampling_method"] == "beam-search-perturbate" and options["seed"] == 7
    # PyTriton may hand BYTES over as a fixed-width bytes array
    assert _options(sampling_method=np.array([[b"topkp-perturbate"]] * 2))["sampling_method"] == "topkp-perturbate"


@pytest.mark.parametrize("name, value, dtype, message", [
    ("scaled_radius", np.nan, np.float32, "input 'scaled_radius' row 0 must be finite, got nan"),
    ("scaled_radius", np.inf, np.float32, "input 'scaled_radius' row 0 must be finite, got inf"),
    ("top_p", np.nan, np.float32, "input 'top_p' row 0 must be finite, got nan"),
    ("temperature", -np.inf, np.float32, "input 'temperature' row 0 must be finite, got -inf"),
    ("scaled_radius", -1.0, np.float32, "input 'scaled_radius' row 0"),
    ("num_samples", 0, np.int32, "input 'num_samples' row 0"),
    ("num_samples", 9, np.int32, "max_num_samples"),
    ("num_samples", 2.0, np.float32, "input 'num_samples' row 0 must be an integer, got 2.0"),
    ("beam_size", 9, np.int32, "max_beam_size"),
    ("sampling_method", b"nucleus", np.object_, "input 'sampling_method' row 0: unknown sampling method 'nucleus'"),
    ("seed", -1, np.int64, f"input 'seed' row 0 must be between 0 and {2**63 - 1}, got -1"),
])
def test_bad_options_name_the_input_row_and_problem(name, value, dtype, message):
    with pytest.raises((GenerationError, responses.RequestError), match=re.escape(message)):
        _options(**{name: _column(value, dtype)})


def test_nan_on_every_row_is_not_a_mismatch_but_not_finite():
    """A NaN radius gets one message however many rows carry it (the dev server too)."""
    with pytest.raises(GenerationError, match="^input 'scaled_radius' row 0 must be finite, got nan$"):
        _options(scaled_radius=_column(np.nan, np.float32))


def test_an_option_is_one_value_per_request():
    with pytest.raises(responses.RequestError,
                       match=r"^input 'top_p' row 1 differs from row 0 \(0.25 vs 0.5\): one value for the whole"):
        _options(top_p=np.array([[0.5], [0.25]], dtype=np.float32))
    with pytest.raises(responses.RequestError, match=r"^input 'top_p' row 1 differs from row 0 \(nan vs 0.5\)"):
        _options(top_p=np.array([[0.5], [np.nan]], dtype=np.float32))
    with pytest.raises(responses.RequestError, match=r"input 'seed' must have shape \[batch, 1\] = \[2, 1\] "
                                                     r"\(one value per row of 'sequences'\), got \[1, 1\]"):
        _options(seed=np.zeros((1, 1), dtype=np.int64))
    with pytest.raises(responses.RequestError, match="^input 'sampling_method' row 1 is not valid UTF-8$"):
        _options(sampling_method=np.array([[b"greedy-perturbate"], [b"\xff"]], dtype=np.object_))


def test_the_hypotheses_limit_names_both_inputs():
    with pytest.raises(GenerationError, match="num_samples x beam_size = 8 x 8 = 64 hypotheses per sequence"):
        _options(num_samples=_column(8, np.int32), beam_size=_column(8, np.int32),
                 sampling_method=_column(b"beam-search-perturbate", np.object_))


# ------------------------------------------------------------------------------ error responses
def test_error_responses_carry_code_and_prefix(pb):
    responder = responses.Responder("mmb_samplings", (GenerationError,))
    answer = responder.error_response(responses.RequestError("input 'x' is bad"))
    assert answer.error().code() == pb.TritonError.INVALID_ARG
    assert answer.error().message() == "mmb_samplings: input 'x' is bad"
    answer = responder.error_response(GenerationError("hiddens must be finite"), prefix="mmb")
    assert (answer.error().code(), answer.error().message()) == (pb.TritonError.INVALID_ARG,
                                                                 "mmb: hiddens must be finite")
    assert responder.error_response(responses.RequestError("plain"), prefix="").error().message() == "plain"
    forwarded = responses.RequestError("mmb_encoder: bad", pb.TritonError.UNAVAILABLE, forwarded=True)
    answer = responder.error_response(forwarded)
    assert (answer.error().code(), answer.error().message()) == (pb.TritonError.UNAVAILABLE, "mmb_encoder: bad")
    assert not pb.Logger.lines


def test_the_servers_own_failures_are_internal_and_logged(pb):
    responder = responses.Responder("mmb_decodes")
    answer = responder.error_response(KeyError("/secret/path.py"))
    assert answer.error().code() == pb.TritonError.INTERNAL
    assert answer.error().message() == "mmb_decodes: internal error (KeyError); the server log has the details"
    assert "/secret/path.py" in pb.Logger.lines[0] and pb.Logger.lines[0].startswith("mmb_decodes: KeyError")


def test_cancelled_requests_get_cancelled(pb):
    answer = responses.Responder("m").error_response(responses.cancelled())
    assert (answer.error().code(), answer.error().message()) == (pb.TritonError.CANCELLED,
                                                                 "m: the request was cancelled")


def test_answer_all_answers_every_request_when_execute_fails(pb):
    def execute(requests):
        raise RuntimeError("boom")

    answers = responses.Responder("m").answer_all([object(), object()], execute)
    assert [a.error().code() for a in answers] == [pb.TritonError.INTERNAL] * 2
    assert responses.Responder("m").answer_all([1], lambda requests: (["ok"], 1 << 30)) == ["ok"]


# ------------------------------------------------------------------------------ BLS error codes
@pytest.mark.parametrize("code, message, expected", [
    ("INTERNAL", "mmb_encoder: internal error (KeyError); the server log has the details", "INTERNAL"),
    ("INTERNAL", "mmb_encoder: the request was cancelled", "CANCELLED"),
    ("INTERNAL", "mmb_encoder: sequence 0: 'X' is not in the vocabulary", "INVALID_ARG"),
    ("INTERNAL", "Request for unknown model: 'mmb_encoder' is not found", "INTERNAL"),
    ("INTERNAL", "Exceeds maximum queue size", "UNAVAILABLE"),
    ("INTERNAL", "Request timeout expired", "UNAVAILABLE"),
    ("INTERNAL", "other_model: bad input", "INTERNAL"),
    ("INVALID_ARG", "mmb_encoder: the request was cancelled", "INVALID_ARG"),
    ("UNAVAILABLE", "anything", "UNAVAILABLE"),
])
def test_callee_code_reads_the_code_back_from_the_message(pb, code, message, expected):
    error = pb.TritonError(message, getattr(pb.TritonError, code))
    assert responses.callee_code("mmb_encoder", error) == getattr(pb.TritonError, expected)


def test_a_callees_error_is_forwarded_with_its_code(pb):
    pb.BLS_MODELS["mmb_encoder"] = lambda inputs, outputs: pb.InferenceResponse(
        error=pb.TritonError("Exceeds maximum queue size", pb.TritonError.INTERNAL))
    with pytest.raises(responses.RequestError) as caught:
        responses.call_model("mmb_encoder", {"sequences": np.array([[b"C"]], dtype=np.object_)}, ["hiddens"])
    assert caught.value.code == pb.TritonError.UNAVAILABLE and caught.value.forwarded
    answer = responses.Responder("mmb_samplings").error_response(caught.value)
    assert answer.error().message() == "Exceeds maximum queue size"  # no prefix: the callee's words
    pb.BLS_MODELS["mmb_encoder"] = lambda inputs, outputs: pb.InferenceResponse(
        [pb.Tensor("hiddens", np.ones((1, 2, 3), np.float32))])
    hiddens, = responses.call_model("mmb_encoder", {"sequences": np.array([[b"C"]], dtype=np.object_)}, ["hiddens"])
    assert hiddens.shape == (1, 2, 3)


# ------------------------------------------------------------------------------ parameters
def _args(**parameters):
    return {"model_name": "mmb_decodes", "model_repository": "/models/mmb_decodes",
            "model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in parameters.items()}})}


def test_parameters_are_read_from_the_config():
    args = _args(length_bucket="16", truncate="true", max_hidden_magnitude="1e4")
    parameters = model_parameters(args)
    assert number_parameter(args, parameters, "length_bucket") == 16
    assert number_parameter(args, parameters, "token_budget", "0") == 0
    assert number_parameter(args, parameters, "max_hidden_magnitude", kind=float) == 1e4
    assert flag_parameter(parameters, "truncate") and not flag_parameter(parameters, "warmup")
    with pytest.raises(ValueError, match=r"^/models/mmb_decodes/config.pbtxt: parameter length_bucket is 'x', "
                                         "not an integer; correct it, or rebuild the repository$"):
        number_parameter(_args(length_bucket="x"), {"length_bucket": "x"}, "length_bucket")


DECODE_PARAMETERS = dict(begin_id="2", end_id="3", model_max_decode_length="64", max_source_length="32",
                         max_decode_length="10", max_hidden_magnitude="1e4",
                         **{name: str(value) for name, value in LIMIT_VALUES.items()})


def test_decode_settings_come_from_the_parameters():
    settings = decoding.decode_settings(_args(**DECODE_PARAMETERS))
    assert settings["begin_id"] == 2 and settings["max_decode_length"] == 10 and settings["max_hidden_magnitude"] == 1e4
    assert decoding.token_ids(settings) == {"begin_id": 2, "end_id": 3, "max_length": 10}
    with pytest.raises(ValueError, match="max_decode_length must be between 1 and 64, got 65"):
        decoding.decode_settings(_args(**{**DECODE_PARAMETERS, "max_decode_length": "65"}))
    with pytest.raises(ValueError, match="parameter begin_id is missing"):
        decoding.decode_settings(_args(**{k: v for k, v in DECODE_PARAMETERS.items() if k != "begin_id"}))


# ------------------------------------------------------------------------------ sampling jobs
class _Encoded:
    def __init__(self, rows, length):
        self.residue_mask = np.ones((rows, length), dtype=bool)


def _job(method="greedy-perturbate", rows=2, length=5, **options):
    return sampling.Job(None, np.zeros((rows, 1), dtype=np.object_), _Encoded(rows, length),
                        {**SAMPLING_DEFAULTS, "seed": 1, **options, "sampling_method": method})


def test_a_jobs_decode_size_and_key_follow_its_method():
    assert _job(num_samples=3).decode_size == (6, 5) and _job(num_samples=3).copies == 3
    assert _job(num_samples=3).decode_key() == ("greedy", 1, 1)
    single = _job("beam-search-single-sample", num_samples=3)
    assert single.copies == 1 and single.decode_key() == ("beam", 3, 3) and single.decode_size == (6, 5)
    assert _job("beam-search-perturbate", num_samples=2, beam_size=4).decode_key() == ("beam", 4, 1)
    assert _job("beam-search-perturbate-sample", num_samples=2, beam_size=4).decode_key() == ("beam", 4, 4)
    assert _job("beam-search-perturbate-sample", num_samples=2, beam_size=4).decode_size == (16, 5)
    assert _job("topkp-perturbate").decode_key() is None


def test_jobs_are_planned_into_decodes_by_key_and_token_budget():
    jobs = {0: _job(), 1: _job("topkp-perturbate"), 2: _job(), 3: _job("beam-search-perturbate"), 4: _job()}
    plan = sampling.plan_decodes(jobs, 4096)
    assert plan == [(("greedy", 1, 1), [0, 2, 4]), (("alone", 1), [1]), (("beam", 5, 1), [3])]
    # 2 rows x 5 tokens each: 20 tokens hold two greedy jobs
    assert sampling.plan_decodes({0: _job(), 2: _job(), 4: _job()}, 20) == [
        (("greedy", 1, 1), [0, 2]), (("greedy", 1, 1), [4])]


def test_a_too_large_job_names_its_radius_and_sequences():
    error = _job(num_samples=2, scaled_radius=1e30).too_large([1, 2, 3], "not finite")
    assert str(error) == ("input 'scaled_radius' row 0 = 1e+30 makes the perturbed hidden states of "
                          "sequence(s) [0, 1] too large to decode: not finite")


# ------------------------------------------------------------------------------ models end to end
TOKENIZER = SmilesTokenizer(SPECIAL_TOKENS + ("C", "O", "N", "c", "1", "(", ")", "="), max_length=32)
C_ID = TOKENIZER.vocab.index("C")


class StandInGraphs(decoding.CancellableDecoder):
    """Decoder graphs that produce 'C' twice, then the end token, whatever the hidden states."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def run_graph(self, graph, inputs, outputs):
        self.calls += 1
        if graph == "cross_kv":
            hiddens = inputs["hiddens"][None, :, None]  # [layers, batch, heads, S, H]
            return [hiddens, hiddens] if tuple(outputs) == CROSS_KV_OUTPUTS else None
        past = inputs["past_k"]
        rows = inputs["tokens"].shape[0]
        logits = np.zeros((rows, len(TOKENIZER.vocab)), dtype=np.float32)
        logits[:, C_ID if past.shape[3] < 2 else 3] = 10.0
        present = np.concatenate([past, np.zeros(past.shape[:3] + (1,) + past.shape[4:], np.float32)], axis=3)
        return [logits, present, present]


def _settings():
    return decoding.decode_settings(_args(**DECODE_PARAMETERS))


def _encoder(pb):
    def encode(inputs, outputs):
        encoded = TOKENIZER.encode(inputs["sequences"][:, 0].tolist())
        hiddens = np.where(encoded.residue_mask[..., None], 1.0, 0.0).astype(np.float32) * np.ones(4, np.float32)
        return pb.InferenceResponse([pb.Tensor("hiddens", hiddens)])
    pb.BLS_MODELS["mmb_encoder"] = encode


def _samplings(pb):
    _encoder(pb)
    return sampling.Samplings(TOKENIZER, StandInGraphs(), _settings(),
                              responses.Responder("mmb_samplings", (GenerationError,)),
                              encoder_model="mmb_encoder", encoder_tokenizes=True)


def _sequences(*smiles):
    return np.array([[s.encode()] for s in smiles], dtype=np.object_)


def test_samplings_answers_each_request_and_fails_bad_ones_alone(pb):
    model = _samplings(pb)
    requests = [
        pb.request({"sequences": _sequences("CCO", "c1ccccc1"), "num_samples": _column(3, np.int32)}),
        pb.request({"sequences": _sequences("CC"), "scaled_radius": _column(np.nan, np.float32, rows=1)}),
        pb.request({"sequences": _sequences("CN"), "sampling_method": _column(b"beam-search-perturbate", np.object_,
                                                                              rows=1)}),
        pb.request({"sequences": _sequences("CC")}, cancelled=True),
        pb.request({"sequences": _sequences("CXC")}),
    ]
    answers = model.responder.answer_all(requests, model.execute)
    assert answers[0].output("generated").tolist() == [[b"CC"] * 3] * 2
    assert (answers[1].error().code(), answers[1].error().message()) == (
        pb.TritonError.INVALID_ARG, "mmb_samplings: input 'scaled_radius' row 0 must be finite, got nan")
    assert answers[2].output("generated").tolist() == [[b"CC"]]
    assert answers[3].error().code() == pb.TritonError.CANCELLED
    assert answers[4].error().code() == pb.TritonError.INTERNAL  # TokenizationError is not this responder's


def test_decodes_checks_each_request_then_decodes_the_rest_together(pb):
    graphs = StandInGraphs()
    responder = responses.Responder("mmb_decodes", (GenerationError,))
    model = decoding.GreedyDecodes(TOKENIZER, graphs, _settings(), responder)
    good = np.ones((2, 3, 4), dtype=np.float32)
    bad = good.copy()
    bad[1, 0, 0] = np.inf
    requests = [pb.request({"hiddens": good, "mask": np.ones((2, 3), bool)}),
                pb.request({"hiddens": bad, "mask": np.ones((2, 3), bool)}),
                pb.request({"hiddens": np.ones((1, 33, 4), np.float32), "mask": np.ones((1, 33), bool)}),
                pb.request({"hiddens": good[:1, :2], "mask": np.ones((1, 2), bool)})]
    answers = model.responder.answer_all(requests, model.execute)
    assert answers[0].output("sequences").tolist() == [[b"CC"], [b"CC"]]
    assert answers[3].output("sequences").tolist() == [[b"CC"]]
    assert answers[1].error().code() == pb.TritonError.INVALID_ARG
    assert "batch row(s) [1]" in answers[1].error().message()
    assert answers[2].error().message() == ("mmb_decodes: hiddens have length 33; the maximum is 32 "
                                            "(the encoder's longest output)")
    assert graphs.calls == 4  # one cross_kv and three steps for both good requests together
    assert graphs.requests == []


def test_a_decoder_stops_once_every_request_is_cancelled(pb):
    graphs = StandInGraphs()
    graphs.requests = [pb.request({}, cancelled=True), pb.request({}, cancelled=True)]
    with pytest.raises(responses.RequestError) as caught:
        graphs.run("cross_kv", {}, CROSS_KV_OUTPUTS)
    assert caught.value.code == pb.TritonError.CANCELLED and graphs.calls == 0
    graphs.requests[0].cancelled = False
    graphs.run("cross_kv", {"hiddens": np.ones((1, 2, 4), np.float32)}, CROSS_KV_OUTPUTS)
    assert graphs.calls == 1


def test_every_limit_is_a_decode_setting():
    assert set(LIMITS) <= set(_settings())


# ------------------------------------------------------------------------------ generated folders
IMPORT_MODEL = """
assert hasattr(module, "TritonPythonModel")
assert not [name for name in sys.modules if name.startswith("bionemo_export")], "imports the package"
"""


def _imports_from_its_folder(model_py) -> None:
    """model.py imports (not initialize) with only its own version folder and the fake pb_utils."""
    import subprocess
    import sys

    code = fake_pb_utils.standalone_import(model_py) + IMPORT_MODEL
    result = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=model_py.parent)
    assert result.returncode == 0, f"{model_py}: {result.stderr[-2000:]}"


@pytest.mark.parametrize("layout, backend", [("fused", "python"), ("ensemble", "python"), ("ensemble", "native")])
def test_every_generated_model_imports_from_its_own_folder(tmp_path, layout, backend):
    """Each Python model's version folder holds the serving modules it imports (copied verbatim)."""
    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.model_repository.seq2seq import plan_seq2seq_repository
    from bionemo_export.models import get_family
    from bionemo_export.models.base import seq2seq_graph_specs

    family = get_family("megamolbart")
    loaded = family.load(save_random_checkpoint(family.name, tmp_path / "ckpt", seed=0))
    files = {}
    for graph in ("encoder", "cross_kv", "decoder_step"):
        (tmp_path / graph).mkdir()
        (tmp_path / graph / "model.onnx").write_bytes(b"not really onnx")
        files[graph] = {"model.onnx": tmp_path / graph / "model.onnx"}
    assert loaded.seq2seq is not None  # megamolbart loads with its decoder graphs
    plan = plan_seq2seq_repository(
        "mmb", family="megamolbart", hidden_size=loaded.hidden_size, tokenizer=loaded.tokenizer,
        seq2seq=loaded.seq2seq, graph_specs=seq2seq_graph_specs(loaded.seq2seq, loaded.hidden_size),
        onnx_files=files, options=ServingOptions(layout=layout, backend=backend))
    plan.write(tmp_path / "repo")
    generated = sorted((tmp_path / "repo").glob("*/1/model.py"))
    assert generated
    for model_py in generated:
        _imports_from_its_folder(model_py)


@pytest.mark.parametrize("name", ["", "EncoderModel", "os.system", "..models.EncoderModel", "tokenizers.character.x",
                                  "models.Nope", "responses.Responder", "models.ServedModel.__init__", "nosuch.Model"])
def test_served_model_names_only_a_served_model_class_of_the_package(name):
    """config parameter served_model comes with the repository: anything but "module.Class" of a
    ServedModel in the served package fails the load naming config.pbtxt, importing nothing else."""
    from bionemo_export.serving.models import served_class

    with pytest.raises(ValueError, match=r"mmb_decodes/config.pbtxt: parameter served_model is .* not a served model"):
        served_class(_args(), name)


def test_served_model_finds_the_class_it_names():
    from bionemo_export.serving.models import EncoderModel, served_class

    assert served_class(_args(), "models.EncoderModel") is EncoderModel
