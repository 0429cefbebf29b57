"""The esm1 family: Hugging Face ESM-1b-style directories and BioNeMo ESM-1nv `.nemo` archives.

The `.nemo` archives are written here by a converter of the test's own that follows the Megatron
BERT layout documented in docs/reference/checkpoint-layouts.md, from an independent model:
transformers' `EsmModel` with learned absolute positions. The imported model must reproduce that
model's hidden states exactly (up to float rounding).
"""

from __future__ import annotations

import io
import json
import math
import struct
import tarfile

import numpy as np
import pytest
import torch
import transformers
import transformers.models.esm.modeling_esm as modeling_esm
import yaml

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.client import EncoderClient
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.models import get_family
from bionemo_export.models.base import infer_family
from bionemo_export.models.esm1 import ESM1NV_PIECES, esm1nv_tokenizer
from bionemo_export.models.readers import CheckpointError, read_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.testing.checkpoints import save_random_checkpoint

# The HF ESM alphabet (ids by index) and the ESM-1nv ids, written out as the reference documents them.
HF_ALPHABET = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]
ESM1NV = ["<unk>", "<s>", "</s>", "<pad>", "<mask>", *"LASGVERTDIPKNFQYHMCWXBZUO"]
HF_OF_ESM1NV = {"<unk>": "<unk>", "<s>": "<cls>", "</s>": "<eos>", "<pad>": "<pad>", "<mask>": "<mask>"}
HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64
MAX_TOKENS = 512
UUID = "3f2a9c1e0b7d4e5f8a6b1c2d3e4f5a6b"
TARGET = "bionemo.model.protein.esm1nv.esm1nv_model.ESM1nvModel"
SEQUENCES = ["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "LASGVERTDIPKNFQYHMCWXBZUO",
             "MQIFVKTLTGKTITLEVEPSDTIENVKAKIQDKEGIPPDQQRLIFAGKQLEDGRTLSDYNIQKESTLHLVLRLRGG"]


# ----------------------------------------------------------------------------- the independent model
@pytest.fixture(scope="module")
def hf_model() -> transformers.EsmModel:
    """A random ESM with learned absolute positions, every parameter perturbed (so biases and
    LayerNorms are not their trivial initial values)."""
    config = transformers.EsmConfig(
        vocab_size=len(HF_ALPHABET), pad_token_id=1, mask_token_id=32, hidden_size=HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        position_embedding_type="absolute", max_position_embeddings=MAX_TOKENS + 2,  # HF positions start at pad + 1
        token_dropout=False, emb_layer_norm_before=False, layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(11)
    model = transformers.EsmModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    return model


def hf_reference(model: transformers.EsmModel, sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hiddens, embeddings, attention_mask) of the HF model: <cls> + residues + <eos>, right-padded."""
    length = max(map(len, sequences)) + 2
    ids = torch.full((len(sequences), length), HF_ALPHABET.index("<pad>"))
    attention = torch.zeros_like(ids)
    residues = torch.zeros_like(ids, dtype=torch.bool)
    for row, sequence in enumerate(sequences):
        tokens = ["<cls>", *sequence, "<eos>"]
        ids[row, : len(tokens)] = torch.tensor([HF_ALPHABET.index(t) for t in tokens])
        attention[row, : len(tokens)] = 1
        residues[row, 1 : 1 + len(sequence)] = True
    with torch.no_grad():
        hiddens = model(input_ids=ids, attention_mask=attention).last_hidden_state
    weights = residues.unsqueeze(-1).float()
    return hiddens, (hiddens * weights).sum(1) / weights.sum(1), attention


# ----------------------------------------------------------------------------- the test's own converter
def megatron_state_dict(model: transformers.EsmModel, *, tokentype: bool = False, heads_too: bool = False) -> dict:
    """`model` in NeMo Megatron BERT's layout: `model.language_model.*`, fused per-head QKV
    ([q_h, k_h, v_h] for each head), word embeddings in ESM-1nv id order zero-padded to 128 rows,
    the position table from 0 (HF's row pad + 1 + i is Megatron's row i)."""
    hf = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head_dim = HIDDEN // HEADS
    out = {}
    words = torch.zeros(128, HIDDEN)
    for new_id, token in enumerate(ESM1NV):
        words[new_id] = hf["embeddings.word_embeddings.weight"][HF_ALPHABET.index(HF_OF_ESM1NV.get(token, token))]
    prefix = "model.language_model."
    out[prefix + "embedding.word_embeddings.weight"] = words
    assert model.config.pad_token_id is not None  # ESM configs always name their padding token
    offset = model.config.pad_token_id + 1
    positions = hf["embeddings.position_embeddings.weight"][offset:].clone()
    if tokentype:  # BERT token types: every token has type 0, whose row is added to every position
        types = torch.randn(2, HIDDEN)
        out[prefix + "embedding.tokentype_embeddings.weight"] = types
        positions -= types[0]
    out[prefix + "embedding.position_embeddings.weight"] = positions
    for i in range(LAYERS):
        src, dst = f"encoder.layer.{i}.", f"{prefix}encoder.layers.{i}."
        for leaf in ("weight", "bias"):
            q, k, v = (hf[f"{src}attention.self.{name}.{leaf}"] for name in ("query", "key", "value"))
            per_head = [t.reshape(HEADS, head_dim, *t.shape[1:]) for t in (q, k, v)]
            fused = torch.stack(per_head, dim=1).reshape(3 * HIDDEN, *q.shape[1:])
            out[f"{dst}self_attention.query_key_value.{leaf}"] = fused
            out[f"{dst}input_layernorm.{leaf}"] = hf[f"{src}attention.LayerNorm.{leaf}"]
            out[f"{dst}self_attention.dense.{leaf}"] = hf[f"{src}attention.output.dense.{leaf}"]
            out[f"{dst}post_attention_layernorm.{leaf}"] = hf[f"{src}LayerNorm.{leaf}"]
            out[f"{dst}mlp.dense_h_to_4h.{leaf}"] = hf[f"{src}intermediate.dense.{leaf}"]
            out[f"{dst}mlp.dense_4h_to_h.{leaf}"] = hf[f"{src}output.dense.{leaf}"]
        # the fused rows really are grouped per head: head 1's query rows follow head 0's value rows
        torch.testing.assert_close(out[f"{dst}self_attention.query_key_value.weight"][3 * head_dim: 4 * head_dim],
                                   hf[f"{src}attention.self.query.weight"][head_dim: 2 * head_dim])
    for leaf in ("weight", "bias"):
        out[f"{prefix}encoder.final_layernorm.{leaf}"] = hf[f"encoder.emb_layer_norm_after.{leaf}"]
    if heads_too:  # what a trained archive also holds; the encoder does not use it
        out["model.lm_head.dense.weight"] = torch.randn(HIDDEN, HIDDEN)
        out["model.lm_head.dense.bias"] = torch.randn(HIDDEN)
        out["model.lm_head.layernorm.weight"] = torch.randn(HIDDEN)
        out["model.lm_head.layernorm.bias"] = torch.randn(HIDDEN)
        out["model.lm_head.bias"] = torch.randn(128)
    return out


def sentencepiece_model(pieces: list[str]) -> bytes:
    """A SentencePiece ModelProto holding `pieces` (the sentencepiece package's protobuf module
    when it imports, else the same bytes encoded by hand: field 1 repeated SentencePiece
    {1: piece, 2: score (float), 3: type})."""
    types = {"<unk>": 2, "<s>": 3, "</s>": 3, "<pad>": 4, "<mask>": 4}
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb

        # generated protobuf code without stubs: its classes are made at import time
        proto = pb.ModelProto()  # pyright: ignore[reportAttributeAccessIssue]
        for index, piece in enumerate(pieces):
            entry = proto.pieces.add()
            entry.piece, entry.score, entry.type = piece, -float(index), types.get(piece, 1)
        return proto.SerializeToString()
    except Exception:  # noqa: BLE001 - not installed, or its protobuf is too old (as here)
        pass

    def varint(value: int) -> bytes:
        out = bytearray()
        while True:
            byte, value = value & 0x7F, value >> 7
            out.append(byte | (0x80 if value else 0))
            if not value:
                return bytes(out)

    data = bytearray()
    for index, piece in enumerate(pieces):
        text = piece.encode("utf-8")
        entry = (b"\x0a" + varint(len(text)) + text + b"\x15" + struct.pack("<f", -float(index))
                 + b"\x18" + varint(types.get(piece, 1)))
        data += b"\x0a" + varint(len(entry)) + entry
    # a trainer_spec (field 2) after the pieces, as real files have: must be skipped
    data += b"\x12\x04\x08\x01\x10\x1e"
    return bytes(data)


def write_nemo(path, state: dict, *, gelu_fusion: bool = False, artifacts=("model", "vocab"), gzip: bool = False,
               pieces: list[str] = ESM1NV, **overrides):
    """A .nemo archive: model_config.yaml, model_weights.ckpt and the tokenizer artifacts."""
    name = f"{UUID}_protein_sequence_sp"
    config = {
        "target": TARGET, "num_layers": LAYERS, "hidden_size": HIDDEN, "ffn_hidden_size": FFN,
        "num_attention_heads": HEADS, "max_position_embeddings": MAX_TOKENS, "seq_length": MAX_TOKENS,
        "position_embedding_type": "learned_absolute", "layernorm_epsilon": 1e-5, "bias_gelu_fusion": gelu_fusion,
        "make_vocab_size_divisible_by": 128, "activation": "gelu",
        "tokenizer": {"library": "sentencepiece", "type": None,
                      "model": f"nemo:{name}.model" if "model" in artifacts else None,
                      "vocab_file": f"nemo:{name}.vocab" if "vocab" in artifacts else None},
        **overrides,
    }
    members = {"model_config.yaml": yaml.safe_dump(config).encode()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    members["model_weights.ckpt"] = buffer.getvalue()
    if "model" in artifacts:
        members[f"{name}.model"] = sentencepiece_model(pieces)
    if "vocab" in artifacts:
        members[f"{name}.vocab"] = "".join(f"{p}\t{-float(i)}\n" for i, p in enumerate(pieces)).encode()
    with tarfile.open(path, "w:gz" if gzip else "w") as tar:
        for member, data in members.items():
            info = tarfile.TarInfo(f"./{member}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def imported(model, sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    encoded = model.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = model.encoder(*(torch.from_numpy(a) for a in
                                              (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens, embeddings, encoded.attention_mask


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


# ----------------------------------------------------------------------------- .nemo (ESM-1nv)
@pytest.mark.parametrize("gzip, artifacts, extras", [
    (False, ("model", "vocab"), False),
    (True, ("vocab",), True),
    (False, ("model",), True),
])
def test_nemo_import_equals_the_independent_model(hf_model, tmp_path, gzip, artifacts, extras):
    path = write_nemo(tmp_path / "esm1nv.nemo", megatron_state_dict(hf_model, tokentype=extras, heads_too=extras),
                      gzip=gzip, artifacts=artifacts)
    model = get_family("esm1").load(path)
    assert model.description["architecture"] == "Encoder" and model.description["activation"] == "gelu"
    assert model.description["nemo_target"] == TARGET and model.hidden_size == HIDDEN
    assert model.tokenizer.vocab == tuple(ESM1NV) and model.tokenizer.max_length == MAX_TOKENS
    hiddens, embeddings, attention = imported(model, SEQUENCES)
    ref_hiddens, ref_embeddings, ref_attention = hf_reference(hf_model, SEQUENCES)
    assert np.array_equal(attention, ref_attention.numpy())
    real = torch.from_numpy(attention).bool()
    torch.testing.assert_close(hiddens[real], ref_hiddens[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(embeddings, ref_embeddings, rtol=0, atol=1e-5)


def test_bias_gelu_fusion_gives_the_tanh_gelu(hf_model, tmp_path, monkeypatch):
    state = megatron_state_dict(hf_model)
    exact = get_family("esm1").load(write_nemo(tmp_path / "exact.nemo", state, gelu_fusion=False))
    fused = get_family("esm1").load(write_nemo(tmp_path / "fused.nemo", state, gelu_fusion=True))
    assert fused.description["activation"] == "gelu_tanh"
    exact_hiddens, _, attention = imported(exact, SEQUENCES)
    fused_hiddens, fused_embeddings, _ = imported(fused, SEQUENCES)
    real = torch.from_numpy(attention).bool()
    assert (fused_hiddens[real] - exact_hiddens[real]).abs().max() > 1e-4  # really another function
    monkeypatch.setattr(modeling_esm, "gelu", tanh_gelu)  # what EsmIntermediate calls
    ref_hiddens, ref_embeddings, _ = hf_reference(hf_model, SEQUENCES)
    torch.testing.assert_close(fused_hiddens[real], ref_hiddens[real], rtol=0, atol=1e-5)
    torch.testing.assert_close(fused_embeddings, ref_embeddings, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def esm1nv_nemo(hf_model, tmp_path_factory):
    return write_nemo(tmp_path_factory.mktemp("esm1nv") / "esm1nv.nemo", megatron_state_dict(hf_model))


def test_esm1nv_ids_are_the_documented_ones(esm1nv_nemo):
    tokenizer = get_family("esm1").load(esm1nv_nemo).tokenizer
    encoded = tokenizer.encode(["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "LASGVERTDIPKNFQYHMCWXBZUO"])
    pad = [3] * 20
    assert encoded.input_ids.tolist() == [
        [1, 22, 16, 12, 6, 20, 2] + pad,
        [1, 22, 7, 5, 16, 11, 16, 17, 14, 6, 5, 14, 15, 6, 6, 8, 14, 8, 9, 11, 18, 8, 2] + pad[:4],
        [1, *range(5, 30), 2],
    ]
    assert encoded.residue_mask[0].tolist() == [False] + [True] * 5 + [False] * 21
    assert encoded.attention_mask[1].tolist() == [1] * 23 + [0] * 4
    assert tokenizer.encode(["A" * 510]).input_ids.shape == (1, 512)
    with pytest.raises(TokenizationError, match="511"):
        tokenizer.encode(["A" * 511])
    with pytest.raises(TokenizationError):
        tokenizer.encode(["MKTA*"])
    assert esm1nv_tokenizer(ESM1NV_PIECES, 512).vocab == tokenizer.vocab  # the module's table is the same
    assert get_family("esm1").load(esm1nv_nemo, max_length=100).tokenizer.max_length == 100
    with pytest.raises(ValueError, match="exceeds"):
        get_family("esm1").load(esm1nv_nemo, max_length=513)


def test_the_family_is_inferred_from_the_target(esm1nv_nemo):
    assert infer_family(read_checkpoint(esm1nv_nemo)) == "esm1"
    with pytest.raises(CheckpointError, match="use `family` esm1"):
        get_family("esm2").load(esm1nv_nemo)


def test_the_command_line_names_the_family_by_its_flag(esm1nv_nemo, tmp_path):
    """The library names the setting (`family`); build and inspect word it as their --model."""
    from typer.testing import CliRunner

    from bionemo_export.cli.main import app

    runner = CliRunner()
    built = runner.invoke(app, ["build", "repo", "--no-optimize", "--model", "esm2", "--checkpoint", str(esm1nv_nemo),
                                "--name", "m", "--out", str(tmp_path / "repo")], env={"COLUMNS": "300"})
    assert built.exit_code == 1 and "use --model esm1" in built.output and "`family`" not in built.output
    huggingface = save_random_checkpoint("esm1", tmp_path / "esm1-hf")
    inspected = runner.invoke(app, ["inspect", str(huggingface), "--model", "esm2"], env={"COLUMNS": "300"})
    assert inspected.exit_code == 1 and "use --model esm1" in inspected.output, inspected.output


@pytest.mark.parametrize("problem, message", [
    ("no_tokenizer", "names no tokenizer artifact"),
    ("pieces_differ", "tokenizer.model and tokenizer.vocab_file differ"),
    ("not_esm1nv", "not an ESM-1nv vocabulary"),
    ("rope", "position_embedding_type is 'rope'"),
    ("short_embeddings", "word_embeddings.weight has 20 rows"),
    ("missing_layer", "missing keys: encoder.layers.1.mlp.dense_4h_to_h.bias"),
])
def test_bad_archives_are_refused_naming_the_problem(hf_model, tmp_path, problem, message):
    state = megatron_state_dict(hf_model)
    kwargs = {}
    if problem == "no_tokenizer":
        kwargs["artifacts"] = ()
    elif problem == "not_esm1nv":
        kwargs["pieces"] = [p for p in ESM1NV if p != "W"]
    elif problem == "rope":
        kwargs["position_embedding_type"] = "rope"
    elif problem == "short_embeddings":
        key = "model.language_model.embedding.word_embeddings.weight"
        state[key] = state[key][:20]
    elif problem == "missing_layer":
        del state["model.language_model.encoder.layers.1.mlp.dense_4h_to_h.bias"]
    path = write_nemo(tmp_path / "bad.nemo", state, **kwargs)
    if problem == "pieces_differ":  # swap two lines of the .vocab artifact
        members = {}
        with tarfile.open(path) as tar:
            for member in tar:
                extracted = tar.extractfile(member)
                assert extracted is not None, f"{path} holds {member.name}, which is not a file"
                members[member.name] = extracted.read()
        vocab = next(name for name in members if name.endswith(".vocab"))
        lines = members[vocab].decode().splitlines()
        lines[5], lines[6] = lines[6], lines[5]
        members[vocab] = ("\n".join(lines) + "\n").encode()
        with tarfile.open(path, "w") as tar:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CheckpointError, match=message):
        get_family("esm1").load(path)


# ----------------------------------------------------------------------------- Hugging Face (ESM-1b style)
@pytest.fixture(scope="module")
def esm1b_dir(tmp_path_factory):
    return save_random_checkpoint("esm1", tmp_path_factory.mktemp("esm1b"), seed=3)


def test_esm1b_directory_equals_transformers_own_esm(esm1b_dir):
    config = json.loads((esm1b_dir / "config.json").read_text())
    assert config["position_embedding_type"] == "absolute" and config["token_dropout"] is True
    model = get_family("esm1").load(esm1b_dir)
    assert model.description["architecture"] == "EsmModel" and model.hidden_size == 32
    # HF ESM numbers absolute positions from pad_token_id + 1: 1026 positions hold 1024 tokens.
    assert model.tokenizer.max_length == 1024 and model.tokenizer.bos_token == "<cls>"
    sequences = model.family.sample_sequences()
    encoded = model.tokenizer.encode(sequences)
    hiddens, embeddings, _ = imported(model, sequences)
    reference = transformers.EsmModel.from_pretrained(esm1b_dir, add_pooling_layer=False).eval()
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(encoded.input_ids),
                             attention_mask=torch.from_numpy(encoded.attention_mask)).last_hidden_state
    real = torch.from_numpy(encoded.attention_mask).bool()
    torch.testing.assert_close(hiddens[real], expected[real], rtol=0, atol=1e-5)
    mask = torch.from_numpy(encoded.residue_mask)
    for row in range(len(sequences)):
        torch.testing.assert_close(embeddings[row], expected[row, mask[row]].mean(0), rtol=0, atol=1e-5)
    model.tokenizer.encode(["A" * 1022])
    with pytest.raises(TokenizationError):
        model.tokenizer.encode(["A" * 1023])


def test_rotary_and_absolute_directories_point_to_each_other(esm1b_dir, tmp_path):
    with pytest.raises(CheckpointError, match="use `family` esm1"):
        get_family("esm2").load(esm1b_dir)
    rotary = save_random_checkpoint("esm2", tmp_path, seed=3)
    with pytest.raises(CheckpointError, match="'rotary', not 'absolute': use `family` esm2"):
        get_family("esm1").load(rotary)


def test_esm1b_directory_builds_a_verified_repository(esm1b_dir, tmp_path):
    """The absolute positions (computed from input_ids by cumsum) export and verify."""
    result = build_repository(BuildRequest(family="esm1", checkpoint=esm1b_dir, name="esm1b", out=tmp_path / "repo",
                                           backend="python", serving=ServingOptions(max_batch_size=4), optimize=False))
    assert (result.repository / "manifest.json").is_file()


# ----------------------------------------------------------------------------- served end to end
@pytest.fixture(scope="module")
def served_esm1nv(esm1nv_nemo, tmp_path_factory, triton_install):
    work = tmp_path_factory.mktemp("esm1nv_served")
    build_repository(BuildRequest(
        family="esm1", checkpoint=esm1nv_nemo, name="esm1nv", out=work / "repo", backend="python",
        tasks=("embeddings", "hiddens"),  # what the test reads; test_esm1b_... builds every default task
        serving=ServingOptions(max_batch_size=8, max_queue_delay_microseconds=0), optimize=False,
    ))
    loaded = get_family("esm1").load(esm1nv_nemo)
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield loaded, server


def test_served_esm1nv_matches_pytorch(served_esm1nv):
    loaded, server = served_esm1nv
    batch = [SEQUENCES[3], SEQUENCES[0], SEQUENCES[1]]  # long, short, medium: real padding
    ref_hiddens, ref_embeddings, attention = (t.numpy() if isinstance(t, torch.Tensor) else t
                                              for t in imported(loaded, batch))
    with EncoderClient("esm1nv", f"grpc://{server.endpoints.grpc_url}") as client:
        embeddings = client.seqs_to_embedding(batch)
        hiddens, mask = client.seqs_to_hidden(batch)
    assert embeddings.shape == (3, HIDDEN) and hiddens.shape == ref_hiddens.shape
    assert np.abs(embeddings - ref_embeddings).max() < 1e-4
    assert cosine_rows(embeddings, ref_embeddings).min() > 0.9999
    real = attention.astype(bool)
    assert np.abs(hiddens - ref_hiddens)[real].max() < 1e-4
    for row, sequence in enumerate(batch):  # mask: residues only, never <s>/</s> or padding
        assert mask[row].tolist() == [False] + [True] * len(sequence) + [False] * (mask.shape[1] - len(sequence) - 1)
