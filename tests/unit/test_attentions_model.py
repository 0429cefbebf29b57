"""N_attentions' served logic (serving/attentions.py) and its PyTorch module
(models/attention_maps.py) without a server or an export.

The module is compared, family by family, with transformers' own `output_attentions=True` of the
same files loaded with `attn_implementation="eager"`. The served logic runs requests through the
fake `triton_python_backend_utils`, its BLS calls to N_attention_graph answered by the module, and
its answers are compared with transformers on each sequence alone. The served end to end path
(tritonserver, the exported graph) is in tests/e2e/test_e2e_layers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import unserved_tasks
from bionemo_export.models import get_family
from bionemo_export.serving.attentions import AttentionWeights, normalize_blocks, normalize_heads
from bionemo_export.serving.responses import RequestError, Responder
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils

ATOL = 1e-4
REFERENCE_CLASSES = {"esm2": transformers.EsmModel, "esm1": transformers.EsmModel, "saprot": transformers.EsmModel,
                     "bert": transformers.BertModel, "prott5": transformers.T5EncoderModel,
                     "esmc": transformers.EsmcModel}


def reference_attentions(reference, loaded, sequence: str) -> np.ndarray:
    """transformers' output_attentions of the sequence alone: [layers, heads, T, T]."""
    encoded = loaded.tokenizer.encode([sequence])
    with torch.no_grad():
        output = reference(input_ids=torch.from_numpy(encoded.input_ids),
                           attention_mask=torch.from_numpy(encoded.attention_mask), output_attentions=True)
    return torch.stack(output.attentions)[:, 0].numpy()


@pytest.mark.parametrize("family", list(REFERENCE_CLASSES))
def test_the_module_equals_transformers_output_attentions(tmp_path, family):
    checkpoint = save_random_checkpoint(family, tmp_path / "ck", seed=0)
    loaded = get_family(family).load(checkpoint)
    reference = REFERENCE_CLASSES[family].from_pretrained(checkpoint, attn_implementation="eager").eval()
    sequences = list(loaded.family.sample_sequences()[:2])
    encoded = loaded.tokenizer.encode(sequences)
    with torch.no_grad():
        every = loaded.attention_maps(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
    assert len(every) == loaded.num_layers and every[0].shape[1] == loaded.num_heads
    for row, sequence in enumerate(sequences):
        tokens = int(encoded.attention_mask[row].sum())
        batched = torch.stack(every)[:, row, :, :tokens, :tokens].numpy()
        np.testing.assert_allclose(batched, reference_attentions(reference, loaded, sequence), atol=ATOL)


def test_a_checkpoint_on_the_projects_own_transformer_has_no_attentions_task(tmp_path):
    checkpoint = save_random_checkpoint("megamolbart", tmp_path / "mmb", seed=5)
    loaded = get_family("megamolbart").load(checkpoint)
    assert not loaded.returns_attentions and "attentions" not in loaded.servable()
    why = unserved_tasks(loaded, ("embeddings", "attentions"))
    assert list(why) == ["attentions"]
    assert "project's own transformer" in why["attentions"] and "cannot serve attentions" in why["attentions"]


# ---------------------------------------------------------------------------- the served logic
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpoint = save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2") / "ck", seed=0)
    loaded = get_family("esm2").load(checkpoint)
    reference = transformers.EsmModel.from_pretrained(checkpoint, add_pooling_layer=False,
                                                      attn_implementation="eager").eval()
    return loaded, reference


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def graph(loaded, calls: list[tuple[int, int, tuple[int, ...]]], fail_at: int | None = None):
    """N_attention_graph as the repository computes it (the PyTorch module), answering only the
    blocks asked; records (rows, length, blocks) per call."""
    maps = loaded.attention_maps

    def run(input_ids: np.ndarray, attention_mask: np.ndarray, blocks) -> list[np.ndarray]:
        calls.append((input_ids.shape[0], input_ids.shape[1], tuple(blocks)))
        if fail_at is not None and input_ids.shape[1] == fail_at:
            raise RuntimeError("the graph failed")
        with torch.inference_mode():
            every = maps(torch.from_numpy(input_ids), torch.from_numpy(attention_mask))
        return [every[block - 1].numpy() for block in blocks]
    return run


def attention_model(loaded, calls, *, max_values=1 << 20, pair_budget=2 * 24 * 24, fail_at=None) -> AttentionWeights:
    return AttentionWeights(loaded.tokenizer, graph(loaded, calls, fail_at), num_layers=loaded.num_layers,
                            num_heads=loaded.num_heads, max_values=max_values, pair_budget=pair_budget, max_rows=8,
                            responder=Responder("t_attentions", (TokenizationError,)))


def request(*sequences: str, layers=None, heads=None):
    inputs: dict[str, np.ndarray] = {"sequences": np.array([[s.encode()] for s in sequences], dtype=np.object_)}
    if layers is not None:
        inputs["layers"] = np.tile(np.array(layers, dtype=np.int32), (len(sequences), 1))
    if heads is not None:
        inputs["heads"] = np.tile(np.array(heads, dtype=np.int32), (len(sequences), 1))
    return fake_pb_utils.request(inputs)


def test_requests_batched_together_get_their_blocks_and_heads_and_bad_ones_fail_alone(pb_utils, model):
    loaded, reference = model
    calls: list[tuple[int, int, tuple[int, ...]]] = []
    requests = [request("MKTAYIAKQR", "GVE"), request("MSLKRKNIALIPAAGIGVRFG", layers=[-1, 1], heads=[3, 0]),
                request("GVE", layers=[0]), request("MK!"), request("LLLLLLLLLLLLLLLLLLLL", heads=[-1])]
    responses, work = attention_model(loaded, calls).execute(requests)
    first, second, embedding_layer, bad_character, fifth = responses
    for response in (first, second, fifth):
        assert not response.has_error(), response.error()
    attentions, mask = first.output("attentions"), first.output("mask")
    # the default: the last block, every head; [batch, K, heads, T, T] padded to the longest (12 tokens)
    assert attentions.shape == (2, 1, loaded.num_heads, 12, 12) and attentions.dtype == np.float32
    assert mask.tolist()[1] == [False, True, True, True] + [False] * 8
    last = loaded.num_layers - 1
    np.testing.assert_allclose(attentions[0, 0], reference_attentions(reference, loaded, "MKTAYIAKQR")[last],
                               atol=ATOL)
    np.testing.assert_allclose(attentions[1, 0, :, :5, :5], reference_attentions(reference, loaded, "GVE")[last],
                               atol=ATOL)
    assert not attentions[1, :, :, 5:].any() and not attentions[1, :, :, :, 5:].any()
    expected = reference_attentions(reference, loaded, "MSLKRKNIALIPAAGIGVRFG")
    got = second.output("attentions")
    assert got.shape == (1, 2, 2, 23, 23)
    np.testing.assert_allclose(got[0], expected[[last, 0]][:, [3, 0]], atol=ATOL)  # in the order asked
    np.testing.assert_allclose(fifth.output("attentions")[0, 0, 0],
                               reference_attentions(reference, loaded, "L" * 20)[last, -1], atol=ATOL)
    assert embedding_layer.error().code() == fake_pb_utils.TritonError.INVALID_ARG
    assert "input 'layers' value 0 is the embedding layer, which has no attention" in embedding_layer.error().message()
    assert "sequence 0 has an invalid character '!'" in bad_character.error().message()
    assert work == sum(r.output("attentions").nbytes + r.output("mask").nbytes for r in (first, second, fifth))
    # grouped by the blocks asked, sorted by length, within 2 x 24^2 token pairs per call
    assert calls == [(1, 23, (1, 2)), (2, 12, (2,)), (1, 22, (2,))]


def test_an_answer_over_the_limit_fails_alone_naming_its_size_and_the_parameter(pb_utils, model):
    loaded, _ = model
    calls: list = []
    small, large = request("MKTAYIAKQR"), request("MKTAYIAKQR", "GVE", layers=[1, 2])
    responses, _ = attention_model(loaded, calls, max_values=2 * 4 * 12 * 12).execute([small, large])
    assert not responses[0].has_error()
    message = responses[1].error().message()
    assert responses[1].error().code() == fake_pb_utils.TritonError.INVALID_ARG
    assert ("the answer would hold 2,304 attention values (2 sequences x 2 blocks x 4 heads x 12^2 token pairs); "
            "this model answers at most 1,152 per request (config parameter max_attention_values)") in message
    assert len(calls) == 1


def test_a_failed_graph_call_fails_only_the_requests_it_held(pb_utils, model):
    loaded, _ = model
    calls: list = []
    responses, _ = attention_model(loaded, calls, pair_budget=12 * 12, fail_at=27).execute(
        [request("MKTAYIAKQR"), request("M" * 25)])
    assert not responses[0].has_error() and responses[1].has_error()
    assert responses[1].error().code() == fake_pb_utils.TritonError.INTERNAL


def test_blocks_and_heads_are_normalized_or_refused_naming_the_range():
    assert normalize_blocks([1, -1, 3, -3], 3) == (1, 3, 3, 1)
    assert normalize_heads([0, -1, 2], 4) == (0, 3, 2)
    for values, words in (([4], "value 4 is out of range: this model's blocks are 1..3 or -3..-1"),
                          ([-4], "value -4 is out of range"), ([], "input 'layers' is empty"),
                          ([0], "value 0 is the embedding layer")):
        with pytest.raises(RequestError, match=words):
            normalize_blocks(values, 3)
    with pytest.raises(RequestError, match=r"input 'heads' value 4 is out of range: this model's heads are 0..3 or "
                                           r"-4..-1"):
        normalize_heads([4], 4)
    with pytest.raises(RequestError, match="input 'heads' is empty"):
        normalize_heads([], 4)


def test_the_settings_are_checked_where_the_model_is_made(model):
    loaded, _ = model
    with pytest.raises(ValueError, match="parameter max_attention_values is 0"):
        attention_model(loaded, [], max_values=0)
