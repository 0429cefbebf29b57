"""The writer of random checkpoints of real shapes (bionemo_export/testing/large_checkpoints.py),
at tiny sizes: its folders are what the project's reader and transformers' own classes read, the
same model either way, and its safetensors file is written tensor by tensor in the stored dtype."""

from __future__ import annotations

import json
import struct

import pytest
import torch
import transformers

from bionemo_export.models import load_checkpoint
from bionemo_export.testing.checkpoints import save_random_checkpoint
from bionemo_export.testing.large_checkpoints import ESM2_SHAPES, ESMC_SHAPES, write_random_checkpoint

TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64}


def _header(path) -> dict:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


@pytest.mark.parametrize(("family", "reference_class", "stored"), [
    ("esm2", transformers.EsmModel, "F32"), ("esmc", transformers.EsmcModel, "BF16")])
def test_a_written_checkpoint_is_the_same_model_to_our_reader_and_to_transformers(tmp_path, family, reference_class,
                                                                                  stored):
    """The folder loads through the Hugging Face reader (with its masked-LM head, and for ESM-2
    its contact head) and its encoder answers what transformers' model from the same folder
    answers, bit for bit; the weights are stored as the released checkpoints store them."""
    folder = write_random_checkpoint(family, tmp_path / family, TINY, seed=3)
    header = _header(folder / "model.safetensors")
    assert {entry["dtype"] for name, entry in header.items() if name != "__metadata__"} == {stored}
    loaded = load_checkpoint(folder, family)
    assert loaded.lm_head is not None and (loaded.contacts is not None) == (family == "esm2")
    reference = reference_class.from_pretrained(str(folder), dtype=torch.float32).eval()
    encoded = loaded.tokenizer.encode(["MKTAYIAKQR", "LAGVSE"], truncate=False)
    ids, mask = torch.as_tensor(encoded.input_ids), torch.as_tensor(encoded.attention_mask)
    with torch.inference_mode():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        hiddens, _ = loaded.encoder(ids, mask, torch.as_tensor(encoded.residue_mask))
    valid = mask.bool()
    assert torch.equal(hiddens[valid], expected[valid])
    assert 0.1 < float(hiddens[valid].std()) < 10  # the activations of a model, not zeros or overflow


@pytest.mark.parametrize("family", ["esm2", "esmc"])
def test_the_written_tensors_are_those_save_pretrained_writes(tmp_path, family):
    """Same names (LayerNorm's modern weight/bias names aside, which save_pretrained writes as
    gamma/beta for ESM-2 and both readers accept) and shapes as save_pretrained's file of the same
    config; the data follows the header with no gap, in the header's order."""
    written = _header(write_random_checkpoint(family, tmp_path / "big", TINY) / "model.safetensors")
    saved = _header(save_random_checkpoint(family, tmp_path / "saved", **TINY) / "model.safetensors")

    def shapes(header: dict) -> dict:
        renamed = {name.replace(".gamma", ".weight").replace(".beta", ".bias"): entry["shape"]
                   for name, entry in header.items() if name != "__metadata__"}
        return {name: shape for name, shape in renamed.items() if "inv_freq" not in name}

    assert shapes(written) == shapes(saved)
    spans = sorted(entry["data_offsets"] for name, entry in written.items() if name != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_the_released_shapes_are_named():
    assert ESM2_SHAPES["esm2_t36_3B"] == {"num_layers": 36, "hidden_size": 2560, "num_heads": 40,
                                          "intermediate_size": 10240}
    assert ESMC_SHAPES["esmc_600m"]["hidden_size"] == 1152
    with pytest.raises(ValueError, match="unknown esm2 shape 'esm2_t99'.*esm2_t30_150M"):
        write_random_checkpoint("esm2", "/nonexistent", "esm2_t99")
