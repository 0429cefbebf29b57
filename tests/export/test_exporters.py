"""ONNX export (torch.onnx and Model Navigator) and verification against PyTorch."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

from bionemo_export.exporters import (
    ExportVerificationError,
    NavigatorUnavailableError,
    SignatureError,
    available_exporters,
    export_onnx,
    navigator,
    onnx_export,
    tensorrt_available,
    verify_onnx,
)
from bionemo_export.exporters.verification import ReferenceAnswers, write_golden_answers
from bionemo_export.models import get_family
from bionemo_export.models.base import ENCODER_INPUTS, encoder_outputs
from bionemo_export.testing.checkpoints import save_random_checkpoint

HIDDEN = 32
OUTPUTS = encoder_outputs(HIDDEN)
SHAPES = [(batch, length) for batch in (1, 3) for length in (5, 17, 40)]


class TinyEncoder(torch.nn.Module):
    """PooledEncoder's signature around one nn.TransformerEncoderLayer. Its attention is
    nn.MultiheadAttention, which the legacy TorchScript exporter bakes to the traced length."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():  # fixed weights without touching the global RNG
            torch.manual_seed(0)
            self.embed = torch.nn.Embedding(24, HIDDEN)
            self.layer = torch.nn.TransformerEncoderLayer(
                HIDDEN, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True
            )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, residue_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hiddens = self.layer(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        weights = residue_mask.unsqueeze(-1).to(hiddens.dtype)
        return hiddens, (hiddens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


def make_batch(batch: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens; the second item is half padding; residues exclude the first and last token."""
    rng = np.random.default_rng(seed)
    lengths = np.full(batch, length)
    if batch > 1:
        lengths[1] = max(length // 2, 3)
    positions = np.arange(length)
    attention_mask = (positions < lengths[:, None]).astype(np.int64)
    input_ids = np.where(attention_mask == 1, rng.integers(3, 24, (batch, length)), 0)
    residue_mask = (positions > 0) & (positions < lengths[:, None] - 1)
    return {"input_ids": input_ids.astype(np.int64), "attention_mask": attention_mask,
            "residue_mask": residue_mask}


def run_both(module: torch.nn.Module, onnx_path: Path,
             batch: dict[str, np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(ONNX Runtime outputs, PyTorch outputs) for one batch."""
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        expected = [t.numpy() for t in module(*(torch.from_numpy(batch[s.name]) for s in ENCODER_INPUTS))]
    outputs = session.run(None, batch)
    dense = [output for output in outputs if isinstance(output, np.ndarray)]
    assert len(dense) == len(outputs), f"ONNX Runtime returned {[type(output).__name__ for output in outputs]}"
    return dense, expected


def assert_matches_torch(module: torch.nn.Module, onnx_path: Path, atol: float) -> None:
    """ORT and PyTorch agree at every shape in SHAPES (hiddens on real positions only)."""
    for batch_size, length in SHAPES:
        batch = make_batch(batch_size, length, seed=batch_size * 100 + length)
        (hiddens, embeddings), (ref_hiddens, ref_embeddings) = run_both(module, onnx_path, batch)
        assert hiddens.shape == (batch_size, length, HIDDEN)
        assert embeddings.shape == (batch_size, HIDDEN)
        valid = batch["attention_mask"] == 1
        np.testing.assert_allclose(hiddens[valid], ref_hiddens[valid], atol=atol, rtol=0)
        np.testing.assert_allclose(embeddings, ref_embeddings, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def tiny() -> TinyEncoder:
    return TinyEncoder().eval()


@pytest.fixture(scope="module")
def tiny_export(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny") / "model.onnx"
    return export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, make_batch(2, 12), out)


def test_torch_export_has_exactly_the_declared_signature(tiny_export):
    assert tiny_export.exporter == "torch" and tiny_export.torch_exporter == "dynamo"
    assert tiny_export.opset == onnx_export.DEFAULT_OPSET
    assert not tiny_export.external_data and tiny_export.data_path is None
    assert tiny_export.onnx_bytes == tiny_export.path.stat().st_size
    assert tiny_export.parameters == sum(p.numel() for p in TinyEncoder().parameters())
    json.dumps(tiny_export.to_dict())

    model = onnx.load(str(tiny_export.path))
    types = {v.name: v.type.tensor_type for v in [*model.graph.input, *model.graph.output]}
    assert [v.name for v in model.graph.input] == ["input_ids", "attention_mask", "residue_mask"]
    assert [v.name for v in model.graph.output] == ["hiddens", "embeddings"]
    assert types["residue_mask"].elem_type == onnx.TensorProto.BOOL
    assert types["input_ids"].elem_type == onnx.TensorProto.INT64
    assert types["hiddens"].elem_type == onnx.TensorProto.FLOAT
    dims = {name: [d.dim_param or d.dim_value for d in t.shape.dim] for name, t in types.items()}
    assert dims["input_ids"] == ["batch", "length"]
    assert dims["hiddens"] == ["batch", "length", HIDDEN]
    assert dims["embeddings"] == ["batch", HIDDEN]
    # No source paths or stack traces in the shipped file.
    assert not any(node.metadata_props for node in model.graph.node)


def test_torch_export_is_dynamic_in_batch_and_length(tiny, tiny_export):
    assert_matches_torch(tiny, tiny_export.path, atol=1e-5)


@pytest.mark.parametrize("how", ["forced", "automatic"])
def test_external_data_writes_one_weights_file_and_still_matches(tiny, tmp_path, monkeypatch, how):
    if how == "automatic":  # pretend the tiny model is as big as ESM-2 650M
        monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD_BYTES", 1000)
    out = tmp_path / "model.onnx"
    result = export_onnx(
        tiny, ENCODER_INPUTS, OUTPUTS, make_batch(2, 12), out,
        external_data=True if how == "forced" else None,
    )
    assert result.external_data
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert result.data_path == tmp_path / "model.onnx.data"
    assert result.data_bytes >= result.weight_bytes - 1024 and result.onnx_bytes < result.data_bytes
    assert_matches_torch(tiny, out, atol=1e-5)


def test_external_data_cannot_be_refused_for_models_over_2_gib(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "PROTOBUF_LIMIT_BYTES", 1000)
    with pytest.raises(ValueError, match="external_data=True"):
        export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, make_batch(2, 12), tmp_path / "m.onnx",
                    external_data=False)


def test_bad_requests_are_named(tiny, tmp_path):
    with pytest.raises(ValueError, match="torch, navigator"):
        export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, make_batch(2, 12), tmp_path / "m.onnx",
                    exporter="tensorrt")
    sample = make_batch(2, 12)
    sample["residue_mask"] = sample["residue_mask"].astype(np.int64)
    with pytest.raises(SignatureError, match="residue_mask.*int64.*expected bool"):
        export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, sample, tmp_path / "m.onnx")
    del sample["residue_mask"]
    with pytest.raises(SignatureError, match="lacks \\['residue_mask'\\]"):
        export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, sample, tmp_path / "m.onnx")


def verification_batches() -> list[dict[str, np.ndarray]]:
    return [make_batch(b, length, seed=b + length) for b, length in SHAPES]


def test_verification_passes_on_a_faithful_export(tiny, tiny_export):
    report = verify_onnx(tiny, tiny_export.path, verification_batches(), atol=1e-5, min_cosine=0.99999)
    assert report.passed and not report.failures
    report.raise_for_tolerance()
    assert [c.name for c in report.outputs] == ["hiddens", "embeddings"]
    assert report.batch_shapes == tuple(SHAPES)
    hiddens = report.outputs[0]
    assert hiddens.shapes[-1] == (3, 40, HIDDEN) and hiddens.max_abs_error < 1e-5
    assert json.loads(json.dumps(report.to_dict()))["batches"] == len(SHAPES)


def test_the_reference_runs_once_for_every_graph_checked_against_it(tiny, tiny_export, tmp_path):
    """A build checks the plain export, each optimization candidate and the golden answers on the
    same batches: PyTorch answers them once (ReferenceAnswers), and every check reads those answers."""
    calls = []
    handle = tiny.register_forward_hook(lambda module, args, output: calls.append(args[0].shape))
    batches = verification_batches()
    answers = ReferenceAnswers(tiny, batches)
    try:
        first = verify_onnx(tiny, tiny_export.path, batches, atol=1e-5, min_cosine=0.99999, answers=answers)
        again = verify_onnx(tiny, tiny_export.path, batches, atol=1e-5, min_cosine=0.99999, answers=answers)
        golden = write_golden_answers(answers, again, tmp_path / "golden")
    finally:
        handle.remove()
    assert len(calls) == len(SHAPES)  # one forward per batch, for two checks and the golden answers
    assert first.passed and again.outputs == first.outputs
    with np.load(golden) as stored:  # the first batch and PyTorch's answers on it
        np.testing.assert_array_equal(stored["input:input_ids"], batches[0]["input_ids"])
        with torch.no_grad():
            _, embeddings = tiny(*(torch.from_numpy(batches[0][spec.name]) for spec in ENCODER_INPUTS))
        np.testing.assert_array_equal(stored["reference:embeddings"], embeddings.numpy())
    with pytest.raises(ValueError, match="another module or other batches"):
        verify_onnx(tiny, tiny_export.path, verification_batches(), atol=1e-5, min_cosine=0.99999, answers=answers)


def test_verification_fails_when_the_graph_is_perturbed(tiny, tiny_export, tmp_path):
    model = onnx.load(str(tiny_export.path))
    largest = max(model.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    weights = numpy_helper.to_array(largest).copy()
    weights[0] += 0.5  # one row of one weight matrix
    largest.CopyFrom(numpy_helper.from_array(weights, largest.name))
    perturbed = tmp_path / "perturbed.onnx"
    onnx.save(model, str(perturbed))

    report = verify_onnx(tiny, perturbed, verification_batches(), atol=1e-4, min_cosine=0.9999)
    assert not report.passed
    assert "hiddens" in [c.name for c in report.failures]
    failing_figures = r"hiddens: max abs error [0-9.e-]+ \(allowed 0.0001\)"
    with pytest.raises(ExportVerificationError, match=failing_figures) as caught:
        report.raise_for_tolerance()
    assert caught.value.report is report
    assert json.loads(json.dumps(report.to_dict()))["passed"] is False


class PaddingNoise(torch.nn.Module):
    """The tiny encoder with its hiddens changed at padded positions only (don't-care)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, residue_mask):
        hiddens, embeddings = self.inner(input_ids, attention_mask, residue_mask)
        return hiddens + 100.0 * (attention_mask == 0).unsqueeze(-1), embeddings


class NaNEmbeddings(PaddingNoise):
    def forward(self, input_ids, attention_mask, residue_mask):
        hiddens, embeddings = self.inner(input_ids, attention_mask, residue_mask)
        return hiddens, embeddings * float("nan")


def test_verification_ignores_padding_but_fails_on_nan(tiny, tiny_export):
    batches = verification_batches()
    padded = verify_onnx(PaddingNoise(tiny), tiny_export.path, batches, atol=1e-5, min_cosine=0.99999)
    assert padded.passed
    nan = verify_onnx(NaNEmbeddings(tiny), tiny_export.path, batches, atol=1e-5, min_cosine=0.99999)
    assert [c.name for c in nan.failures] == ["embeddings"]
    assert nan.to_dict()["outputs"][1]["max_abs_error"] == "nan"
    with pytest.raises(ExportVerificationError, match="embeddings: max abs error nan"):
        nan.raise_for_tolerance()


def test_navigator_is_optional_with_a_clear_error(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(navigator, "_import_result", lambda: "import model_navigator failed: boom")
    assert available_exporters() == ("torch",)
    with pytest.raises(NavigatorUnavailableError, match="boom.*scripts/setup.sh.*exporter='torch'"):
        export_onnx(tiny, ENCODER_INPUTS, OUTPUTS, make_batch(2, 12), tmp_path / "m.onnx",
                    exporter="navigator")


def test_tensorrt_is_reported_absent_without_its_package(monkeypatch):
    # A None entry in sys.modules makes `import tensorrt` raise ImportError, as on a host without
    # the package, whether or not this one has it.
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    assert tensorrt_available() is False


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="TensorRT is not installed here")
def test_tensorrt_is_reported_available_exactly_where_it_imports_and_a_gpu_is_visible():
    """With the package installed, what decides is whether it loads (PyPI's stub wheel without its
    downloaded libraries does not) and whether an NVIDIA GPU can run the engines."""
    try:
        importlib.import_module("tensorrt")  # optional: not a static import
    except Exception:  # ImportError, or OSError/RuntimeError from the stub wheel
        expected = False
    else:
        expected = torch.cuda.is_available()
    assert tensorrt_available() is expected


@pytest.mark.parametrize("family_name", ["esm2", "bert"])
def test_family_encoder_exports_and_verifies_at_several_lengths(family_name, tmp_path):
    family = get_family(family_name)
    loaded = family.load(save_random_checkpoint(family.name, tmp_path / "checkpoint"))
    sequences = family.sample_sequences()

    def encode(group: list[str]) -> dict[str, np.ndarray]:
        encoded = loaded.tokenizer.encode(group)
        return {s.name: getattr(encoded, s.name) for s in ENCODER_INPUTS}

    result = export_onnx(
        loaded.encoder, loaded.inputs, loaded.outputs, encode(sequences[1:3]), tmp_path / "model.onnx"
    )
    batches = [encode(sequences[:1]), encode(sequences[2:5]), encode(sequences)]
    assert len({b["input_ids"].shape for b in batches}) == 3  # three different shapes
    report = verify_onnx(loaded.encoder, result.path, batches, atol=1e-4, min_cosine=family.min_cosine)
    report.raise_for_tolerance()
    assert all(check.max_abs_error < 1e-4 for check in report.outputs)
