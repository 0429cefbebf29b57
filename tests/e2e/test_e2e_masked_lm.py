"""The masked-LM tasks served by a real tritonserver: N_logits and N_scores of a tiny random ESM-2
(`EsmForMaskedLM`, as `save_random_checkpoint` writes it), built once with the Python backend.

References are independent of the package: transformers' own `EsmForMaskedLM` on the same files,
masking one copy at a time (tests/helpers/masked_lm_reference.py).
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import transformers

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.models import get_family
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.masked_lm_reference import brute_force, brute_force_pll, reference_log_probs

NAME = "mlm"
WILD_TYPE = "MKTAYIAKQRQISFVKSHFSRQ"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "A4A", "Q22E:R21K:S20T", "I12L"]


@pytest.fixture(scope="module")
def served(tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("masked_lm")
    checkpoint = save_random_checkpoint("esm2", work / "checkpoint", seed=0)
    result = build_repository(BuildRequest(family="esm2", checkpoint=checkpoint, name=NAME, out=work / "repo",
                                           backend="python", optimize=False))
    reference = transformers.EsmForMaskedLM.from_pretrained(checkpoint).eval()
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        with RepositoryClient(NAME, f"grpc://{server.endpoints.grpc_url}") as client:
            yield result, reference, client


def test_a_masked_lm_checkpoint_builds_the_logits_and_scores_models(served):
    result, _, client = served
    assert {f"{NAME}_lm_head", f"{NAME}_logits", f"{NAME}_scores"} <= set(result.models)
    public = result.manifest.public_models
    assert public.index(f"{NAME}_logits") == public.index(f"{NAME}_hiddens") + 1  # the task table's order
    assert public.index(f"{NAME}_scores") == public.index(f"{NAME}_logits") + 1
    assert client.alphabet() == tuple("LAGVSERTIDPKQNFYMHWCXBUZO")


def test_served_log_probs_equal_transformers_esm_for_masked_lm(served):
    _, reference, client = served
    sequences = ["MKTAYIAKQR", "GV_E", "_SLKRKNIALIPAAGIGVRFG_"]
    log_probs, mask = client.seqs_to_log_probs(sequences)
    assert log_probs.dtype == np.float32 and log_probs.shape == (3, 24, 25)
    for row, sequence in enumerate(sequences):
        expected = reference_log_probs(reference, sequence, client.alphabet())
        np.testing.assert_allclose(log_probs[row, :len(sequence) + 2], expected, atol=1e-4)
        assert mask[row].tolist() == [False] + [True] * len(sequence) + [False] * (23 - len(sequence))


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_served_variant_scores_equal_the_brute_force_reference(served, method):
    _, reference, client = served
    scores = client.score_variants(WILD_TYPE, VARIANTS, method)
    np.testing.assert_allclose(scores, brute_force(reference, WILD_TYPE, VARIANTS, method), atol=1e-4)


def test_served_pll_equals_antibertys_definition(served):
    _, reference, client = served
    sequences = ["MKTAYIAKQR", "GVSE", WILD_TYPE]
    expected = [brute_force_pll(reference, s, client.alphabet()) for s in sequences]
    np.testing.assert_allclose(client.pseudo_log_likelihood(sequences), expected, atol=1e-4)


def test_bad_variants_are_invalid_argument_naming_the_variant_and_the_server_carries_on(served):
    _, _, client = served
    for variant, words in (("L1A", "position 1 is M in the wild type, not L"), ("M99A", "M99A"),
                           ("M1J", "M1J"), ("M1A:M1C", "M1A:M1C")):
        with pytest.raises(InferenceError, match="INVALID_ARGUMENT|" + words) as caught:
            client.score_variants(WILD_TYPE, [variant])
        assert words in str(caught.value)
    with pytest.raises(InferenceError, match="masked-marginal scores variants") as named:
        client.client.infer(f"{NAME}_scores", {"sequences": np.array([[b"MKT"]], dtype=np.object_),
                                               "method": np.array([[b"masked-marginal"]], dtype=np.object_)})
    assert str(named.value).count(f"{NAME}_scores:") == 1  # the server's own prefix, not the client's again
    assert client.score_variants(WILD_TYPE, ["M1A"]).shape == (1,)


def test_scores_rest_on_the_config_limits(served):
    result, _, _ = served
    config = (result.repository / f"{NAME}_scores" / "config.pbtxt").read_text()
    for limit in ("max_variants", "max_mutations_per_variant", "max_masked_copies"):
        assert f'key: "{limit}"' in config
    alphabet = (result.repository / f"{NAME}_logits" / "config.pbtxt").read_text()
    assert json.dumps(list("LAGVSERTIDPKQNFYMHWCXBUZO")).replace('"', '\\"') in alphabet


def test_logits_without_a_head_is_one_error_naming_the_checkpoint(tmp_path):
    family = get_family("esm2")
    masked = save_random_checkpoint(family.name, tmp_path / "masked", seed=2)
    plain = tmp_path / "plain"
    transformers.EsmModel.from_pretrained(masked, add_pooling_layer=False).save_pretrained(plain)
    (plain / "vocab.txt").write_text((masked / "vocab.txt").read_text())
    with pytest.raises(BuildError, match=r"plain has no masked-LM head .* cannot serve logits"):
        build_repository(BuildRequest(family="esm2", checkpoint=plain, name="p", out=tmp_path / "repo",
                                      backend="python", tasks=("embeddings", "logits"), optimize=False))


@pytest.mark.slow
def test_the_real_antibertys_served_plls_follow_its_runner(tmp_path, triton_install):
    """AntiBERTy (the real weights inside the antiberty wheel) served: its PLLs equal AntiBERTy's
    runner's definition computed in transformers' BertForMaskedLM on the same files ([CLS] residues
    [SEP], one residue masked at a time, the five special tokens' logits set to -inf, the mean
    log-probability of the true residue)."""
    import torch

    from bionemo_export.models.bert import antiberty_checkpoint

    checkpoint = antiberty_checkpoint()
    build_repository(BuildRequest(family="bert", checkpoint=checkpoint, name="ab", out=tmp_path / "repo",
                                  backend="python", tasks=("logits", "scores"), optimize=False))
    vocab = (checkpoint / "vocab.txt").read_text().splitlines() if (checkpoint / "vocab.txt").is_file() else \
        (checkpoint.parent / "vocab.txt").read_text().splitlines()
    reference = transformers.BertForMaskedLM.from_pretrained(checkpoint).eval()
    special = [vocab.index(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")]

    def pll(sequence: str) -> float:
        total = 0.0
        for i in range(len(sequence)):
            tokens = ["[CLS]", *("[MASK]" if j == i else c for j, c in enumerate(sequence)), "[SEP]"]
            ids = torch.tensor([[vocab.index(t) for t in tokens]])
            with torch.no_grad():
                logits = reference(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, 1 + i].clone()
            logits[special] = -float("inf")
            total += float(torch.log_softmax(logits, dim=-1)[vocab.index(sequence[i])])
        return total / len(sequence)

    antibodies = ["EVQLVESGGGLVQPGGSLRLSCAASGFNIKDTYIHWVRQAPGKGLEWVA", "DIQMTQSPSSLSASVGDRVTITC"]
    with TritonServer(tmp_path / "repo", install=triton_install, log_file=tmp_path / "server.log") as server:
        with RepositoryClient("ab", f"grpc://{server.endpoints.grpc_url}") as client:
            served = client.pseudo_log_likelihood(antibodies)
            assert sorted(client.alphabet()) == sorted("ACDEFGHIKLMNPQRSTVWY")  # the specials excluded
    np.testing.assert_allclose(served, [pll(s) for s in antibodies], atol=1e-4)


def test_the_dev_server_serves_logits_and_scores_as_the_repository_does(served, tmp_path):
    """BioNeMo's way (PyTriton, PyTorch): the same public models and tensors, the same answers
    within the family's tolerance, a bad variant refused with the same words (one parser:
    serving/scoring.py). The dev server is started as benchmarks/serving.py starts its baseline
    (benchmarks/dev_server.py, a wrapper of the package's dev server; test_dev_server.py starts
    `bionemo-export dev-server`)."""
    import tritonclient.grpc as grpcclient

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    try:  # a script folder, not a package: found on the path it is given here, not by the type checker
        serving = importlib.import_module("serving")
    finally:
        sys.path.pop(0)
    result, _, repository = served
    models = [f"{NAME}_{task}" for task in ("embeddings", "hiddens", "logits", "scores")]
    dev, url = serving.start_dev_server(Path(result.manifest.checkpoint["path"]), "esm2", NAME,
                                        tmp_path / "dev_server.log")
    grpc = url.removeprefix("grpc://")
    try:
        with RepositoryClient(NAME, url) as client:
            assert client.client.max_batch_size(f"{NAME}_embeddings") == 10  # BioNeMo's setting
            assert all(grpcclient.InferenceServerClient(grpc).is_model_ready(model) for model in models)
            for model in models[2:]:
                answers = [c.get_model_metadata(model, as_json=True) for c in (
                    grpcclient.InferenceServerClient(grpc), repository.client._client)]
                assert all(isinstance(answer, dict) for answer in answers), answers  # parsed JSON
                tensors = [{side: sorted((t["name"], t["datatype"], tuple(t["shape"])) for t in answer[side])
                            for side in ("inputs", "outputs")}
                           for answer in answers if isinstance(answer, dict)]
                assert tensors[0] == tensors[1], model
            sequences = ["MKTAYIAKQR", "GV_E"]
            for ours, theirs in zip(client.seqs_to_log_probs(sequences), repository.seqs_to_log_probs(sequences)):
                np.testing.assert_allclose(ours, theirs, atol=1e-4)
            np.testing.assert_allclose(client.score_variants(WILD_TYPE, VARIANTS, "masked-marginal"),
                                       repository.score_variants(WILD_TYPE, VARIANTS, "masked-marginal"), atol=1e-4)
            np.testing.assert_allclose(client.pseudo_log_likelihood(sequences[:1]),
                                       repository.pseudo_log_likelihood(sequences[:1]), atol=1e-4)
            with pytest.raises(InferenceError, match="position 1 is M in the wild type, not L"):
                client.score_variants(WILD_TYPE, ["L1A"])
    finally:
        serving.stop(dev)


def test_client_encode_of_the_logits_model_names_the_alphabet(served, tmp_path):
    """`client encode --model N_logits` writes log_probs and mask, and the alphabet that names
    log_probs' last axis (the config's parameter), in JSON as in .npz."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    _, _, client = served
    out = tmp_path / "log_probs.json"
    result = CliRunner().invoke(app, ["client", "encode", "--model", f"{NAME}_logits", "-s", "MKT_Y", "--triton-url",
                                      str(client.client.url), "--output", str(out)])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    assert document["alphabet"] == list("LAGVSERTIDPKQNFYMHWCXBUZO")
    assert np.asarray(document["log_probs"]).shape == (1, 7, 25)
    assert document["mask"][0] == [False] + [True] * 5 + [False]


def test_client_score_streams_a_table_of_several_wild_types(served, tmp_path):
    """`client score` over a gzipped ProteinGym-style CSV naming two wild types, read and written in
    chunks (5 rows here): every row's score equals the brute-force reference, other columns kept."""
    import csv
    import gzip

    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    _, reference, client = served
    other = "GVSEKLMNPQ"
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n>other\n{other}\n")
    rows = [(variant, "wt") for variant in VARIANTS] + [(v, "other") for v in ("G1A", "V2L:S3T", "Q10E")]
    rows = rows * 2  # 18 rows: four chunks of 5
    with gzip.open(tmp_path / "dms.csv.gz", "wt", newline="", encoding="utf-8") as handle:
        csv.writer(handle).writerows([["mutant", "protein", "DMS_score"], *[[m, p, str(i)] for i, (m, p) in
                                                                             enumerate(rows)]])
    result = CliRunner().invoke(app, ["client", "score", "-m", f"{NAME}_scores", "--fasta", str(tmp_path / "wt.fasta"),
                                      "--variants", str(tmp_path / "dms.csv.gz"), "--id-column", "protein",
                                      "--chunk-size", "5",
                                      "--output", str(tmp_path / "scored.csv"), "--triton-url", str(client.client.url)])
    assert result.exit_code == 0, result.output
    assert "wrote 18 scores (wt-marginal)" in result.output
    written = list(csv.DictReader((tmp_path / "scored.csv").open(newline="", encoding="utf-8")))
    assert [(r["mutant"], r["protein"], r["DMS_score"]) for r in written] == \
        [(m, p, str(i)) for i, (m, p) in enumerate(rows)]
    sequences = {"wt": WILD_TYPE, "other": other}
    expected = [brute_force(reference, sequences[p], [m], "wt-marginal")[0] for m, p in rows]
    np.testing.assert_allclose([float(r["wt-marginal_score"]) for r in written], expected, atol=1e-4)


def test_client_score_member_scores_of_one_checkpoint_is_refused_naming_the_model_and_the_fix(served, tmp_path):
    """`client score --member-scores` asks for a checkpoint ensemble's members' scores: against a
    repository of one checkpoint it stops before writing anything, naming the model and what to do."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    _, _, client = served
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n")
    (tmp_path / "dms.csv").write_text("mutant\nM1A\n")
    result = CliRunner().invoke(app, ["client", "score", "-m", f"{NAME}_scores", "--fasta", str(tmp_path / "wt.fasta"),
                                      "--variants", str(tmp_path / "dms.csv"), "--member-scores", "--output",
                                      str(tmp_path / "scored.csv"), "--triton-url", str(client.client.url)])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert f"--member-scores: {NAME}_scores serves one checkpoint (it has no member_scores output)" in message
    assert "leave --member-scores out, or score with a checkpoint ensemble's repository" in message
    assert client.members() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dms.csv", "wt.fasta"]  # nothing written


def test_client_score_killed_mid_table_resumes_to_the_uninterrupted_result(served, tmp_path):
    """A saturation scan scored by a client process killed with SIGKILL after a few chunks: the same
    command again resumes after the last chunk written, and the table equals an uninterrupted run's."""
    import csv
    import os
    import signal
    import subprocess
    import sys
    import time

    _, _, client = served
    (tmp_path / "wt.fasta").write_text(f">wt\n{WILD_TYPE}\n")
    scan = [f"{wt}{position}{aa}" for position, wt in enumerate(WILD_TYPE, start=1) for aa in "ACDEFGHIKLMNPQRSTVWY"]
    with (tmp_path / "scan.csv").open("w", newline="") as handle:
        csv.writer(handle).writerows([["mutant", "DMS_score"], *[[m, str(i)] for i, m in enumerate(scan)]])

    def command(out: str) -> list[str]:
        return [sys.executable, "-m", "bionemo_export.cli.main", "client", "score", "-m", f"{NAME}_scores",
                "--fasta", str(tmp_path / "wt.fasta"), "--variants", str(tmp_path / "scan.csv"), "--method",
                "masked-marginal", "--chunk-size", "11", "--output", str(tmp_path / out), "--triton-url",
                str(client.client.url)]

    subprocess.run(command("whole.csv"), check=True, capture_output=True, timeout=300)
    journal = tmp_path / ".killed.csv.journal.jsonl"
    first = subprocess.Popen(command("killed.csv"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while (not journal.is_file() or len(journal.read_text().splitlines()) < 4) and first.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first.poll() is None, "the first run ended before it could be killed"
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    assert not (tmp_path / "killed.csv").exists()
    again = subprocess.run(command("killed.csv"), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resuming after" in again.stdout and f"wrote {len(scan)} scores" in again.stdout
    whole = list(csv.reader((tmp_path / "whole.csv").open(newline="")))
    resumed = list(csv.reader((tmp_path / "killed.csv").open(newline="")))
    assert [row[:2] for row in resumed] == [row[:2] for row in whole]  # every row once, in order
    np.testing.assert_allclose([float(r[2]) for r in resumed[1:]], [float(r[2]) for r in whole[1:]], atol=1e-6)
    assert not journal.exists()
