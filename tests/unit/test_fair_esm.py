"""fair-esm's .pt files (readers/fair_esm.py, models/fair_esm.py) against fair-esm itself: tiny
random ESM-2 and ESM-1b models of fair-esm's own classes, saved as its hub files are laid out, read
by this project and by fair-esm's own loader (`esm.pretrained.load_model_and_alphabet_core`); the
hidden states and the masked-LM log-probabilities agree. And what must be refused is, without
running a byte of the pickle's code."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

esm = pytest.importorskip("esm")  # fair-esm, the reference (requirements/runtime.txt)

from bionemo_export.models.base import load_checkpoint  # noqa: E402
from bionemo_export.models.readers import CheckpointError, read_checkpoint  # noqa: E402
from bionemo_export.models.readers.base import describe_checkpoint  # noqa: E402
from tests.helpers.loaded_outputs import masked_lm_outputs  # noqa: E402

SEQUENCES = ["MKTAYIAKQR", "MSLKRKNIALIPAAGIGVRFG", "LAGVSERTIDPKQNFYMHWC"]
MASKED = ["MKT<mask>YIAKQR", "MSLKRK<mask>IALIP<mask>AGIGVRFG", "LAGVSERTIDPKQNFYMHWC"]


def _random(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)
    return model.eval()


def _hub_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fair-esm module's state dict under the names its hub files store (fairseq's)."""
    return {(f"encoder.{key}" if key.startswith("lm_head") else f"encoder.sentence_encoder.{key}"): value
            for key, value in state.items() if not key.startswith("contact_head")}


def _esm2_file(folder: Path, name: str = "esm2_t2_tiny", regression: bool = True) -> tuple[Path, Any]:
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    model = _random(esm.model.esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4, alphabet=alphabet,
                                        token_dropout=True), seed=1)
    cfg = {"model": argparse.Namespace(encoder_layers=2, encoder_embed_dim=32, encoder_attention_heads=4,
                                       token_dropout=True, arch="esm2"), "common": {"seed": 1}}
    path = folder / f"{name}.pt"
    torch.save({"model": _hub_names(model.state_dict()), "cfg": cfg}, path)
    if regression:
        head = {k: v for k, v in model.state_dict().items() if k.startswith("contact_head")}
        torch.save({"model": head}, folder / f"{name}-contact-regression.pt")
    return path, alphabet


def _esm1b_file(folder: Path, name: str = "esm1v_t2_tiny_1", seed: int = 2) -> tuple[Path, Any]:
    alphabet = esm.data.Alphabet.from_architecture("ESM-1b")
    args = argparse.Namespace(arch="roberta_large", layers=2, embed_dim=32, ffn_embed_dim=64, attention_heads=4,
                              max_positions=64, emb_layer_norm_before=True, token_dropout=True)
    model = _random(esm.model.esm1.ProteinBertModel(args, alphabet), seed=seed)
    stored = argparse.Namespace(arch="roberta_large", encoder_layers=2, encoder_embed_dim=32,
                                encoder_ffn_embed_dim=64, encoder_attention_heads=4, max_positions=64,
                                token_dropout=True)  # fairseq's names, as the released files hold them
    path = folder / f"{name}.pt"
    torch.save({"model": _hub_names(model.state_dict()), "args": stored}, path)
    return path, alphabet


def _reference(path: Path) -> Any:
    """fair-esm's own model of the file, loaded by fair-esm's own loader (torch.load's default is
    weights_only now: the test trusts the Namespace it wrote)."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        model, _ = esm.pretrained.load_model_and_alphabet_local(path)
    return model.eval()


def _compare(path: Path, alphabet: Any, sequences: list[str]) -> tuple[float, float]:
    """(max abs difference of the last hidden states over the real tokens, of the log-probabilities
    over the residue alphabet) between this project's reading of `path` and fair-esm's."""
    loaded = load_checkpoint(path)
    reference = _reference(path)
    _, _, tokens = alphabet.get_batch_converter()([(str(i), s) for i, s in enumerate(sequences)])
    layers = len(reference.layers)
    with torch.no_grad():
        expected = reference(tokens, repr_layers=[layers])
    got = masked_lm_outputs(loaded, [s.replace("<mask>", "_") for s in sequences])
    assert np.array_equal(got.encoded.input_ids, tokens.numpy())  # the same tokens, <mask> included
    hidden_error = (got.hiddens - expected["representations"][layers]).abs()[got.real].max().item()
    wanted = torch.log_softmax(expected["logits"][..., got.alphabet_ids], dim=-1)
    return hidden_error, (got.log_probs - wanted).abs()[got.real].max().item()


def test_an_esm2_file_reads_as_fair_esm_computes_it(tmp_path):
    path, alphabet = _esm2_file(tmp_path)
    checkpoint = read_checkpoint(path)
    assert checkpoint.form == "fair_esm" and checkpoint.model_class == "ESM-2"
    assert describe_checkpoint(checkpoint) == \
        "fair-esm ESM-2 file esm2_t2_tiny.pt + esm2_t2_tiny-contact-regression.pt"
    assert "esm.contact_head.regression.weight" not in checkpoint.weights  # stored names, as read
    assert "contact_head.regression.weight" in checkpoint.weights
    hidden_error, log_prob_error = _compare(path, alphabet, MASKED)
    assert hidden_error < 1e-5 and log_prob_error < 1e-5, (hidden_error, log_prob_error)


def test_an_esm1v_file_reads_as_fair_esm_computes_it(tmp_path):
    path, alphabet = _esm1b_file(tmp_path)
    assert read_checkpoint(path).model_class == "ESM-1v"
    hidden_error, log_prob_error = _compare(path, alphabet, MASKED)
    assert hidden_error < 1e-5 and log_prob_error < 1e-5, (hidden_error, log_prob_error)
    assert load_checkpoint(path).tokenizer.max_length == 64  # fair-esm's max_positions


@pytest.mark.parametrize("family", ["esm1", "bert"])
def test_a_file_named_for_another_family_is_refused(tmp_path, family):
    path, _ = _esm2_file(tmp_path, regression=False)
    with pytest.raises(CheckpointError, match=f"which the esm2 family reads, not {family}: use `family` esm2"):
        load_checkpoint(path, family)


def test_files_that_are_not_esm_models_are_refused_by_name(tmp_path):
    torch.save({"model": {"encoder.sentence_encoder.embed_tokens.weight": torch.zeros(33, 8)},
                "args": argparse.Namespace(arch="protein_bert_base", layers=1)}, tmp_path / "esm1_t6.pt")
    with pytest.raises(CheckpointError, match="architecture 'protein_bert_base' is not served"):
        load_checkpoint(tmp_path / "esm1_t6.pt")
    torch.save({"state": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"other.pt is not a fair-esm checkpoint: expected a dict with 'model'"):
        read_checkpoint(tmp_path / "other.pt")
    torch.save({"model": {"encoder.x": [1, 2]}, "cfg": {}}, tmp_path / "lists.pt")
    with pytest.raises(CheckpointError, match="entries that are not named tensors: encoder.x"):
        read_checkpoint(tmp_path / "lists.pt")
    path, _ = _esm2_file(tmp_path)
    with pytest.raises(CheckpointError, match=r"is a contact regression file: give the model file beside it "
                                              r"\(esm2_t2_tiny.pt\)"):
        read_checkpoint(tmp_path / "esm2_t2_tiny-contact-regression.pt")


class _Hostile:
    """Pickles as a call of os.system: what a full unpickler would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_by_name_and_never_run(tmp_path):
    """(tests/unit/test_hostile_checkpoints.py runs every hostile form against every file.)"""
    marker = tmp_path / "ran"
    torch.save({"model": {"encoder.sentence_encoder.embed_tokens.weight": _Hostile(marker)},
                "cfg": {"model": _Hostile(marker)}}, tmp_path / "esm2_t1_bad.pt", pickle_module=pickle)
    with pytest.raises(CheckpointError, match=r"esm2_t1_bad\.pt: it holds pickled code or objects other than "
                                              r"tensors \(posix\.system\), which will not be run; refusing it$"):
        read_checkpoint(tmp_path / "esm2_t1_bad.pt")
    assert not marker.exists()  # os.system was named, never called
