"""ESM's contact head (issue 29, item 3): LoadedModel.contacts against transformers' own
`EsmForMaskedLM.predict_contacts` on the same files, the contacts graph a build exports, and what a
checkpoint without the head gets (no task, and `inspect` and the build say why).

The reference is transformers itself, with eager attention (its `predict_contacts` needs the
attention probabilities, which sdpa does not return). Random checkpoints get a contact head of
spread-out weights (`set_contact_head`): the head transformers initialises answers 0.5 everywhere
on a random model, which would make every comparison pass.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildError, BuildRequest, build_repository
from bionemo_export.checkpoint_report import inspect_checkpoint
from bionemo_export.models import load_checkpoint
from bionemo_export.models.readers import CheckpointError
from bionemo_export.testing.checkpoints import CONTACT_HEAD_KEYS, save_random_checkpoint, set_contact_head

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
"""The 33 Hugging Face ESM token ids, written out (not the package's tokenizer)."""
SEQUENCES = ["MKTAYIAKQRQISFVKSHFSRQ", "GVE", "MSLKRKNIALIPAAGIGVRFGXBUZO", "M"]


def reference_tokens(sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """<cls> + residues + <eos>, padded with <pad>, from the literal vocabulary."""
    length = max(len(s) for s in sequences) + 2
    ids = torch.full((len(sequences), length), ESM_VOCAB.index("<pad>"), dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        tokens = [ESM_VOCAB.index("<cls>"), *(ESM_VOCAB.index(c) for c in sequence), ESM_VOCAB.index("<eos>")]
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
    return ids, mask


@pytest.fixture(scope="module", params=["esm2", "esm1"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, set_contact_head(save_random_checkpoint(request.param, folder / "ck", seed=21), seed=22)


def test_the_contact_head_equals_transformers_predict_contacts(checkpoint):
    family, path = checkpoint
    loaded = load_checkpoint(path, family)
    assert loaded.contacts is not None
    reference = transformers.EsmForMaskedLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask = reference_tokens(SEQUENCES)
    with torch.no_grad():
        expected = reference.predict_contacts(ids, mask).numpy()
        batched = loaded.contacts(ids, mask).numpy()
    assert batched.shape == expected.shape == (4, len(SEQUENCES[2]), len(SEQUENCES[2]))
    np.testing.assert_allclose(batched, expected, atol=1e-5)
    for row, sequence in enumerate(SEQUENCES):  # each map alone: padding changes nothing in it
        alone_ids, alone_mask = reference_tokens([sequence])
        with torch.no_grad():
            alone = loaded.contacts(alone_ids, alone_mask)[0].numpy()
        n = len(sequence)
        np.testing.assert_allclose(alone, expected[row, :n, :n], atol=1e-4)
        np.testing.assert_allclose(alone, alone.T, atol=1e-4)
    assert expected[0].std() > 0.1, "the head must spread its answers for the comparison to mean anything"


def test_the_encoder_keeps_its_attention_and_shares_the_weights(checkpoint):
    family, path = checkpoint
    loaded = load_checkpoint(path, family)
    backbone = cast("transformers.EsmModel", loaded.encoder.backbone)
    contacts = loaded.contacts
    assert contacts is not None and backbone.config._attn_implementation != "eager"
    assert contacts.backbone.config._attn_implementation == "eager"
    shared = dict(contacts.backbone.named_parameters())
    assert all(shared[name] is parameter for name, parameter in backbone.named_parameters())


def test_a_checkpoint_without_the_head_serves_no_contacts_and_says_why(tmp_path):
    path = set_contact_head(save_random_checkpoint("esm2", tmp_path / "plain", seed=3), scale=None)
    loaded = load_checkpoint(path, "esm2")
    assert loaded.contacts is None and "contacts" not in loaded.servable()
    report = inspect_checkpoint(path, "esm2")
    assert report.heads["contact"] == "no" and "contacts" not in report.tasks + report.on_request
    assert "has no contact head" in report.not_served["contacts"]
    assert "not served  " in report.render() and "cannot serve contacts" in report.render()
    with pytest.raises(BuildError, match=r"plain has no contact head .* cannot serve contacts"):
        build_repository(BuildRequest(family="esm2", checkpoint=path, name="p", out=tmp_path / "repo",
                                      backend="python", tasks=("embeddings", "contacts"), optimize=False))
    # With the head, inspect lists contacts among the tasks a default build serves (with layers and attentions).
    with_head = inspect_checkpoint(save_random_checkpoint("esm2", tmp_path / "head", seed=3), "esm2")
    assert with_head.heads["contact"] == "yes" and with_head.on_request == []
    assert {"contacts", "layers", "attentions"} <= set(with_head.tasks)


def test_a_mis_shaped_contact_head_is_an_error_naming_the_key(tmp_path):
    from safetensors.torch import load_file, save_file

    path = save_random_checkpoint("esm2", tmp_path / "ck", seed=4)
    weights = load_file(path / "model.safetensors")
    weights[CONTACT_HEAD_KEYS[0]] = torch.zeros(1, 5)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"esm.contact_head.regression.weight is \(1, 5\), expected \(1, 8\)"):
        load_checkpoint(path, "esm2")


@pytest.mark.parametrize("family", ["esm1"])
def test_the_exported_contacts_graph_equals_transformers(tmp_path, family):
    """The stored graph (contacts.onnx beside N_encoder's graph) run by ONNX Runtime, against transformers
    (ESM-2's is served and compared in tests/e2e/test_e2e_contacts.py)."""
    import onnxruntime as ort

    # Seed 3: the ESM-1 that test_layer_states and test_esm1 build, so its encoder graph comes from the
    # run's graph cache (only the contact head differs).
    path = set_contact_head(save_random_checkpoint(family, tmp_path / "ck", seed=3), seed=8)
    result = build_repository(BuildRequest(family=family, checkpoint=path, name="g", out=tmp_path / "repo",
                                           backend="python", tasks=("embeddings", "contacts"), optimize=False))
    session = ort.InferenceSession(str(result.repository / "g_encoder" / "1" / "contacts.onnx"),
                                   providers=["CPUExecutionProvider"])
    reference = transformers.EsmForMaskedLM.from_pretrained(path, attn_implementation="eager").eval()
    ids, mask = reference_tokens(SEQUENCES)
    served = np.asarray(session.run(["contacts"], {"input_ids": ids.numpy(), "attention_mask": mask.numpy()})[0])
    with torch.no_grad():
        expected = reference.predict_contacts(ids, mask).numpy()
    for row, sequence in enumerate(SEQUENCES):  # each sequence's own block (the rest is padding)
        n = len(sequence)
        assert np.abs(served[row, :n, :n] - expected[row, :n, :n]).max() <= 1e-4


def test_an_esm_model_directory_carries_the_head_too(tmp_path):
    """An `EsmModel` saved on its own (keys without the `esm.` prefix): the same head, equal to
    `EsmModel.predict_contacts`."""
    masked = set_contact_head(save_random_checkpoint("esm2", tmp_path / "masked", seed=9), seed=10)
    plain = tmp_path / "plain"
    model = transformers.EsmModel.from_pretrained(masked, add_pooling_layer=False, attn_implementation="eager").eval()
    model.save_pretrained(plain)
    (plain / "vocab.txt").write_text((masked / "vocab.txt").read_text())
    loaded = load_checkpoint(plain, "esm2")
    assert loaded.contacts is not None and loaded.lm_head is None
    ids, mask = reference_tokens(SEQUENCES)
    with torch.no_grad():
        np.testing.assert_allclose(loaded.contacts(ids, mask).numpy(), model.predict_contacts(ids, mask).numpy(),
                                   atol=1e-5)


def test_a_fair_esm_file_answers_what_fair_esm_predicts(tmp_path):
    """A fair-esm ESM-2 file with its -contact-regression.pt (read as the Hugging Face checkpoint it
    maps to) against fair-esm's own `ESM2(..., return_contacts=True)`: a second, independent reference."""
    import argparse

    esm = pytest.importorskip("esm")
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    model = esm.model.esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4, alphabet=alphabet, token_dropout=True)
    generator = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            scale = 1000.0 if name == "contact_head.regression.weight" else 0.2
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
    model.eval()
    state = model.state_dict()
    stored = {(f"encoder.{key}" if key.startswith("lm_head") else f"encoder.sentence_encoder.{key}"): value
              for key, value in state.items() if not key.startswith("contact_head")}
    cfg = {"model": argparse.Namespace(encoder_layers=2, encoder_embed_dim=32, encoder_attention_heads=4,
                                       token_dropout=True, arch="esm2"), "common": {"seed": 1}}
    torch.save({"model": stored, "cfg": cfg}, tmp_path / "esm2_t2_tiny.pt")
    torch.save({"model": {k: v for k, v in state.items() if k.startswith("contact_head")}},
               tmp_path / "esm2_t2_tiny-contact-regression.pt")
    loaded = load_checkpoint(tmp_path / "esm2_t2_tiny.pt", "esm2")
    assert loaded.contacts is not None
    _, _, tokens = alphabet.get_batch_converter()([(str(i), s) for i, s in enumerate(SEQUENCES)])
    mask = tokens.ne(alphabet.padding_idx).long()
    with torch.no_grad():
        expected = model(tokens, return_contacts=True)["contacts"].numpy()
        served = loaded.contacts(tokens, mask).numpy()
    assert expected[0].std() > 0.05
    for row, sequence in enumerate(SEQUENCES):
        n = len(sequence)
        assert np.abs(served[row, :n, :n] - expected[row, :n, :n]).max() <= 1e-4
