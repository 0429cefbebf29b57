"""A checkpoint ensemble served by a real tritonserver: three tiny random ESM-2 members (different
seeds, one of another width), built once as one repository with the Python backend.

References are independent of the package: transformers' own `EsmForMaskedLM` on each member's
files, one member at a time (tests/helpers/masked_lm_reference.py), averaged here. Averaging the
members' log-probabilities and scoring the average must equal averaging each member's scores, ESM's
convention for ESM-1v's five seeds: checked for wt-marginal, masked-marginal and pll. The same
repository is tuned (the members' models set alike; first, before the module's server starts, so
that one tritonserver runs at a time), scored by `client score --member-scores`, and compared with
the dev server started with the three checkpoints.
"""

from __future__ import annotations

import csv
import sys
from dataclasses import replace

import numpy as np
import pytest
import transformers
import tritonclient.grpc as grpcclient
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import RepositoryClient
from bionemo_export.errors import InvalidInputError
from bionemo_export.runtime import TritonServer
from bionemo_export.runtime.server import free_ports
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository
from tests.helpers.masked_lm_reference import brute_force, brute_force_pll, reference_log_probs

NAME = "ens"
WILD_TYPE = "MKTAYIAKQRQISFVKSHF"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "A4A", "F19E:H18K"]
SEEDS = [0, 41, 42]
SIZES = [{}, {}, {"hidden_size": 48, "num_heads": 4}]
"""Members' sizes: hidden sizes may differ (no member's hidden states meet another's)."""


def _column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(work folder, the members' checkpoints, the build's result): the module's one export."""
    work = tmp_path_factory.mktemp("ensemble")
    # member 1 is the run's seed-0 ESM-2 (its graphs are exported once for the run), the others new
    checkpoints = [save_random_checkpoint("esm2", work / f"member{n}", seed=seed, **sizes)
                   for n, (seed, sizes) in enumerate(zip(SEEDS, SIZES), 1)]
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoints[0], members=tuple(checkpoints[1:]),
                                           name=NAME, out=work / "repo", backend="python", optimize=False))
    return work, checkpoints, result


@pytest.fixture(scope="module")
def served(built, triton_install):
    work, checkpoints, result = built
    references = [transformers.EsmForMaskedLM.from_pretrained(path).eval() for path in checkpoints]
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with RepositoryClient(NAME, url) as client:
            yield result, checkpoints, references, client, url


def test_tune_sets_the_members_models_alike(built, tmp_path):
    """`tune` on an ensemble: each role's member models are one unit (N_m*_encoder), a candidate
    is served to every member at once, and the user's repository is not touched. Runs before any
    test that starts the module's server: tune serves its own working copy."""
    from bionemo_export.bench.inputs import InputSpec
    from bionemo_export.model_repository.pbtxt import read_config
    from bionemo_export.tune import tuned_units
    from bionemo_export.tune.session import TuneSession
    from bionemo_export.tune.space import read_settings

    _, _, result = built
    repository = result.repository
    encoders, heads = f"{NAME}_m*_encoder", f"{NAME}_m*_lm_head"
    units = tuned_units(repository, f"{NAME}_logits")
    assert units == {encoders: tuple(f"{NAME}_m{n}_encoder" for n in (1, 2, 3)),
                     heads: tuple(f"{NAME}_m{n}_lm_head" for n in (1, 2, 3))}
    assert tuned_units(repository, f"{NAME}_scores") == units  # N_scores reaches them through N_logits
    built_settings = read_settings(read_config(repository / f"{NAME}_m1_encoder"))
    with TuneSession(repository, f"{NAME}_logits", out_dir=tmp_path / "tuning", window_s=0.5, max_trials=3,
                     inputs=InputSpec(lengths="uniform:10-30")) as session:
        baseline = session.baseline
        assert set(baseline) == set(units) and session.shares == {encoders: 3, heads: 3}
        candidate = {**baseline, encoders: replace(baseline[encoders], instances=2, threads=1)}
        point = session.measure(candidate, 2)
        assert point.throughput > 0
        assert session.live is not None
        for name in units[encoders]:  # every member serves the candidate
            config = session.live.client.model_config(name)
            assert int(config["instance_group"][0]["count"]) == 2, name
            assert config["parameters"]["intra_op_threads"]["string_value"] == "1", name
        assert int(session.live.client.model_config(f"{NAME}_m2_lm_head")["instance_group"][0]["count"]) == 1
        assert set(session.changed_configs(candidate, baseline)) == set(units[encoders])
    assert read_settings(read_config(repository / f"{NAME}_m3_encoder")) == built_settings


def test_an_ensemble_build_serves_logits_and_scores_from_each_members_graphs(served):
    result, checkpoints, _, _, _ = served
    assert set(result.models) == {f"{NAME}_m{n}_{role}" for n in (1, 2, 3) for role in ("encoder", "lm_head")} | {
        f"{NAME}_member_mean", f"{NAME}_logits", f"{NAME}_scores"}
    manifest = result.manifest
    members = manifest.members or []
    assert manifest.public_models == [f"{NAME}_logits", f"{NAME}_scores"]
    assert [m["member"] for m in members] == ["m1", "m2", "m3"]
    assert [m["path"] for m in members] == [str(path.resolve()) for path in checkpoints]
    assert len({m["digest"] for m in members}) == 3 and manifest.checkpoint == members[0]
    assert [m["hidden"] for m in members] == [32, 32, 48]
    assert set(manifest.verification["graphs"]) == {f"m{n}_{g}" for n in (1, 2, 3) for g in ("encoder", "lm_head")}


def test_served_log_probs_are_the_mean_of_each_members_transformers_log_probs(served):
    _, _, references, client, _ = served
    sequences = ["MKTAYIAKQR", "GV_E", "_SLKRKNIALIPAAGIGVRFG_"]
    log_probs, mask = client.seqs_to_log_probs(sequences)
    assert log_probs.shape == (3, 24, 25) and mask.shape == (3, 24)
    for row, sequence in enumerate(sequences):
        each = [reference_log_probs(reference, sequence, client.alphabet()) for reference in references]
        np.testing.assert_allclose(log_probs[row, :len(sequence) + 2], np.mean(each, axis=0), atol=1e-4)
        assert np.abs(each[0] - each[1]).max() > 1e-2  # the members disagree: the mean is not one of them


def test_each_members_log_probs_come_back_when_asked_for(served):
    _, _, references, client, _ = served
    asked = client.client.infer(f"{NAME}_logits", {"sequences": _column("MKTAYIAKQR", "GVSE")}, ["member_log_probs"])
    assert set(asked) == {"member_log_probs"}
    each = asked["member_log_probs"]
    assert each.dtype == np.float32 and each.shape == (2, 3, 12, 25)
    for k, reference in enumerate(references):
        np.testing.assert_allclose(each[0, k], reference_log_probs(reference, "MKTAYIAKQR", client.alphabet()),
                                   atol=1e-4)
        np.testing.assert_allclose(each[1, k, :6], reference_log_probs(reference, "GVSE", client.alphabet()),
                                   atol=1e-4)
    plain = client.client.infer(f"{NAME}_logits", {"sequences": _column("GVSE")}, ["log_probs", "mask"])
    assert set(plain) == {"log_probs", "mask"}
    through_client, mask = client.member_log_probs(["MKTAYIAKQR", "GVSE"])  # the Python client's call
    assert np.array_equal(through_client, each) and mask.shape == (2, 12)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_served_scores_are_the_mean_of_each_members_scores(served, method):
    _, _, references, client, _ = served
    each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, method) for reference in references])
    np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS, method), each.mean(axis=0), atol=1e-4)
    asked = client.client.infer(f"{NAME}_scores", {
        "sequences": _column(WILD_TYPE), "variants": np.array([[v.encode() for v in VARIANTS]], dtype=np.object_),
        "method": _column(method)}, ["scores", "member_scores"])
    assert asked["member_scores"].shape == (1, 3, len(VARIANTS))
    np.testing.assert_allclose(asked["member_scores"][0], each, atol=1e-4)
    np.testing.assert_allclose(asked["scores"][0], each.mean(axis=0), atol=1e-4)
    np.testing.assert_allclose(client.member_scores(WILD_TYPE, VARIANTS, method), each, atol=1e-4)


def test_served_plls_are_the_mean_of_each_members_plls(served):
    _, _, references, client, _ = served
    sequences = ["MKTAYIAKQR", "GVSE"]
    each = np.array([[brute_force_pll(reference, s, client.alphabet()) for s in sequences]
                     for reference in references])
    np.testing.assert_allclose(client.pseudo_log_likelihood(sequences), each.mean(axis=0), atol=1e-4)
    asked = client.client.infer(f"{NAME}_scores", {"sequences": _column(*sequences)}, ["member_scores"])
    np.testing.assert_allclose(asked["member_scores"][:, :, 0], each.T, atol=1e-4)


def test_verify_checks_the_ensemble_against_its_members_and_wants_every_member(served):
    result, checkpoints, _, _, url = served
    checks = verify_repository(result.repository, checkpoints, url=url)
    assert checks and all(check.passed for check in checks), [c for c in checks if not c.passed]
    assert sum("member_log_probs of member" in check.note for check in checks) == 3
    with pytest.raises(InvalidInputError, match="was built from 3 checkpoints .*got 2: give `checkpoint` once per "
                                                "member"):
        verify_repository(result.repository, checkpoints[:2], url=url)
    swapped = verify_repository(result.repository, [checkpoints[1], checkpoints[0], checkpoints[2]], url=url)
    assert not all(check.passed for check in swapped)  # member 1's answers are not member 2's


def _score_table(url: str, folder, fasta, table, *extra: str):
    """`client score --member-scores` of `table` against the server at `url`: the CSV's rows (dicts)."""
    out = folder / f"scored-{len(list(folder.glob('scored-*')))}.csv"
    result = CliRunner().invoke(app, ["client", "score", "-m", f"{NAME}_scores", "--fasta", str(fasta), "--variants",
                                      str(table), "--member-scores", "--output", str(out),
                                      "--triton-url", url, *extra])
    assert result.exit_code == 0, result.output
    # rich wraps the console at its width, anywhere in the path: compared without whitespace
    assert f"and each of its 3 members' to {out}".replace(" ", "") in "".join(result.output.split())
    with out.open(newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _variant_files(tmp_path):
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n")
    with (tmp_path / "dms.csv").open("w", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["mutant", "DMS_score"], *[[v, str(i)] for i, v in enumerate(VARIANTS)]])
    return tmp_path / "wt.fasta", tmp_path / "dms.csv"


def test_client_score_writes_each_members_score_beside_the_mean(served, tmp_path):
    """`client score --member-scores`: columns score, score_member1..3, each member's equal to that
    member's own scores (transformers, the member alone), the mean column to their mean."""
    _, _, references, client, url = served
    assert client.members() == 3 and client.members("logits") == 3
    fasta, table = _variant_files(tmp_path)
    rows = _score_table(url, tmp_path, fasta, table, "--method", "masked-marginal", "--chunk-size", "2",
                        "--score-column", "score")
    assert list(rows[0]) == ["mutant", "DMS_score", "score", "score_member1", "score_member2", "score_member3"]
    assert [row["mutant"] for row in rows] == VARIANTS
    each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, "masked-marginal") for reference in references])
    for k in range(3):
        np.testing.assert_allclose([float(row[f"score_member{k + 1}"]) for row in rows], each[k], atol=1e-4)
    np.testing.assert_allclose([float(row["score"]) for row in rows], each.mean(axis=0), atol=1e-4)


def test_the_dev_server_serves_the_ensemble_as_the_repository_does(served, tmp_path):
    """`dev-server --checkpoint` once per member (PyTriton, PyTorch): the repository's N_logits and
    N_scores with the same tensors, and the same answers within 1e-4, the members' included."""
    from tests.e2e.test_dev_server import start_dev_server, stop_dev_server

    _, checkpoints, references, repository, url = served
    http, grpc, metrics = free_ports(3)
    models = [f"{NAME}_logits", f"{NAME}_scores"]
    command = [sys.executable, "-m", "bionemo_export.cli.main", "dev-server", "--model", "esm2", "--name", NAME,
               "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    dev = start_dev_server(command + [a for path in checkpoints for a in ("--checkpoint", str(path))],
                           tmp_path / "dev_server.log", grpc, models)
    try:
        for model in models:
            answers = [grpcclient.InferenceServerClient(address).get_model_metadata(model, as_json=True)
                       for address in (f"127.0.0.1:{grpc}", url.removeprefix("grpc://"))]
            tensors = [{side: sorted((t["name"], t["datatype"], tuple(t["shape"])) for t in answer[side])
                        for side in ("inputs", "outputs")} for answer in answers if isinstance(answer, dict)]
            assert len(tensors) == 2 and tensors[0] == tensors[1], model
        with RepositoryClient(NAME, f"grpc://127.0.0.1:{grpc}") as dev_client:
            assert dev_client.members() == 3
            sequences = ["MKTAYIAKQR", "GV_E"]
            for ours, theirs in zip(dev_client.seqs_to_log_probs(sequences), repository.seqs_to_log_probs(sequences)):
                np.testing.assert_allclose(ours, theirs, atol=1e-4)
            for ours, theirs in zip(dev_client.member_log_probs(sequences), repository.member_log_probs(sequences)):
                np.testing.assert_allclose(ours, theirs, atol=1e-4)
            for method in ("wt-marginal", "masked-marginal"):
                ours = dev_client.scores_with_members(WILD_TYPE, VARIANTS, method)
                theirs = repository.scores_with_members(WILD_TYPE, VARIANTS, method)
                for a, b in zip(ours, theirs):
                    np.testing.assert_allclose(a, b, atol=1e-4)
            np.testing.assert_allclose(dev_client.pseudo_log_likelihood(sequences[:1]),
                                       repository.pseudo_log_likelihood(sequences[:1]), atol=1e-4)
        fasta, table = _variant_files(tmp_path)
        rows = [_score_table(target, tmp_path, fasta, table) for target in (f"grpc://127.0.0.1:{grpc}", url)]
        assert list(rows[0][0]) == list(rows[1][0])
        columns = ["wt-marginal_score", *(f"wt-marginal_score_member{k}" for k in (1, 2, 3))]
        for column in columns:
            np.testing.assert_allclose([float(r[column]) for r in rows[0]], [float(r[column]) for r in rows[1]],
                                       atol=1e-4)
        each = np.array([brute_force(reference, WILD_TYPE, VARIANTS, "wt-marginal") for reference in references])
        np.testing.assert_allclose([float(r[columns[1]]) for r in rows[0]], each[0], atol=1e-4)
    finally:
        stop_dev_server(dev)
