"""The layers and attentions tasks (issue 29) served by a real tritonserver: N_layers and N_attentions
of a tiny random ESM-2 and a tiny random BERT (AntiBERTy's architecture and tokenizer), each built
once with the Python backend (without graph optimization), one server per checkpoint. The real
AntiBERTy (8 layers of 512) was served here until the suite's time was cut again (its build and
first test took about 19 s of CPU on a Zen 4 host, more on the slower kind); other modules still
serve it (test_e2e_masked_lm.py, test_scripts.py's demo). rxnfp's reaction-SMILES BERT is the same
architecture under another tokenizer, whose served rows tests/e2e/test_rxnfp.py checks (its
layers: 3.3e-6 max abs error against transformers, 2026-11-27).

The reference is transformers' own `output_hidden_states=True` (EsmModel, BertModel loaded from the
same files), each sequence alone; pooled answers are compared with brute-force numpy pooling of
those states over the residues. Bad requests sent together with good ones fail alone with
INVALID_ARGUMENT naming the value and the range; the layers graph (hosted by N_encoder) answers only the layers asked;
`verify` compares the served layers with PyTorch, and the dev server's answers are the served ones.
Attentions are compared with transformers' `output_attentions=True` of the same files loaded with
eager attention, each sequence alone.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import InferenceError, RepositoryClient
from bionemo_export.dev_server import DevModels
from bionemo_export.models import load_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.verify import verify_repository

NAME = "ly"
ATOL = 1e-4
SEQUENCES = {
    "esm2": ["MKTAYIAKQRQISFVKSHFSRQ", "GVE", "MSLKRKNIALIPAAGIGVRFGXBUZO", "M" * 60],
    "bert": ["EVQLVESGGGLVQPGGSLRLSCAASGFTFSSYAMS", "QVQLQESGPG", "DIQMTQSPSSLSASVGDRVTITC"],
}


@pytest.fixture(scope="module", params=list(SEQUENCES))
def served(request, tmp_path_factory, triton_install):
    which = request.param
    work = tmp_path_factory.mktemp(which)
    family, checkpoint = which, save_random_checkpoint(which, work / "checkpoint", seed=0)
    model_class = transformers.EsmModel if family == "esm2" else transformers.BertModel
    reference = model_class.from_pretrained(checkpoint, add_pooling_layer=False).eval()
    result = build_repository(BuildRequest(family=family, checkpoint=checkpoint, name=NAME, out=work / "repo",
                                           tasks=("embeddings", "hiddens", "layers", "attentions"),
                                           backend="python", optimize=False))
    loaded = load_checkpoint(checkpoint, family)
    with TritonServer(work / "repo", install=triton_install, log_file=work / "tritonserver.log") as server:
        url = f"grpc://{server.endpoints.grpc_url}"
        with RepositoryClient(NAME, url) as client:
            yield which, result, checkpoint, loaded, reference, client, server, url


def reference_states(loaded, reference, sequence: str) -> tuple[np.ndarray, np.ndarray]:
    """(transformers' hidden_states of the sequence alone [layers + 1, T, H], its residue mask [T])."""
    encoded = loaded.tokenizer.encode([sequence])
    with torch.no_grad():
        output = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask), output_hidden_states=True)
    return torch.stack(output.hidden_states)[:, 0].numpy(), encoded.residue_mask[0].astype(bool)


def test_served_layers_and_poolings_equal_transformers_output_hidden_states(served):
    which, result, _, loaded, reference, client, _, _ = served
    assert f"{NAME}_layers" in set(result.models) and f"{NAME}_layer_graph" not in result.models  # N_encoder hosts
    count = loaded.num_layers
    layers = [0, 1, count // 2, -1, -count]
    indices = [layer % (count + 1) for layer in layers]
    sequences = SEQUENCES[which]
    answer = client.layer_embeddings(sequences, layers, ["mean", "bos", "max", "per_tok"])
    assert answer["embeddings"].shape == (len(sequences), len(layers), loaded.hidden_size)
    errors = {"hiddens": 0.0, "mean": 0.0, "max": 0.0, "bos": 0.0}
    for row, sequence in enumerate(sequences):
        states, residues = reference_states(loaded, reference, sequence)
        states = states[indices]
        tokens = states.shape[1]
        assert answer["mask"][row, :tokens].tolist() == residues.tolist() and not answer["mask"][row, tokens:].any()
        served_states = answer["hiddens"][row, :, :tokens]
        assert not answer["hiddens"][row, :, tokens:].any()
        kept = states[:, residues]
        found = {"hiddens": np.abs(served_states - states).max(),
                 "mean": np.abs(answer["embeddings"][row] - kept.mean(1)).max(),
                 "max": np.abs(answer["embeddings_max"][row] - kept.max(1)).max(),
                 "bos": np.abs(answer["embeddings_bos"][row] - states[:, 0]).max()}
        errors = {name: max(errors[name], float(value)) for name, value in found.items()}
        assert states.std() > 0.01
    print(f"{which}: max abs errors {errors}")
    assert max(errors.values()) <= ATOL, errors


def test_the_default_request_answers_the_last_layers_mean_as_n_embeddings(served):
    which, _, _, _, _, client, _, _ = served
    sequences = SEQUENCES[which]
    answer = client.ask("layers", sequences)  # no layers, no include: every output asked, the mean answered
    assert set(answer) >= {"embeddings"}
    embeddings = client.seqs_to_embedding(sequences)
    assert answer["embeddings"].shape == (len(sequences), 1, embeddings.shape[1])
    assert np.abs(answer["embeddings"][:, 0] - embeddings).max() <= 1e-5
    hiddens, mask = client.seqs_to_hidden(sequences)
    last = client.layer_embeddings(sequences, [-1], ["per_tok"])
    assert np.abs(last["hiddens"][:, 0] - hiddens).max() <= 1e-5 and np.array_equal(last["mask"], mask)


def _infer(url: str, model: str, sequences: list[str], options: dict[str, list | None], outputs: list[str]):
    """One plain gRPC request to `model`: ({output: array}, None) or (None, the error). `options`: each
    optional input's values for every row (INT32 numbers or BYTES strings; None: left out)."""
    client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    try:
        inputs = [grpcclient.InferInput("sequences", [len(sequences), 1], "BYTES")]
        inputs[0].set_data_from_numpy(np.array([[s.encode()] for s in sequences], dtype=np.object_))
        for name, values in options.items():
            if values is None:
                continue
            texts = isinstance(values[0], str)
            inputs.append(grpcclient.InferInput(name, [len(sequences), len(values)], "BYTES" if texts else "INT32"))
            row = [v.encode() for v in values] if texts else values
            inputs[-1].set_data_from_numpy(np.array([row] * len(sequences), dtype=np.object_ if texts else np.int32))
        result = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(name) for name in outputs])
        assert result is not None
        answered = {output.name: result.as_numpy(output.name) for output in result.get_response().outputs}
        return {name: value for name, value in answered.items() if value is not None}, None
    except InferenceServerException as err:
        return None, err
    finally:
        client.close()


def _infer_layers(url: str, sequences: list[str], layers: list[int] | None = None, include: list[str] | None = None):
    """One request to N_layers asking for the mean and max poolings."""
    return _infer(url, f"{NAME}_layers", sequences, {"layers": layers, "include": include},
                  ["embeddings", "embeddings_max"])


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_bad_requests_fail_alone_with_invalid_argument_naming_the_value_and_the_range(served):
    which, _, _, loaded, reference, _, _, url = served
    count = loaded.num_layers
    good = [(["MKTAYIAKQR"], [1], ["mean", "max"]), (["GVE", "MSLKRK"], [-1, 0], None)] * 3
    bad = {"over": (["GVE"], [count + 1], None), "under": (["GVE"], [-count - 2], None),
           "unknown": (["GVE"], None, ["mean", "median"]), "character": (["MKZ!"], [1], None)}
    batch = [*good[:3], *bad.values(), *good[3:]]
    with ThreadPoolExecutor(len(batch)) as pool:  # together, so the batcher hands several over at once
        answers = list(pool.map(lambda args: _infer_layers(url, *args), batch))
    for (sequences, layers, include), (outputs, error) in zip(batch, answers):
        if (sequences, layers, include) in good:
            assert error is None, error
            assert outputs is not None
            states, residues = reference_states(loaded, reference, sequences[0])
            expected = states[[layer % (count + 1) for layer in layers or [-1]]][:, residues]
            np.testing.assert_allclose(outputs["embeddings"][0], expected.mean(1), atol=ATOL)
            assert ("embeddings_max" in outputs) == (include is not None)
        else:
            assert outputs is None and error is not None and error.status() == "StatusCode.INVALID_ARGUMENT"
    errors = {what: answers[batch.index(args)][1] for what, args in bad.items()}
    messages = {what: error.message() for what, error in errors.items() if error is not None}
    allowed = f"this model's layers are 0..{count} (0 the embedding layer's output, {count} the last block's"
    assert f"input 'layers' value {count + 1} is out of range: {allowed}" in messages["over"]
    assert f"or -{count + 1}..-1 counted from the end" in messages["over"]
    assert f"input 'layers' value {-count - 2} is out of range" in messages["under"]
    assert "input 'include' value 'median' is unknown; choose among mean, bos, max, per_tok" in messages["unknown"]
    assert "invalid character '!' at position 3" in messages["character"]
    for message in messages.values():
        assert "Traceback" not in message and ".py" not in message


def test_the_config_says_the_model_has_a_bos_token(served):
    """ESM's <cls> and BERT's [CLS]: has_bos true (ProtT5's false: tests/export/test_layer_states.py)."""
    client = served[5]
    assert client._parameter("layers", "has_bos") == "true"
    assert int(client._parameter("layers", "num_layers")) == served[3].num_layers


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_the_layer_graph_answers_only_the_layers_asked(served):
    which, _, _, loaded, _, _, _, url = served
    answered, declared = _graph_outputs(url, loaded, f"{NAME}_encoder", "hiddens_1")
    assert answered == ["hiddens_1"]
    assert [name for name in declared if name.startswith("hiddens_")] == [f"hiddens_{i}"
                                                                          for i in range(loaded.num_layers + 1)]


def _graph_outputs(url: str, loaded, model: str, output: str) -> tuple[list[str], list[str]]:
    """(the outputs a graph model answered when asked for `output` alone, every output it declares)."""
    encoded = loaded.tokenizer.encode(["MKTAYIAKQR", "GVE"])
    client = grpcclient.InferenceServerClient(url.removeprefix("grpc://"))
    try:
        inputs = []
        for name in ("input_ids", "attention_mask"):
            array = np.asarray(getattr(encoded, name), dtype=np.int64)
            inputs.append(grpcclient.InferInput(name, list(array.shape), "INT64"))
            inputs[-1].set_data_from_numpy(array)
        result = client.infer(model, inputs, outputs=[grpcclient.InferRequestedOutput(output)])
        metadata = client.get_model_metadata(model)
        assert result is not None and metadata is not None
        return [o.name for o in result.get_response().outputs], [o.name for o in metadata.outputs]
    finally:
        client.close()


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_the_client_raises_the_servers_message(served):
    which, _, _, loaded, _, client, _, _ = served
    with pytest.raises(InferenceError, match=rf"input 'layers' value {loaded.num_layers + 1} is out of range"):
        client.layer_embeddings(["MKT"], [loaded.num_layers + 1])


@pytest.mark.parametrize("served", ["esm2", "bert"], indirect=True)  # verify samples proteins
def test_verify_compares_the_served_layers_with_pytorch(served, tmp_path):
    which, _, checkpoint, _, _, _, server, url = served
    checks = verify_repository(server.model_repository, checkpoint, url=url)
    layers = [check for check in checks if check.model == f"{NAME}_layers"]
    assert layers and all(check.passed for check in checks), checks
    attentions = [check for check in checks if check.model == f"{NAME}_attentions"]
    assert attentions and max(check.max_abs_error or 0.0 for check in attentions) <= ATOL
    assert max(check.max_abs_error or 0.0 for check in layers) <= ATOL
    if which == "esm2":  # another checkpoint: the same served answers fail
        other = save_random_checkpoint("esm2", tmp_path / "other", seed=62)
        wrong = [check for check in verify_repository(server.model_repository, other, url=url)
                 if check.model == f"{NAME}_layers"]
        assert wrong and not any(check.passed for check in wrong)


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_the_dev_server_answers_what_the_repository_serves(served):
    which, _, checkpoint, loaded, _, client, _, _ = served
    models = DevModels(loaded)
    assert "layers" in models.tasks
    sequences = SEQUENCES[which][:2]
    request = {"sequences": np.array([[s.encode()] for s in sequences], dtype=np.object_),
               "layers": np.array([[0, -1]] * 2, dtype=np.int32),
               "include": np.array([[b"mean", b"bos", b"per_tok"]] * 2, dtype=np.object_)}
    (answer,) = models.answer("layers", [request])
    served_answer = client.layer_embeddings(sequences, [0, -1], ["mean", "bos", "per_tok"])
    assert set(answer) == set(served_answer) == {"embeddings", "embeddings_bos", "hiddens", "mask"}
    for name in answer:
        np.testing.assert_allclose(answer[name], served_answer[name], atol=ATOL)


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_client_encode_with_layers_asks_n_layers(served, tmp_path):
    """`client encode -m N_embeddings --layers ... --include ...` asks the repository's N_layers and
    writes what it answers; a layer out of range is the server's message and exit status 1."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    which, _, _, loaded, _, client, _, url = served
    out = tmp_path / "layers.npz"
    sequences = SEQUENCES[which][:2]
    args = ["client", "encode", "-m", f"{NAME}_embeddings", "--layers", "-1,0", "--include", "mean,bos,per_tok",
            "--triton-url", url, "--output", str(out)]
    result = CliRunner().invoke(app, [*args, *(a for s in sequences for a in ("-s", s))])
    assert result.exit_code == 0, result.output
    saved = np.load(out)
    expected = client.layer_embeddings(sequences, [-1, 0], ["mean", "bos", "per_tok"])
    assert set(saved.files) == set(expected)
    for name, array in expected.items():
        np.testing.assert_allclose(saved[name], array, atol=1e-6)
    # --include alone outside a bulk job: N_layers' last layer
    maximum = tmp_path / "max.npz"
    result = CliRunner().invoke(app, ["client", "encode", "-m", f"{NAME}_hiddens", "--include", "max", "--triton-url",
                                      url, "-s", sequences[0], "--output", str(maximum)])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(maximum)["embeddings_max"], client.layer_embeddings(
        sequences[:1], [-1], ["max"])["embeddings_max"], atol=1e-6)
    result = CliRunner().invoke(app, ["client", "encode", "-m", f"{NAME}_layers", "--layers",
                                      str(loaded.num_layers + 1), "--triton-url", url, "-s", "MKT"])
    assert result.exit_code != 0 and f"value {loaded.num_layers + 1} is out of range" in result.output


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_the_health_probe_answers(served):
    from bionemo_export.client.triton import TritonClient
    from bionemo_export.runtime.probes import probe_model, public_models

    url = served[7]
    with TritonClient(url) as client:
        assert f"{NAME}_layers" in public_models(client)
        result = probe_model(client, f"{NAME}_layers")
    assert result.ok, result.line()


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_a_bulk_job_stores_each_layer_and_pooling(served, tmp_path):
    """`client encode --input FASTA --output out.h5 --layers 1,-1 --include mean,bos`: the last layer
    under today's names, layer 1 with a `_layer1` suffix, equal to what N_layers answers; the same
    columns in Parquet."""
    import h5py
    import pyarrow.parquet as pq
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    which, _, _, _, _, client, _, url = served
    sequences = SEQUENCES[which]
    fasta = tmp_path / "in.fasta"
    fasta.write_text("".join(f">s{i}\n{s}\n" for i, s in enumerate(sequences)))
    expected = client.layer_embeddings(sequences, [1, -1], ["mean", "bos"])
    for out in (tmp_path / "out.h5", tmp_path / "out.parquet"):
        result = CliRunner().invoke(app, ["client", "encode", "-m", f"{NAME}_embeddings", "-i", str(fasta),
                                          "--output", str(out), "--layers", "1,-1", "--include", "mean,bos",
                                          "--triton-url", url])
        assert result.exit_code == 0, result.output
        stored: dict[str, np.ndarray]
        if out.suffix == ".h5":
            handle: Any
            with h5py.File(out) as handle:
                names = ("embeddings", "embeddings_bos", "embeddings_layer1", "embeddings_bos_layer1")
                stored = {name: np.asarray(handle[name][()]) for name in names}
                assert "embeddings_max" not in handle and "embedding" not in handle
        else:
            table = pq.read_table(out)
            stored = {name.replace("embedding", "embeddings", 1): np.array(table.column(name).to_pylist())
                      for name in ("embedding", "embedding_bos", "embedding_layer1", "embedding_bos_layer1")}
        np.testing.assert_allclose(stored["embeddings"], expected["embeddings"][:, 1], atol=1e-6)
        np.testing.assert_allclose(stored["embeddings_bos"], expected["embeddings_bos"][:, 1], atol=1e-6)
        np.testing.assert_allclose(stored["embeddings_layer1"], expected["embeddings"][:, 0], atol=1e-6)
        np.testing.assert_allclose(stored["embeddings_bos_layer1"], expected["embeddings_bos"][:, 0], atol=1e-6)


# ---------------------------------------------------------------------------- attentions (N_attentions)
@pytest.mark.parametrize("served", ["esm2", "bert"], indirect=True)
def test_served_attentions_equal_transformers_output_attentions(served):
    which, result, checkpoint, loaded, reference, client, _, _ = served
    assert f"{NAME}_attentions" in result.models and f"{NAME}_attention_graph" not in result.models
    eager = type(reference).from_pretrained(checkpoint, add_pooling_layer=False, attn_implementation="eager").eval()
    count, heads = loaded.num_layers, loaded.num_heads
    layers, chosen = [-1, 1, count // 2 + 1], [heads - 1, 0]
    sequences = SEQUENCES[which]
    answer = client.attention_maps(sequences, layers, chosen)
    default = client.attention_maps(sequences)  # the last block, every head
    error = 0.0
    for row, sequence in enumerate(sequences):
        encoded = loaded.tokenizer.encode([sequence])
        with torch.no_grad():
            output = eager(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask), output_attentions=True)
        expected = torch.stack(output.attentions)[:, 0].numpy()  # [layers, heads, T, T]
        tokens = expected.shape[-1]
        got = answer["attentions"][row]
        assert not got[:, :, tokens:].any() and not got[:, :, :, tokens:].any()
        want = expected[[layer - 1 if layer > 0 else count + layer for layer in layers]][:, chosen]
        error = max(error, float(np.abs(got[:, :, :tokens, :tokens] - want).max()),
                    float(np.abs(default["attentions"][row, 0, :, :tokens, :tokens] - expected[-1]).max()))
        assert answer["mask"][row, :tokens].tolist() == encoded.residue_mask[0].astype(bool).tolist()
    print(f"{which}: attentions max abs error {error:.2e}")
    assert error <= ATOL


def _infer_attentions(url: str, sequences: list[str], layers: list[int] | None = None,
                      heads: list[int] | None = None):
    """One request to N_attentions: (attentions, None) or (None, the error)."""
    outputs, error = _infer(url, f"{NAME}_attentions", sequences, {"layers": layers, "heads": heads}, ["attentions"])
    return (None, error) if outputs is None else (outputs["attentions"], None)


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_bad_attention_requests_fail_alone_naming_the_value_the_range_and_the_limit(served):
    which, _, _, loaded, _, client, _, url = served
    count, heads = loaded.num_layers, loaded.num_heads
    good = [(["MKTAYIAKQR"], [1], None), (["GVE", "MSLKRK"], [-1], [0])] * 2
    # 32 rows x 2 blocks x 4 heads x 302^2 token pairs > the default limit of 2^24 values
    bad = {"embedding": (["GVE"], [0], None), "over": (["GVE"], [count + 1], None), "head": (["GVE"], None, [heads]),
           "size": (["M" * 300] * 32, [1, 2], None)}
    batch = [*good[:2], *bad.values(), *good[2:]]
    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda args: _infer_attentions(url, *args), batch))
    for args, (attentions, error) in zip(batch, answers):
        if args in good:
            assert error is None, error
            assert attentions is not None
            expected = client.attention_maps(args[0], args[1], args[2])["attentions"]
            np.testing.assert_allclose(attentions, expected, atol=1e-6)
        else:
            assert attentions is None and error is not None and error.status() == "StatusCode.INVALID_ARGUMENT"
    errors = {what: answers[batch.index(args)][1] for what, args in bad.items()}
    messages = {what: error.message() for what, error in errors.items() if error is not None}
    assert "input 'layers' value 0 is the embedding layer, which has no attention" in messages["embedding"]
    assert f"input 'layers' value {count + 1} is out of range: this model's blocks are 1..{count}" in messages["over"]
    assert f"input 'heads' value {heads} is out of range: this model's heads are 0..{heads - 1}" in messages["head"]
    assert (f"the answer would hold {32 * 2 * heads * 302 * 302:,} attention values (32 sequences x 2 blocks x "
            f"{heads} heads x 302^2 token pairs); this model answers at most 16,777,216 per request (config "
            "parameter max_attention_values)") in messages["size"]
    assert client._parameter("attentions", "max_attention_values") == str(1 << 24)


@pytest.mark.parametrize("served", ["esm2"], indirect=True)  # the same for every checkpoint
def test_the_attention_graph_answers_only_the_blocks_asked_and_the_dev_server_agrees(served):
    which, _, _, loaded, _, client, _, url = served
    answered, declared = _graph_outputs(url, loaded, f"{NAME}_encoder", "attentions_2")
    assert answered == ["attentions_2"]
    assert [name for name in declared if name.startswith("attentions_")] == [f"attentions_{i}"
                                                                             for i in range(1, loaded.num_layers + 1)]
    models = DevModels(loaded)
    assert "attentions" in models.tasks
    sequences = SEQUENCES[which][:2]
    request = {"sequences": np.array([[s.encode()] for s in sequences], dtype=np.object_),
               "layers": np.array([[2, 1]] * 2, dtype=np.int32), "heads": np.array([[1]] * 2, dtype=np.int32)}
    (answer,) = models.answer("attentions", [request])
    served_answer = client.attention_maps(sequences, [2, 1], [1])
    for name in ("attentions", "mask"):
        np.testing.assert_allclose(answer[name], served_answer[name], atol=ATOL)
