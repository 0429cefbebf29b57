"""N_layers' served logic (serving/layers.py) without a server: requests through the fake
`triton_python_backend_utils`, its BLS calls to N_layer_graph answered by the package's PyTorch
layer states of a tiny random ESM-2 (what the exported graph computes), the answers compared with
transformers' own `output_hidden_states=True` on each sequence alone, pooled by brute-force numpy.
The served end to end path (tritonserver, the exported graph) is tests/e2e/test_e2e_layers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import get_family
from bionemo_export.models.layer_states import layer_output_name as graph_output_name
from bionemo_export.serving.layers import (
    LayerEmbeddings,
    layer_output_name,
    normalize_layers,
    parse_include,
    pool,
)
from bionemo_export.serving.responses import RequestError, Responder
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpoint = save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2") / "ck", seed=51)
    loaded = get_family("esm2").load(checkpoint)
    reference = transformers.EsmModel.from_pretrained(checkpoint, add_pooling_layer=False).eval()
    return loaded, reference


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def graph(loaded, calls: list[tuple[int, int, tuple[int, ...]]], fail_at: int | None = None):
    """N_layer_graph as the repository computes it (the PyTorch layer states), answering only the
    layers asked; records (rows, length, layers) per call."""
    states = loaded.layer_states

    def run(input_ids: np.ndarray, attention_mask: np.ndarray, layers) -> list[np.ndarray]:
        calls.append((input_ids.shape[0], input_ids.shape[1], tuple(layers)))
        if fail_at is not None and input_ids.shape[1] == fail_at:
            raise RuntimeError("the graph failed")
        with torch.inference_mode():
            every = states(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        return [every[layer].numpy() for layer in layers]
    return run


def layer_model(loaded, calls, *, has_bos=True, token_budget=64, fail_at=None) -> LayerEmbeddings:
    return LayerEmbeddings(loaded.tokenizer, graph(loaded, calls, fail_at), num_layers=loaded.num_layers,
                           has_bos=has_bos, token_budget=token_budget, max_rows=8,
                           responder=Responder("t_layers", (TokenizationError,)))


def reference_states(reference, sequence: str) -> np.ndarray:
    """transformers' hidden_states of the sequence alone: [layers + 1, L + 2, H]."""
    ids = torch.tensor([[0, *(ESM_VOCAB.index(c) for c in sequence), 2]])
    with torch.no_grad():
        output = reference(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    return torch.stack(output.hidden_states)[:, 0].numpy()


def column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def options(rows: int, layers=None, include=None) -> dict[str, np.ndarray]:
    inputs = {}
    if layers is not None:
        inputs["layers"] = np.array([layers] * rows, dtype=np.int32)
    if include is not None:
        inputs["include"] = np.array([[c.encode() for c in include]] * rows, dtype=np.object_)
    return inputs


def test_every_output_equals_transformers_hidden_states_pooled_by_numpy(pb_utils, model):
    loaded, reference = model
    sequences = ["MKTAYIAKQR", "GVE"]
    calls: list = []
    request = fake_pb_utils.request({"sequences": column(*sequences),
                                     **options(2, [0, -1, 1], ["per_tok", "max", "bos", "mean"])})
    (response,), _ = layer_model(loaded, calls).execute([request])
    assert not response.has_error(), response.error()
    mean, bos, maximum = (response.output(n) for n in ("embeddings", "embeddings_bos", "embeddings_max"))
    hiddens, mask = response.output("hiddens"), response.output("mask")
    assert mean.shape == bos.shape == maximum.shape == (2, 3, 32) and hiddens.shape == (2, 3, 12, 32)
    assert mask.tolist()[1] == [False, True, True, True] + [False] * 8
    errors = []
    for row, sequence in enumerate(sequences):
        expected = reference_states(reference, sequence)[[0, 2, 1]]  # layers 0, -1 (= 2), 1
        residues = expected[:, 1:-1]
        n = len(sequence) + 2
        errors += [np.abs(hiddens[row, :, :n] - expected).max(), np.abs(mean[row] - residues.mean(1)).max(),
                   np.abs(maximum[row] - residues.max(1)).max(), np.abs(bos[row] - expected[:, 0]).max()]
        assert not hiddens[row, :, n:].any()
    assert max(errors) <= 1e-5, errors
    assert calls == [(2, 12, (0, 1, 2))]


def test_the_default_is_the_last_layers_mean_as_n_embeddings_answers_it(pb_utils, model):
    loaded, _ = model
    sequences = ["MKTAYIAKQR", "GVE"]
    (response,), _ = layer_model(loaded, []).execute([fake_pb_utils.request({"sequences": column(*sequences)})])
    assert [t.name() for t in response.output_tensors()] == ["embeddings"]
    encoded = loaded.tokenizer.encode([s.encode() for s in sequences])
    with torch.inference_mode():
        _, embeddings = loaded.encoder(*(torch.from_numpy(np.asarray(a)) for a in (
            encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    np.testing.assert_allclose(response.output("embeddings")[:, 0], embeddings.numpy(), atol=1e-5)


def test_bad_requests_fail_alone_naming_the_value_and_the_range(pb_utils, model):
    loaded, reference = model
    calls: list = []
    requests = {
        "good": {"sequences": column("MKTAYIAKQR"), **options(1, [1])},
        "over": {"sequences": column("GVE"), **options(1, [3])},
        "under": {"sequences": column("GVE"), **options(1, [-1, -4])},
        "unknown": {"sequences": column("GVE"), **options(1, None, ["mean", "median"])},
        "rows differ": {"sequences": column("GVE", "MK"), "layers": np.array([[1], [2]], dtype=np.int32)},
        "bad character": {"sequences": column("MKZ!"), **options(1, [1])},
        "also good": {"sequences": column("GVEL"), **options(1, [-3], ["max"])},
    }
    responses, _ = layer_model(loaded, calls).execute([fake_pb_utils.request(r) for r in requests.values()])
    answers = dict(zip(requests, responses))
    for name in ("good", "also good"):
        assert not answers[name].has_error(), answers[name].error()
    np.testing.assert_allclose(answers["good"].output("embeddings")[0, 0],
                               reference_states(reference, "MKTAYIAKQR")[1, 1:-1].mean(0), atol=1e-5)
    np.testing.assert_allclose(answers["also good"].output("embeddings_max")[0, 0],
                               reference_states(reference, "GVEL")[0, 1:-1].max(0), atol=1e-5)
    range_text = "0..2 (0 the embedding layer's output, 2 the last block's after the final layer norm), or -3..-1"
    messages = {
        "over": f"t_layers: input 'layers' value 3 is out of range: this model's layers are {range_text}",
        "under": "input 'layers' value -4 is out of range",
        "unknown": "input 'include' value 'median' is unknown; choose among mean, bos, max, per_tok",
        "rows differ": "input 'layers' row 1 differs from row 0 ([2] vs [1]): one choice for the whole request",
        "bad character": "sequence 0 has an invalid character '!' at position 3",
    }
    for name, words in messages.items():
        error = answers[name].error()
        assert error is not None and error.code() == fake_pb_utils.TritonError.INVALID_ARG, name
        assert words in error.message(), (name, error.message())
    # Only the good rows reached the graph, each call asking for its own layers only.
    assert sorted(calls) == [(1, 6, (0,)), (1, 12, (1,))]


def test_rows_asking_for_the_same_layers_share_a_call_within_the_token_budget(pb_utils, model):
    loaded, _ = model
    calls: list = []
    requests = [{"sequences": column("MKTAYIAKQR", "GVE"), **options(2, [1])},
                {"sequences": column("M" * 20), **options(1, [1])},
                {"sequences": column("LL"), **options(1, [2, 1])}]
    responses, _ = layer_model(loaded, calls, token_budget=30).execute(
        [fake_pb_utils.request(r) for r in requests])
    assert not any(r.has_error() for r in responses)
    assert responses[2].output("embeddings").shape == (1, 2, 32)
    # layers (1,): 5 and 12 tokens together (2 x 12 <= 30), 22 alone; layers (1, 2): its own call.
    assert calls == [(2, 12, (1,)), (1, 22, (1,)), (1, 4, (1, 2))]


def test_a_failed_graph_call_fails_only_the_requests_it_held(pb_utils, model):
    loaded, _ = model
    calls: list = []
    requests = [column("MKTAYIAKQR"), column("M" * 25)]
    responses, _ = layer_model(loaded, calls, token_budget=12, fail_at=27).execute(
        [fake_pb_utils.request({"sequences": r}) for r in requests])
    assert not responses[0].has_error() and responses[1].has_error()
    assert responses[1].error().code() == fake_pb_utils.TritonError.INTERNAL


def test_a_model_without_a_bos_token_refuses_bos_and_says_why(pb_utils, model):
    loaded, _ = model
    request = fake_pb_utils.request({"sequences": column("GVE"), **options(1, None, ["bos"])})
    (response,), _ = layer_model(loaded, [], has_bos=False).execute([request])
    assert response.error().code() == fake_pb_utils.TritonError.INVALID_ARG
    assert "asks for bos, but this model's rows start with a residue (no BOS/CLS token before it, as in ProtT5)" \
           in response.error().message()


def test_layer_numbering_and_pooling():
    assert normalize_layers([0, -1, 5, -6, 3], 5) == (0, 5, 5, 0, 3)
    for value in (6, -7):
        with pytest.raises(RequestError, match=rf"value {value} is out of range: this model's layers are 0..5 "):
            normalize_layers([value], 5)
    with pytest.raises(RequestError, match="is empty"):
        normalize_layers([], 5)
    assert parse_include(["per_tok", "mean"], True) == ("mean", "per_tok")
    states = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
    mask = np.array([[False, True, True, False], [False, True, False, False]])
    np.testing.assert_allclose(pool(states, mask, "mean"), [states[0, 1:3].mean(0), states[1, 1]])
    np.testing.assert_allclose(pool(states, mask, "max"), [states[0, 2], states[1, 1]])
    np.testing.assert_allclose(pool(states, mask, "bos"), states[:, 0])
    assert [layer_output_name(i) for i in range(3)] == [graph_output_name(i) for i in range(3)]


def test_the_task_table_and_the_served_module_name_the_same_choices_and_outputs():
    from bionemo_export.serving.layers import INCLUDE_CHOICES, POOLED_OUTPUTS
    from bionemo_export.tasks import LAYER_INCLUDE, LAYER_OUTPUTS, TASKS

    assert LAYER_INCLUDE == INCLUDE_CHOICES and LAYER_OUTPUTS == POOLED_OUTPUTS
    assert [t.name for t in TASKS["layers"].outputs] == [*POOLED_OUTPUTS.values(), "hiddens", "mask"]
