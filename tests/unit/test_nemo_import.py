"""`.nemo` import without NeMo: ESM-2nv and MegaMolBART archives written from small random models
by the documented layout (tests/helpers/nemo_archives.py) import to models whose outputs equal the
source's; the reader refuses unsafe and malformed archives with one-line errors naming the file."""

from __future__ import annotations

import dataclasses
import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file
from transformers.models.esm.modeling_esm import EsmLayer

from bionemo_export.generation.reference import reference_greedy
from bionemo_export.models import LoadedModel, get_family, load_checkpoint
from bionemo_export.models.encoder import PooledEncoder
from bionemo_export.models.megamolbart import DecoderFull, MegaMolBart, MegaMolBartEncoder, load_model
from bionemo_export.models.readers import CheckpointError, bounded_tar, read_checkpoint
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers.nemo_archives import (
    UUID,
    esm2_to_megatron,
    esm2nv_config,
    megamolbart_config,
    megamolbart_to_nemo,
    write_nemo,
)

PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "MSLKRKNIALIPAAGIGVRFG", "AC", "LAGVSERTIDPKQNFYMHWCXBUZO"]


# ------------------------------------------------------------------------------------ ESM-2nv
@pytest.fixture(scope="module")
def esm2_source(tmp_path_factory) -> Path:
    """A random Hugging Face ESM-2 (EsmForMaskedLM) folder: the source of the archives."""
    return save_random_checkpoint("esm2", tmp_path_factory.mktemp("esm2"), seed=5, hidden_size=64,
                                  num_layers=2, num_heads=4, intermediate_size=96)


def esm2_archive(source: Path, path: Path, *, gzip: bool = False, weights_edit=None, **overrides) -> Path:
    config = transformers.EsmConfig.from_pretrained(source)
    weights = esm2_to_megatron(load_file(source / "model.safetensors"), config.num_hidden_layers,
                               config.num_attention_heads)
    if weights_edit:
        weights_edit(weights)
    return write_nemo(path, esm2nv_config(config, **overrides), weights, gzip=gzip)


def hf_reference(source: Path, sequences: list[str], *, tanh: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(hiddens, residue-mean embeddings) from transformers' own EsmModel and EsmTokenizer."""
    model = transformers.EsmModel.from_pretrained(source, add_pooling_layer=False).eval()
    if tanh:  # what Megatron's fused bias-GELU computes, in place of each intermediate's exact GELU
        for layer in model.encoder.layer:
            assert isinstance(layer, EsmLayer)
            layer.intermediate.register_forward_hook(
                lambda _module, inputs, _exact, dense=layer.intermediate.dense: torch.nn.functional.gelu(
                    dense(inputs[0]), approximate="tanh"))
    tokenizer = transformers.EsmTokenizer(vocab_file=str(source / "vocab.txt"))
    batch = tokenizer(sequences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hiddens = model(**batch).last_hidden_state.numpy()
    lengths = np.array([len(s) for s in sequences])
    embeddings = np.stack([hiddens[i, 1:1 + n].mean(axis=0) for i, n in enumerate(lengths)])
    return hiddens, embeddings


def esm_backbone(loaded: LoadedModel) -> transformers.EsmModel:
    """The transformers EsmModel an ESM-2 checkpoint loads into (inside the pooling encoder)."""
    assert isinstance(loaded.encoder, PooledEncoder), loaded.encoder
    assert isinstance(loaded.encoder.backbone, transformers.EsmModel), loaded.encoder.backbone
    return loaded.encoder.backbone


def run_encoder(loaded, sequences):
    encoded = loaded.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in
                                               (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens.numpy(), embeddings.numpy(), encoded


@pytest.mark.parametrize("gzip", [False, True])
def test_esm2nv_archive_equals_the_hugging_face_model(esm2_source, tmp_path, gzip):
    archive = esm2_archive(esm2_source, tmp_path / "esm2nv.nemo", gzip=gzip)
    loaded = load_checkpoint(archive)  # no family named: the archive's target says esm2
    assert loaded.family.name == "esm2"
    assert loaded.description["checkpoint_form"] == (
        ".nemo archive (bionemo.model.protein.esm1nv.esm1nv_model.ESM2nvModel)")
    assert loaded.tokenizer.vocab_size == 33 and loaded.tokenizer.max_length == 1024
    hiddens, embeddings, encoded = run_encoder(loaded, PROTEINS)
    expected_hiddens, expected_embeddings = hf_reference(esm2_source, PROTEINS)
    real = encoded.attention_mask.astype(bool)
    np.testing.assert_allclose(hiddens[real], expected_hiddens[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(embeddings, expected_embeddings, atol=1e-5, rtol=0)


def test_esm2nv_token_dropout_scaling_follows_the_config(esm2_source, tmp_path):
    """ESM-2nv scales embeddings by (1 - 0.15 * 0.8) / (1 - mask fraction); a `<mask>` in the input
    changes the fraction, so with and without the setting the outputs differ."""
    with_scaling = load_checkpoint(esm2_archive(esm2_source, tmp_path / "a.nemo"))
    without = load_checkpoint(esm2_archive(esm2_source, tmp_path / "b.nemo", embedding_token_dropout=False))
    assert esm_backbone(with_scaling).config.token_dropout and not esm_backbone(without).config.token_dropout
    a, _, _ = run_encoder(with_scaling, PROTEINS[:1])
    b, _, _ = run_encoder(without, PROTEINS[:1])
    assert np.abs(a - b).max() > 1e-4  # scaled by 0.88 / 1: clearly different


def test_esm2nv_fused_gelu_is_the_tanh_approximation(esm2_source, tmp_path):
    archive = esm2_archive(esm2_source, tmp_path / "tanh.nemo", esm_gelu=False, bias_gelu_fusion=True)
    loaded = load_checkpoint(archive)
    assert loaded.description["activation"] == "gelu_tanh"
    hiddens, _, encoded = run_encoder(loaded, PROTEINS)
    real = encoded.attention_mask.astype(bool)
    tanh_hiddens, _ = hf_reference(esm2_source, PROTEINS, tanh=True)
    exact_hiddens, _ = hf_reference(esm2_source, PROTEINS)
    np.testing.assert_allclose(hiddens[real], tanh_hiddens[real], atol=1e-5, rtol=0)
    assert np.abs(hiddens[real] - exact_hiddens[real]).max() > 10 * np.abs(hiddens[real] - tanh_hiddens[real]).max()


# -------------------------------------------------------------------------------- MegaMolBART
SMILES = ["CCO", "c1ccccc1O", "CC(=O)Oc1ccccc1C(=O)O", "CN1C=NC2=C1C(=O)N(C(=O)N2C)C", "Clc1ccc(Br)cc1I"]


@pytest.fixture(scope="module")
def megamolbart_source(tmp_path_factory) -> tuple[MegaMolBart, list[str]]:
    folder = save_random_checkpoint("megamolbart", tmp_path_factory.mktemp("mmb"), seed=11, hidden_size=32,
                                    num_layers=2, num_heads=4)
    model, vocab, _ = load_model(folder)
    return model, vocab


def megamolbart_archive(model: MegaMolBart, vocab: list[str], path: Path, *, nested=False, gzip=False,
                        head="weight and bias", weights_edit=None, artifacts_edit=None, **overrides) -> Path:
    weights = megamolbart_to_nemo(model.state_dict(), model.config, head=head)
    if weights_edit:
        weights_edit(weights)
    config, artifacts = megamolbart_config(model.config, vocab, nested=nested, **overrides)
    if artifacts_edit:
        artifacts_edit(artifacts)
    return write_nemo(path, config, weights, artifacts, gzip=gzip)


def seq2seq_outputs(loaded, smiles):
    encoded = loaded.tokenizer.encode(smiles)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in
                                               (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens, embeddings, torch.from_numpy(encoded.residue_mask)


@pytest.mark.parametrize(("nested", "gzip"), [(False, False), (True, True)])
def test_megamolbart_archive_equals_the_source_model(megamolbart_source, tmp_path, nested, gzip):
    model, vocab = megamolbart_source
    loaded = load_checkpoint(megamolbart_archive(model, vocab, tmp_path / "mmb.nemo", nested=nested, gzip=gzip))
    assert loaded.family.name == "megamolbart"
    assert loaded.tokenizer.vocab == tuple(vocab)
    hiddens, _, mask = seq2seq_outputs(loaded, SMILES)
    encoded = loaded.tokenizer.encode(SMILES)
    with torch.no_grad():
        expected = model.encode(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
        torch.testing.assert_close(hiddens, expected, atol=1e-5, rtol=0)
        tokens = torch.tensor([[2, 7, 8, 9], [2, 10, 11, 12], [2, 6, 6, 6], [2, 9, 8, 7], [2, 13, 14, 15]])
        assert loaded.seq2seq is not None
        logits = loaded.seq2seq.decoder_full(tokens, hiddens, mask)
        source_logits = model.decode(tokens, mask, *model.cross_kv(hiddens))[0]
    # The source's vocabulary is the tokenizer's: the import keeps exactly those rows.
    assert logits.shape[-1] == len(vocab)
    torch.testing.assert_close(logits, source_logits, atol=1e-5, rtol=0)


def test_megamolbart_decodes_equal_the_source_and_never_a_padded_id(megamolbart_source, tmp_path):
    """Padded vocabulary rows made irresistible (bias 1e4) in the archive are cut on import:
    the greedy decode equals the source model's, every id is a real token."""
    model, vocab = megamolbart_source

    def poison_padding(weights):
        weights["enc_dec_model.tokens_head.bias"][len(vocab):] = 1e4

    loaded = load_checkpoint(megamolbart_archive(model, vocab, tmp_path / "mmb.nemo", weights_edit=poison_padding))
    hiddens, _, mask = seq2seq_outputs(loaded, SMILES)
    assert loaded.seq2seq is not None
    decoded = reference_greedy(loaded.seq2seq, hiddens.numpy(), mask.numpy(), max_length=12)
    source = get_family("megamolbart").load  # the source, through its saved form
    del source
    with torch.no_grad():
        tokens = torch.full((len(SMILES), 1), 2)
        for _ in range(12):
            nxt = model.decode(tokens, mask, *model.cross_kv(hiddens))[0][:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
    expected = [[int(t) for t in row[1:]] for row in tokens]
    for got, want in zip(decoded, expected):
        want = want[:want.index(3)] if 3 in want else want
        assert got == want
    assert all(0 <= t < len(vocab) for row in decoded for t in row)


def test_saved_form_with_a_padded_vocabulary_never_decodes_a_padded_id(tmp_path):
    """A saved-form model whose vocab_size exceeds its vocabulary: the extra output rows (biased to
    win every argmax) are cut, so decoding yields only real tokens."""
    family = get_family("megamolbart")
    folder = save_random_checkpoint(family.name, tmp_path / "small", seed=2)
    model, vocab, _ = load_model(folder)
    padded = MegaMolBart(dataclasses.replace(model.config, vocab_size=128))
    state = padded.state_dict()
    for key, tensor in model.state_dict().items():
        state[key][: tensor.shape[0]] = tensor
    state["tokens_head.bias"][len(vocab):] = 1e4
    padded.load_state_dict(state)
    from bionemo_export.models.megamolbart import save

    loaded = family.load(save(padded, vocab, tmp_path / "padded"))
    assert loaded.seq2seq is not None and loaded.seq2seq.vocab_size == len(vocab)
    hiddens, _, mask = seq2seq_outputs(loaded, SMILES)
    decoded = reference_greedy(loaded.seq2seq, hiddens.numpy(), mask.numpy(), max_length=8)
    assert all(0 <= t < len(vocab) for row in decoded for t in row)


def test_megamolbart_tied_head_uses_the_token_embeddings(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    archive = megamolbart_archive(model, vocab, tmp_path / "tied.nemo", head="bias",
                                  share_decoder_tokens_head_embeddings=True)
    loaded = load_checkpoint(archive)
    assert loaded.seq2seq is not None and isinstance(loaded.seq2seq.decoder_full, DecoderFull)
    head = loaded.seq2seq.decoder_full.model.tokens_head.weight
    torch.testing.assert_close(head, model.embedding.word_embeddings.weight[: len(vocab)])


def test_megamolbart_reads_the_archive_regex_and_fused_gelu(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source

    def narrow_regex(artifacts):  # a pattern without the two-letter halogens
        artifacts[f"{UUID}_megamolbart.model"] = rb"\[[^\]]+]|B|C|l|r|N|O|c|\(|\)|=|[0-9]"

    loaded = load_checkpoint(megamolbart_archive(model, vocab, tmp_path / "r.nemo", artifacts_edit=narrow_regex,
                                                 bias_gelu_fusion=True))
    assert loaded.description["activation"] == "gelu_tanh"
    assert isinstance(loaded.encoder, MegaMolBartEncoder) and loaded.encoder.model.config.activation == "gelu_tanh"
    # "Cl" splits into "C" + "l" under the archive's regex; "l" is not a vocabulary token.
    with pytest.raises(ValueError, match="token 'l' at character 1 is not in the vocabulary"):
        loaded.tokenizer.encode(["Cl"])


# --------------------------------------------------------------------------------- bad archives
def tar_with(path: Path, members: dict[str, bytes], *, symlink: str | None = None) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if symlink:
            info = tarfile.TarInfo(symlink)
            info.type = tarfile.SYMTYPE
            info.linkname = "/etc/passwd"
            tar.addfile(info)
    return path


@pytest.mark.parametrize(("members", "symlink", "message"), [
    ({"../evil.txt": b"x"}, None, r"member '\.\./evil\.txt' points outside the archive"),
    ({"/etc/evil.txt": b"x"}, None, r"member '/etc/evil\.txt' has an absolute path"),
    ({"model_config.yaml": b"a: 1"}, "model_weights.ckpt", r"member 'model_weights\.ckpt' is a link"),
    ({"mp_rank_00/model_weights.ckpt": b"x", "mp_rank_01/model_weights.ckpt": b"x", "model_config.yaml": b"a: 1"},
     None, r"cannot read weights .*:mp_rank_00/model_weights\.ckpt"),
    ({"model_weights.ckpt": b"x"}, None, r"has no model_config\.yaml"),
    ({"model_config.yaml": b"a: [1", "model_weights.ckpt": b"x"}, None, r"model_config\.yaml is not valid YAML"),
    ({"model_config.yaml": b"a: 1", "model_weights.ckpt": b"not a torch file"}, None,
     r"cannot read weights .*:model_weights\.ckpt"),
])
def test_unsafe_or_malformed_archives_are_refused(tmp_path, members, symlink, message):
    archive = tar_with(tmp_path / "bad.nemo", members, symlink=symlink)
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(archive)


def test_a_file_that_is_not_a_tar_archive(tmp_path):
    (tmp_path / "x.nemo").write_bytes(b"\x00not a tar" * 100)
    with pytest.raises(CheckpointError, match=r"x\.nemo is not a readable \.nemo archive"):
        read_checkpoint(tmp_path / "x.nemo")


def test_size_limits_refuse_bombs(tmp_path, monkeypatch):
    zeros = tar_with(tmp_path / "zeros.tar", {"model_config.yaml": b"a: 1", "blob": bytes(30 << 20)})
    compressed = tmp_path / "bomb.nemo"
    with tarfile.open(compressed, "w:gz") as tar:
        tar.add(zeros, arcname="inner.tar")
    with pytest.raises(CheckpointError, match="a decompression bomb, not a checkpoint"):
        read_checkpoint(compressed)
    monkeypatch.setattr(bounded_tar, "MAX_UNPACKED_BYTES", 1 << 20)
    with pytest.raises(CheckpointError, match="would unpack to more than"):
        read_checkpoint(zeros.rename(tmp_path / "big.nemo"))


class Payload:
    """Pickled by reference: unpickling it would run __reduce__, which touches a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_pickled_code_in_the_weights_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    buffer = io.BytesIO()
    torch.save({"w": torch.zeros(2), "payload": Payload(marker)}, buffer)
    archive = tar_with(tmp_path / "evil.nemo", {"model_config.yaml": b"target: x.ESM2nvModel",
                                                "model_weights.ckpt": buffer.getvalue()})
    with pytest.raises(CheckpointError, match=r"holds pickled code or objects other than tensors \(getattr\), "
                                              "which will not be run; refusing it$"):
        read_checkpoint(archive)
    assert not marker.exists()


def test_unknown_target_needs_a_family(esm2_source, tmp_path):
    archive = esm2_archive(esm2_source, tmp_path / "x.nemo", target="my.lab.ProteinModel")
    with pytest.raises(CheckpointError, match=r"has target 'my\.lab\.ProteinModel' in model_config\.yaml; known "
                                              r"targets: .*ESM2nvModel \(esm2\).*MegaMolBARTModel \(megamolbart\)"):
        load_checkpoint(archive)
    assert load_checkpoint(archive, "esm2").family.name == "esm2"  # named: read as that family


def test_a_target_of_another_family_is_refused(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    archive = megamolbart_archive(model, vocab, tmp_path / "m.nemo")
    with pytest.raises(CheckpointError, match="MegaMolBARTModel checkpoint, which the megamolbart family reads, "
                                              "not esm2: use `family` megamolbart"):
        load_checkpoint(archive, "esm2")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda w: w.pop("model.language_model.encoder.layers.1.mlp.dense_4h_to_h.bias"),
     r"esm\.nemo:model_weights\.ckpt does not match .*missing keys: encoder\.layer\.1\.output\.dense\.bias"),
    (lambda w: w.update({"model.language_model.extra.weight": torch.zeros(1)}),
     r"unexpected keys: language_model\.extra\.weight"),
    (lambda w: w.update({"model.language_model.encoder.layers.0.mlp.dense_h_to_4h.weight": torch.zeros(5, 64)}),
     r"wrong shapes: encoder\.layer\.0\.intermediate\.dense\.weight is \(5, 64\), expected \(96, 64\)"),
    (lambda w: w.update({"model.language_model.encoder.layers.0.self_attention.query_key_value.weight":
                         torch.zeros(190, 64)}),
     r"query_key_value\.weight has 190 rows, not a multiple of 3 x 4 heads"),
])
def test_key_and_shape_errors_name_the_file_and_key(esm2_source, tmp_path, edit, message):
    archive = esm2_archive(esm2_source, tmp_path / "esm.nemo", weights_edit=edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(archive)


def test_a_missing_tokenizer_artifact_is_named(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    archive = megamolbart_archive(model, vocab, tmp_path / "m.nemo",
                                  artifacts_edit=lambda a: a.pop(f"{UUID}_megamolbart.vocab"))
    with pytest.raises(CheckpointError, match=rf"tokenizer\.vocab_file refers to 'nemo:{UUID}_megamolbart\.vocab', "
                                              "which is not in the archive"):
        load_checkpoint(archive)


def test_unsupported_megatron_settings_are_named(megamolbart_source, tmp_path):
    model, vocab = megamolbart_source
    for key, value, message in [("activation", "swiglu", "activation 'swiglu' is not supported"),
                                ("position_embedding_type", "relative", "position_embedding_type is 'relative'"),
                                ("transformer_block_type", "post_ln", "transformer_block_type is 'post_ln'")]:
        setting: dict[str, Any] = {key: value}
        archive = megamolbart_archive(model, vocab, tmp_path / f"{key}.nemo", **setting)
        with pytest.raises(CheckpointError, match=message):
            load_checkpoint(archive)
