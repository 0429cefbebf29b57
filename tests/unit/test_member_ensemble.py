"""Checkpoint ensembles without a server: which members are refused and how the message names them
(models/members.py, facts only; and a build that refuses a member before exporting anything), the
mean of the members' log-probabilities (serving/member_mean.py) through the fake
`triton_python_backend_utils`, and N_scores' per-member scores (serving/scores.py) with its BLS
calls answered by two tiny random ESM-2 members' PyTorch, against brute-force ESM formula
references in transformers' own `EsmForMaskedLM`, one member at a time, averaged here."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.models import get_family
from bionemo_export.models.members import MemberFacts, MemberMismatch, check_members
from bionemo_export.serving.member_mean import MemberMean, mean_log_probs
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.scores import VariantScorer
from bionemo_export.serving.scoring import ScoringLimits
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils
from tests.helpers.masked_lm_reference import brute_force, brute_force_pll

VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWC", "<mask>"]
FIRST = MemberFacts(path=Path("/ckpt/esm1v_1.pt"), family="esm1", alphabet=tuple("LAGVSERTIDPKQNFYMHWC"),
                    tokenizer={"vocab": VOCAB, "max_length": 1024, "mask_char": "_"}, hidden_size=1280)


def _refused(*members: MemberFacts) -> str:
    with pytest.raises(MemberMismatch) as caught:
        check_members(members)
    return str(caught.value)


@pytest.mark.parametrize("change, words", [
    (dict(family="esm2"), "it is a esm2 checkpoint, the first is esm1"),
    (dict(lm_head=False), "it has no masked-LM head"),
    (dict(alphabet=tuple("ALGVSERTIDPKQNFYMHWC")), "its alphabet (log_probs' columns) differs: entry 0 is 'A', "
                                                   "not 'L'"),
    (dict(tokenizer={"vocab": VOCAB, "max_length": 512, "mask_char": "_"}),
     "its tokenizer's max_length is 512, the first's is 1024"),
    (dict(tokenizer={"vocab": [*VOCAB, "<extra>"], "max_length": 1024, "mask_char": "_"}),
     "its tokenizer's vocabulary differs: 26 entries, not 25"),
    (dict(tokenizer={"vocab": VOCAB, "max_length": 1024}), "its tokenizer's mask_char is None, the first's is '_'"),
])
def test_a_member_that_differs_is_refused_naming_it_and_how(change, words):
    other = replace(FIRST, path=Path("/ckpt/other"), **change)
    message = _refused(FIRST, replace(FIRST, path=Path("/ckpt/esm1v_2.pt")), other)
    assert message.startswith("ensemble member 3 (/ckpt/other) cannot be served with member 1 (/ckpt/esm1v_1.pt)")
    assert words in message, message
    assert "build this checkpoint on its own" in message


def test_members_of_one_kind_pass_even_of_different_hidden_sizes():
    check_members([FIRST, replace(FIRST, path=Path("/ckpt/esm1v_2.pt"), hidden_size=640)])


def test_one_member_or_one_checkpoint_twice_is_refused():
    assert "at least two checkpoints, got 1" in _refused(FIRST)
    assert "member 2 (/ckpt/esm1v_1.pt) is member 1 again" in _refused(FIRST, FIRST)


def test_the_mean_is_position_by_position_and_the_members_come_back_as_they_were():
    generator = np.random.default_rng(0)
    members = [generator.normal(size=(2, 5, 4)).astype(np.float32) for _ in range(3)]
    mean, stacked = mean_log_probs(members)
    assert mean.dtype == np.float32 and mean.shape == (2, 5, 4) and stacked.shape == (2, 3, 5, 4)
    np.testing.assert_allclose(mean, (members[0] + members[1] + members[2]) / 3, atol=1e-6)
    for k in range(3):
        assert np.array_equal(stacked[:, k], members[k])
    with pytest.raises(ValueError, match=r"different shapes \[\(2, 5, 4\), \(2, 6, 4\)\]"):
        mean_log_probs([members[0], np.zeros((2, 6, 4), np.float32)])


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def test_the_mean_model_answers_the_outputs_asked_for_and_a_bad_request_alone(pb_utils):
    model = MemberMean(2, Responder("t_member_mean"))
    a, b = np.full((1, 3, 2), -1.0, np.float32), np.full((1, 3, 2), -3.0, np.float32)
    good = fake_pb_utils.request({"log_probs_1": a, "log_probs_2": b}, requested=["log_probs"])
    bad = fake_pb_utils.request({"log_probs_1": a})
    responses, _ = model.execute([good, bad])
    assert np.array_equal(responses[0].output("log_probs"), np.full((1, 3, 2), -2.0, np.float32))
    assert fake_pb_utils.get_output_tensor_by_name(responses[0], "member_log_probs") is None  # not asked for
    assert responses[1].has_error() and "input 'log_probs_2' must have shape" in responses[1].error().message()
    every = model.execute([fake_pb_utils.request({"log_probs_1": a, "log_probs_2": b})])[0][0]
    assert every.output("member_log_probs").shape == (1, 2, 3, 2)  # a request naming no outputs gets all


# ------------------------------------------------------------------------- N_scores of an ensemble
WILD_TYPE = "MKTAYIAKQRQISFVK"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "Q11E:I12L"]


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    """Two tiny random ESM-2 members (different seeds and widths): the package's loaded models (what
    the served graphs compute) and transformers' EsmForMaskedLM of the same files (the reference)."""
    folder = tmp_path_factory.mktemp("members")
    paths = [save_random_checkpoint("esm2", folder / "a", seed=31),
             save_random_checkpoint("esm2", folder / "b", seed=32, hidden_size=48, num_heads=4)]
    return ([get_family("esm2").load(path) for path in paths],
            [transformers.EsmForMaskedLM.from_pretrained(path).eval() for path in paths])


def _log_probs(loaded, sequences: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = loaded.tokenizer.encode(sequences)
    with torch.inference_mode():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in (encoded.input_ids, encoded.attention_mask,
                                                                     encoded.residue_mask)))
        return loaded.lm_head(hiddens).numpy(), encoded.residue_mask


def _ensemble_scorer(loaded_members) -> VariantScorer:
    """N_scores over N_logits as an ensemble repository computes it: each member's encoder and head,
    then N_member_mean's mean."""
    def run_members(sequences: list[str]):
        answers = [_log_probs(loaded, sequences) for loaded in loaded_members]
        mean, stacked = mean_log_probs([log_probs for log_probs, _ in answers])
        return mean, answers[0][1], stacked

    def run_logits(sequences: list[str]):
        mean, mask, _ = run_members(sequences)
        return mean, mask

    return VariantScorer(run_logits, alphabet=loaded_members[0].alphabet, mask_char="_", limits=ScoringLimits(),
                         chunk=3, responder=Responder("t_scores"), run_members=run_members, members=2)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal", "pll"])
def test_scores_of_the_mean_are_the_mean_of_each_members_scores(pb_utils, members, method):
    loaded_members, references = members
    inputs = {"sequences": np.array([[WILD_TYPE.encode()]], dtype=np.object_),
              "method": np.array([[method.encode()]], dtype=np.object_)}
    if method == "pll":
        each = np.array([[brute_force_pll(reference, WILD_TYPE, loaded_members[0].alphabet)]
                         for reference in references])
    else:
        inputs["variants"] = np.array([[v.encode() for v in VARIANTS]], dtype=np.object_)
        each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, method) for reference in references])
    response = _ensemble_scorer(loaded_members).execute(
        [fake_pb_utils.request(inputs, requested=["scores", "member_scores"])])[0][0]
    assert not response.has_error(), response.error()
    np.testing.assert_allclose(response.output("member_scores")[0], each, atol=1e-4)
    np.testing.assert_allclose(response.output("scores")[0], each.mean(axis=0), atol=1e-4)
    assert abs(each[0] - each[1]).max() > 1e-3  # the members disagree: the mean is not either one's


def test_member_scores_are_computed_only_when_asked_for(pb_utils, members):
    loaded_members, _ = members
    scorer = _ensemble_scorer(loaded_members)
    asked_members = []
    run_members = scorer.run_members
    assert run_members is not None

    def counting(sequences):
        asked_members.append(len(sequences))
        return run_members(sequences)

    scorer.run_members = counting
    inputs = {"sequences": np.array([[WILD_TYPE.encode()]], dtype=np.object_),
              "variants": np.array([[b"M1A"]], dtype=np.object_)}
    response = scorer.execute([fake_pb_utils.request(inputs, requested=["scores"])])[0][0]
    assert fake_pb_utils.get_output_tensor_by_name(response, "member_scores") is None and asked_members == []
    single = VariantScorer(scorer.run_logits, alphabet=loaded_members[0].alphabet, mask_char="_",
                           limits=ScoringLimits(), chunk=3, responder=Responder("t_scores"))
    plain = single.execute([fake_pb_utils.request(inputs, requested=["scores", "member_scores"])])[0][0]
    # one checkpoint's N_scores has no such output
    assert fake_pb_utils.get_output_tensor_by_name(plain, "member_scores") is None
    np.testing.assert_allclose(plain.output("scores"), response.output("scores"))


# ------------------------------------------------------------------------- refused at build, before any export
def _build(tmp_path, first: Path, *members: Path, **settings):
    return build_repository(BuildRequest(checkpoint=first, members=members, name="ens", out=tmp_path / "repo",
                                         backend="python", optimize=False, **{"family": "esm2", **settings}))


def test_a_member_without_a_masked_lm_head_is_refused_naming_it_before_anything_is_written(tmp_path):
    first = save_random_checkpoint("esm2", tmp_path / "first", seed=1)
    second = save_random_checkpoint("esm2", tmp_path / "second", seed=2)
    plain = tmp_path / "plain"
    transformers.EsmModel.from_pretrained(second, add_pooling_layer=False).save_pretrained(plain)
    (plain / "vocab.txt").write_text((second / "vocab.txt").read_text())
    with pytest.raises(BuildError) as refused:
        _build(tmp_path, first, second, plain)
    assert str(refused.value).startswith(f"ensemble member 3 ({plain}) cannot be served with member 1 ({first}): "
                                         "it has no masked-LM head")
    assert sorted(tmp_path.iterdir()) == sorted([first, second, plain])  # no repository, no staging folder
    with pytest.raises(BuildError, match=r"`tasks` embeddings: an ensemble of 2 checkpoints serves logits and "
                                         r"scores only.*Build those tasks from one checkpoint"):
        _build(tmp_path, first, second, tasks=("embeddings", "logits"))
    with pytest.raises(BuildError, match=r"`checkpoint` .*first is given twice \(members 1 and 2\)"):
        _build(tmp_path, first, first)
    assert sorted(tmp_path.iterdir()) == sorted([first, second, plain])


def test_fair_esm_files_of_two_families_are_refused_naming_the_family(tmp_path):
    pytest.importorskip("esm")  # fair-esm writes the files as its hub does (tests/unit/test_fair_esm.py)
    from tests.unit.test_fair_esm import _esm1b_file, _esm2_file

    esm2, _ = _esm2_file(tmp_path, regression=False)
    esm1v, _ = _esm1b_file(tmp_path)
    with pytest.raises(BuildError, match=rf"ensemble member 2 \({esm1v}\) cannot be served with member 1 "
                                         rf"\({esm2}\): it is a esm1 checkpoint, the first is esm2"):
        _build(tmp_path, esm2, esm1v, family=None)  # each file says its family


def test_the_command_line_takes_several_checkpoints_for_inspect_and_build(tmp_path):
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    first = save_random_checkpoint("esm2", tmp_path / "first", seed=1)
    second = save_random_checkpoint("esm2", tmp_path / "second", seed=2)
    plain = tmp_path / "plain"
    transformers.EsmModel.from_pretrained(second, add_pooling_layer=False).save_pretrained(plain)
    (plain / "vocab.txt").write_text((second / "vocab.txt").read_text())
    runner = CliRunner()
    good = runner.invoke(app, ["inspect", str(first), str(second), "--model", "esm2"])
    assert good.exit_code == 0, good.output
    assert "== member 2 of 2" in good.output and "2 members: they can be served as one" in good.output
    assert f"--checkpoint {first} --checkpoint {second}" in good.output
    bad = runner.invoke(app, ["inspect", str(first), str(plain), "--model", "esm2", "--json"])
    assert bad.exit_code == 1
    report = json.loads(bad.output)
    assert not report["ok"] and len(report["members"]) == 2
    assert "ensemble member 2" in report["problems"][0] and "it has no masked-LM head" in report["problems"][0]
    refused = runner.invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(first), "--checkpoint",
                                  str(plain), "--name", "ens", "--out", str(tmp_path / "repo"), "--backend", "python"])
    assert refused.exit_code == 1 and "ensemble member 2" in " ".join(refused.output.split())
    assert not (tmp_path / "repo").exists()


def test_the_members_graph_models_share_the_cores_when_threads_are_automatic(members):
    from bionemo_export.model_repository.masked_lm import MaskedLMHead
    from bionemo_export.model_repository.member_ensemble import MemberGraphs, plan_member_ensemble
    from bionemo_export.model_repository.options import ServingOptions
    from bionemo_export.serving.host import threads_per_instance

    loaded_members, _ = members
    graphs = [MemberGraphs(f"m{n}", loaded.hidden_size, {"model.onnx": Path("unused.onnx")}, Path("unused.onnx"),
                           "ORT_ENABLE_ALL") for n, loaded in enumerate(loaded_members, 1)]
    models = plan_member_ensemble("ens", family="esm2", tokenizer=loaded_members[0].tokenizer, members=graphs,
                                  head=MaskedLMHead(Path("unused.onnx"), loaded_members[0].alphabet, "_"),
                                  tasks=("logits", "scores"), options=ServingOptions(backend="python"))
    sharing = {model.name: model.parameters.get("models_sharing_cores") for model in models}
    assert sharing == {"ens_m1_encoder": "2", "ens_m1_lm_head": "2", "ens_m2_encoder": "2", "ens_m2_lm_head": "2",
                       "ens_member_mean": None, "ens_logits": None, "ens_scores": None}
    # what serving/onnx_session.py then asks of host.py: 16 cores, 5 members of one instance each
    assert threads_per_instance("auto", 1 * 5, cores=16) == 6 and threads_per_instance("auto", 1, cores=16) == 16


# ------------------------------------------------------------------------- the dev server's ensemble (PyTorch)
def _strings(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def test_the_dev_server_serves_an_ensembles_mean_and_each_members_answers(members):
    """DevModels over two members answers N_logits and N_scores only: the mean of the members'
    log-probabilities and scores, and each member's, against transformers' EsmForMaskedLM of each
    member alone (the members' own single-checkpoint answers)."""
    from bionemo_export.dev_server import DevModels
    from tests.helpers.masked_lm_reference import reference_log_probs

    loaded_members, references = members
    models = DevModels(loaded_members[0], members=tuple(loaded_members))
    assert models.tasks == ("logits", "scores")
    alphabet = loaded_members[0].alphabet
    (answer,) = models.answer("logits", [{"sequences": _strings("MKTAYIAKQR", "GV_E")}])
    assert set(answer) == {"log_probs", "mask", "member_log_probs"}
    assert answer["member_log_probs"].shape == (2, 2, 12, len(alphabet))
    for k, reference in enumerate(references):
        expected = reference_log_probs(reference, "MKTAYIAKQR", alphabet)
        np.testing.assert_allclose(answer["member_log_probs"][0, k], expected, atol=1e-4)
    each = [reference_log_probs(reference, "GV_E", alphabet) for reference in references]
    np.testing.assert_allclose(answer["log_probs"][1, :6], np.mean(each, axis=0), atol=1e-4)

    request = {"sequences": _strings(WILD_TYPE), "variants": np.array([[v.encode() for v in VARIANTS]], np.object_),
               "method": _strings("masked-marginal")}
    (scored,) = models.answer("scores", [request])
    expected = np.array([brute_force(reference, WILD_TYPE, VARIANTS, "masked-marginal") for reference in references])
    assert scored["member_scores"].shape == (1, 2, len(VARIANTS))
    np.testing.assert_allclose(scored["member_scores"][0], expected, atol=1e-4)
    np.testing.assert_allclose(scored["scores"][0], expected.mean(axis=0), atol=1e-4)
    (pll,) = models.answer("scores", [{"sequences": _strings(WILD_TYPE)}])
    expected = [brute_force_pll(reference, WILD_TYPE, alphabet) for reference in references]
    np.testing.assert_allclose(pll["member_scores"][0, :, 0], expected, atol=1e-4)

    one = DevModels(loaded_members[1])  # a member alone: its own answers, no member outputs
    (alone,) = one.answer("scores", [request])
    assert set(alone) == {"scores"}
    np.testing.assert_allclose(alone["scores"][0], scored["member_scores"][0, 1], atol=1e-5)


def test_the_dev_servers_ensemble_binds_the_repositorys_tensors(members):
    """The dev server's N_logits and N_scores of an ensemble have the tensors the ensemble planner
    writes into config.pbtxt (the task table's member_outputs sized alike)."""
    from bionemo_export.dev_server import DevModels
    from bionemo_export.model_repository.masked_lm import MaskedLMHead
    from bionemo_export.model_repository.member_ensemble import MemberGraphs, plan_member_ensemble
    from bionemo_export.model_repository.options import ServingOptions

    loaded_members, _ = members
    graphs = [MemberGraphs(f"m{n}", loaded.hidden_size, {"model.onnx": Path("unused.onnx")}, Path("unused.onnx"),
                           "ORT_ENABLE_ALL") for n, loaded in enumerate(loaded_members, 1)]
    planned = {model.name: model for model in plan_member_ensemble(
        "ens", family="esm2", tokenizer=loaded_members[0].tokenizer, members=graphs,
        head=MaskedLMHead(Path("unused.onnx"), loaded_members[0].alphabet, "_"), tasks=("logits", "scores"),
        options=ServingOptions(backend="python"))}
    bindings = DevModels(loaded_members[0], members=tuple(loaded_members)).bindings("ens")
    assert [binding.name for binding in bindings] == ["ens_logits", "ens_scores"]
    for binding in bindings:
        plan = planned[binding.name]
        assert sorted((n, s) for n, _, s in binding.outputs) == sorted((t.name, t.dims) for t in plan.outputs)
        assert sorted((n, s, o) for n, _, s, o in binding.inputs) == sorted((t.name, t.dims, t.optional)
                                                                             for t in plan.inputs)
    assert ("member_scores", np.float32, (2, -1)) in bindings[1].outputs


def test_the_dev_server_refuses_members_that_differ_naming_them(members, tmp_path):
    from bionemo_export.dev_server import DevModels, load_models

    loaded_members, _ = members
    first = save_random_checkpoint("esm2", tmp_path / "first", seed=1)
    plain = tmp_path / "plain"
    transformers.EsmModel.from_pretrained(first, add_pooling_layer=False).save_pretrained(plain)
    (plain / "vocab.txt").write_text((first / "vocab.txt").read_text())
    said: list[str] = []
    with pytest.raises(MemberMismatch, match=rf"ensemble member 2 \({plain}\) cannot be served with member 1 .*it "
                                             "has no masked-LM head"):
        load_models([first, plain], "esm2", progress=said.append)
    assert said == [f"loading {first} (ensemble member 1 of 2) ...", f"loading {plain} (ensemble member 2 of 2) ..."]
    with pytest.raises(MemberMismatch, match=rf"ensemble member 1 \({plain}\) has no masked-LM head"):
        load_models([plain, first], "esm2")
    with pytest.raises(MemberMismatch, match=rf"member 2 \({first}\) is member 1 again"):
        load_models([first, first], "esm2")
    with pytest.raises(ValueError, match="`members` starts with `loaded`"):
        DevModels(loaded_members[0], members=(loaded_members[1], loaded_members[0]))
    assert load_models([first], "esm2").members == ()  # one checkpoint: no ensemble
