"""N_contacts' served logic (serving/contacts.py) without a server: requests through the fake
`triton_python_backend_utils`, its BLS calls to N_contact_graph answered by the package's PyTorch
contact head of a tiny random ESM-2 (what the exported graph computes), the maps compared with
transformers' own `EsmForMaskedLM.predict_contacts` on each sequence alone. The served end to end
path (tritonserver, the exported graph) is tests/e2e/test_e2e_contacts.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.models import get_family
from bionemo_export.serving.contacts import ContactMaps
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.testing.checkpoints import save_random_checkpoint, set_contact_head
from tests.helpers import fake_pb_utils


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    checkpoint = set_contact_head(save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2") / "ck", seed=31),
                                  seed=32)
    loaded = get_family("esm2").load(checkpoint)
    reference = transformers.EsmForMaskedLM.from_pretrained(checkpoint, attn_implementation="eager").eval()
    return loaded, reference


@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def graph(loaded, calls: list[tuple[int, int]], fail_at: int | None = None):
    """N_contact_graph as the repository computes it (the PyTorch head); records (rows, length) per call."""
    def run(input_ids: np.ndarray, attention_mask: np.ndarray) -> np.ndarray:
        calls.append((input_ids.shape[0], input_ids.shape[1]))
        if fail_at is not None and input_ids.shape[1] == fail_at:
            raise RuntimeError("the graph failed")
        with torch.inference_mode():
            return loaded.contacts(torch.from_numpy(input_ids), torch.from_numpy(attention_mask)).numpy()
    return run


def contact_maps(loaded, calls, *, max_residues=30, pair_budget=2 * 24 * 24, fail_at=None) -> ContactMaps:
    return ContactMaps(loaded.tokenizer, graph(loaded, calls, fail_at), max_residues=max_residues,
                       pair_budget=pair_budget, max_rows=8, responder=Responder("t_contacts", (TokenizationError,)))


def expected(reference, sequence: str) -> np.ndarray:
    vocab = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO"]
    ids = torch.tensor([[0, *(vocab.index(c) for c in sequence), 2]])
    with torch.no_grad():
        return reference.predict_contacts(ids, torch.ones_like(ids))[0].numpy()


def column(*texts: str) -> np.ndarray:
    return np.array([[t.encode()] for t in texts], dtype=np.object_)


def test_requests_batched_together_each_get_their_own_maps_and_bad_ones_fail_alone(pb_utils, model):
    loaded, reference = model
    calls: list[tuple[int, int]] = []
    requests = [column("MKTAYIAKQR", "GVE"), column("MKZ!"), column("A" * 31), column("MSLKRKNIALIPAAGIGVRFG"),
                column("LLLLLLLLLLLLLLLLLLLL")]
    responses, _ = contact_maps(loaded, calls).execute([fake_pb_utils.request({"sequences": r}) for r in requests])
    first, bad_character, too_long, third, fourth = responses
    for response in (first, third, fourth):
        assert not response.has_error(), response.error()
    contacts, mask = first.output("contacts"), first.output("mask")
    assert contacts.shape == (2, 10, 10) and contacts.dtype == np.float32
    assert mask.tolist()[1] == [True] * 3 + [False] * 7
    np.testing.assert_allclose(contacts[0], expected(reference, "MKTAYIAKQR"), atol=1e-4)
    np.testing.assert_allclose(contacts[1, :3, :3], expected(reference, "GVE"), atol=1e-4)
    assert not contacts[1, 3:].any() and not contacts[1, :, 3:].any()
    np.testing.assert_allclose(third.output("contacts")[0], expected(reference, "MSLKRKNIALIPAAGIGVRFG"), atol=1e-4)
    for response, words in ((bad_character, "sequence 0 has an invalid character '!' at position 3"),
                            (too_long, "sequence 0 has 31 residues; contact maps are answered for at most 30 "
                                       "(config parameter max_residues")):
        assert response.error().code() == fake_pb_utils.TritonError.INVALID_ARG
        assert words in response.error().message()
    # The four good rows, sorted by length, in calls of at most 2 x 24^2 token pairs: 5 and 12 tokens
    # together, then 22 and 23 together.
    assert calls == [(2, 12), (2, 23)]


def test_a_failed_graph_call_fails_only_the_requests_it_held(pb_utils, model):
    loaded, _ = model
    calls: list[tuple[int, int]] = []
    requests = [column("MKTAYIAKQR"), column("M" * 25)]
    responses, _ = contact_maps(loaded, calls, pair_budget=12 * 12, fail_at=27).execute(
        [fake_pb_utils.request({"sequences": r}) for r in requests])
    assert not responses[0].has_error() and responses[1].has_error()
    assert responses[1].error().code() == fake_pb_utils.TritonError.INTERNAL
    assert calls == [(1, 12), (1, 27)]


def test_the_limit_lies_within_the_models(model):
    loaded, _ = model
    with pytest.raises(ValueError, match=r"parameter max_residues is 1023; it must lie in 1..1022"):
        contact_maps(loaded, [], max_residues=1023)
