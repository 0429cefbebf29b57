"""The prott5 family: Hugging Face ProtT5 folders (checked against transformers' own T5 tokenizer and
T5EncoderModel) and BioNeMo ProtT5nv `.nemo` archives (written here from a random source model in
NeMo's Megatron encoder-decoder layout, checked against that source), plus one repository served
end to end by the real tritonserver."""

from __future__ import annotations

import io
import re
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.cli.main import app
from bionemo_export.client import EncoderClient, InferenceError, TritonClient, strings_to_tensor
from bionemo_export.model_repository.encoder import ServingOptions
from bionemo_export.model_repository.manifest import Manifest
from bionemo_export.models import LoadedModel, get_family, load_checkpoint
from bionemo_export.models.megamolbart import MegaMolBart, MegaMolBartConfig
from bionemo_export.models.prott5 import PROTT5_PIECES, nemo_vocabulary, sentencepiece_model
from bionemo_export.models.readers import CheckpointError, read_checkpoint
from bionemo_export.runtime import TritonServer
from bionemo_export.serving.numerics import cosine_rows
from bionemo_export.serving.tokenizers import Encoded
from bionemo_export.serving.tokenizers.sentencepiece_vocab import SentencePieceTokenizer
from bionemo_export.testing.checkpoints import save_random_checkpoint

FAMILY = get_family("prott5")
ESM1NV_PIECES = ["<unk>", "<s>", "</s>", "<pad>", "<mask>", *"LASGVERTDIPKNFQYHMCWXBZUO"]
"""ESM-1nv's SentencePiece vocabulary (docs/reference/tokenizers.md): ProtT5nv's first 30 ids."""
NEMO_TARGET = "bionemo.model.protein.prott5nv.prott5nv_model.ProtT5nvModel"


@pytest.fixture(scope="module")
def spm():
    """The sentencepiece library, which transformers' T5 tokenizer needs to read spiece.model
    (requirements/runtime.txt installs it for the tests; the package itself never imports it)."""
    return pytest.importorskip("sentencepiece")


def encode(model: LoadedModel, sequences: list[str]) -> tuple[torch.Tensor, torch.Tensor, Encoded]:
    """(hiddens, embeddings, Encoded) of the loaded encoder for a batch."""
    encoded = model.tokenizer.encode(sequences)
    with torch.no_grad():
        hiddens, embeddings = model.encoder(*(torch.from_numpy(a) for a in
                                              (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
    return hiddens, embeddings, encoded


def prottrans_text(sequence: str) -> str:
    """What ProtTrans feeds its T5 tokenizer: rare residues as X, residues separated by spaces."""
    return " ".join(re.sub(r"[UZOB]", "X", sequence))


# ------------------------------------------------------------------------ Hugging Face folders
@pytest.fixture(scope="module")
def hf(tmp_path_factory, spm) -> dict[str, Path]:
    """Random ProtT5 folders: encoder-only with spiece.model; the same folder with tokenizer.json
    instead (written by transformers); a whole T5ForConditionalGeneration."""
    root = tmp_path_factory.mktemp("prott5_hf")
    encoder = save_random_checkpoint(FAMILY.name, root / "encoder", seed=3)
    as_json = root / "json"
    shutil.copytree(encoder, as_json)
    transformers.AutoTokenizer.from_pretrained(encoder).save_pretrained(as_json)
    (as_json / "spiece.model").unlink()
    full = save_random_checkpoint(FAMILY.name, root / "full", seed=4, num_decoder_layers=2)
    return {"spiece": encoder, "json": as_json, "full": full}


def test_spiece_model_written_without_the_library_is_a_valid_sentencepiece_model(hf, spm):
    processor = spm.SentencePieceProcessor(model_file=str(hf["spiece"] / "spiece.model"))
    assert [processor.id_to_piece(i) for i in range(processor.get_piece_size())] == PROTT5_PIECES
    assert (processor.pad_id(), processor.eos_id(), processor.unk_id(), processor.bos_id()) == (0, 1, 2, -1)
    assert processor.encode("M K T A") == [PROTT5_PIECES.index("\u2581" + c) for c in "MKTA"]


@pytest.mark.parametrize("form", ["spiece", "json"])
def test_token_ids_equal_transformers_t5_tokenizer(hf, form):
    folder = hf[form]
    assert {"spiece": "spiece.model", "json": "tokenizer.json"}[form] in {p.name for p in folder.iterdir()}
    model = FAMILY.load(folder)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    assert list(model.tokenizer.vocab) == reference.convert_ids_to_tokens(list(range(len(reference))))
    sequences = [*FAMILY.sample_sequences(), "UZOB", "BXMU"]
    expected = reference([prottrans_text(s) for s in sequences], padding=True, return_tensors="np")
    encoded = model.tokenizer.encode(sequences)
    np.testing.assert_array_equal(encoded.input_ids, expected["input_ids"])
    np.testing.assert_array_equal(encoded.attention_mask, expected["attention_mask"])
    # mask: the residues only; </s> (appended, no BOS) and padding are not residues.
    for row, sequence in enumerate(sequences):
        assert encoded.residue_mask[row].tolist() == [i < len(sequence) for i in range(encoded.input_ids.shape[1])]
        assert encoded.input_ids[row, len(sequence)] == reference.eos_token_id == 1
    assert model.tokenizer.max_length == 512 and model.tokenizer.bos_token is None


def test_space_separated_and_rare_residues(hf):
    model = FAMILY.load(hf["spiece"])
    plain = model.tokenizer.encode(["MKUZOBT"])
    spaced = model.tokenizer.encode(["M K U Z O B T"])
    np.testing.assert_array_equal(plain.input_ids, spaced.input_ids)
    x = PROTT5_PIECES.index("\u2581X")
    assert plain.input_ids[0, 2:6].tolist() == [x] * 4
    with pytest.raises(ValueError, match="invalid character 'J'"):
        model.tokenizer.encode(["MKJ"])


def test_max_length_defaults_to_512_and_follows_the_user(hf):
    tokenizer = FAMILY.load(hf["spiece"], max_length=64).tokenizer
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.max_residues == 63
    # T5's relative positions set no limit: a longer one is the user's choice.
    assert FAMILY.load(hf["spiece"], max_length=1024).tokenizer.max_length == 1024


@pytest.mark.parametrize("form", ["spiece", "full"])
def test_hiddens_equal_transformers_t5_encoder(hf, form):
    folder = hf[form]
    model = FAMILY.load(folder)
    assert model.description["architecture"] == "T5EncoderModel" and model.hidden_size == 32
    sequences = FAMILY.sample_sequences()
    hiddens, embeddings, encoded = encode(model, sequences)
    tokens = transformers.AutoTokenizer.from_pretrained(folder)(
        [prottrans_text(s) for s in sequences], padding=True, return_tensors="pt")
    references: list[torch.nn.Module] = [transformers.T5EncoderModel.from_pretrained(folder).eval()]
    if form == "full":
        full = transformers.T5ForConditionalGeneration.from_pretrained(folder).eval()
        references.append(full.get_encoder())
    real = torch.from_numpy(encoded.attention_mask).bool()
    for reference in references:
        with torch.no_grad():
            output = reference(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        expected = output.last_hidden_state
        assert (hiddens - expected)[real].abs().max() <= 1e-5
    # embeddings: the mean over residues (ProtTrans' practice), </s> excluded
    for row, sequence in enumerate(sequences):
        torch.testing.assert_close(embeddings[row], hiddens[row, : len(sequence)].mean(0), atol=1e-6, rtol=0)


def test_a_t5_folder_with_the_decoder_loads_only_the_encoder(hf):
    encoder_only, full = FAMILY.load(hf["spiece"]), FAMILY.load(hf["full"])
    assert encoder_only.description["parameters"] == full.description["parameters"]
    assert not any(name.startswith("backbone.decoder") for name, _ in full.encoder.named_parameters())


def test_untied_encoder_embeddings_are_refused(hf, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(hf["spiece"], tmp_path / "untied")
    weights = load_file(folder / "model.safetensors")
    weights["encoder.embed_tokens.weight"] = weights["shared.weight"] + 1
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match="not tied"):
        FAMILY.load(folder)


# ------------------------------------------------------------------------ ProtT5nv .nemo
def source_model(seed: int = 5) -> MegaMolBart:
    """A random pre-LN encoder-decoder with ProtT5nv's vocabulary size (128): what a Megatron T5
    with learned absolute positions computes (MegaMolBart is the same architecture)."""
    config = MegaMolBartConfig(vocab_size=128, hidden_size=32, num_layers=2, num_decoder_layers=1, num_heads=4,
                               ffn_size=64, max_position_embeddings=512, activation="gelu_tanh")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = MegaMolBart(config)
        with torch.no_grad():  # LayerNorms away from their identity initialisation
            for name, parameter in model.named_parameters():
                if "layernorm" in name:
                    parameter.add_(torch.randn_like(parameter) * 0.1)
    return model.eval()


def _fuse(parts: list[torch.Tensor], heads: int) -> torch.Tensor:
    """Megatron's per-head fused layout: rows [p0_h, p1_h, ...] for each head h in turn."""
    per_head = [p.reshape(heads, p.shape[0] // heads, *p.shape[1:]) for p in parts]
    return torch.stack(per_head, dim=1).reshape(-1, *parts[0].shape[1:])


def megatron_weights(model: MegaMolBart, rows: int, prefix: str, decoder_embedding: str) -> dict[str, torch.Tensor]:
    """The NeMo Megatron encoder-decoder state dict of `model` (the layout in docs/reference/checkpoint-layouts.md), the
    vocabulary padded to `rows` rows; `decoder_embedding`: "same" (a copy of the encoder's),
    "none", or "other" (its own: irrelevant to the encoder)."""
    heads = model.config.num_heads
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out: dict[str, torch.Tensor] = {}

    def pad(tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor, torch.zeros(rows - tensor.shape[0], *tensor.shape[1:])])

    for leaf in ("word_embeddings", "position_embeddings"):
        tensor = state.pop(f"embedding.{leaf}.weight")
        tensor = pad(tensor) if leaf == "word_embeddings" else tensor
        out[f"enc_dec_model.encoder_embedding.{leaf}.weight"] = tensor
        if decoder_embedding != "none":
            own = tensor + 1 if decoder_embedding == "other" else tensor.clone()
            out[f"enc_dec_model.decoder_embedding.{leaf}.weight"] = own
    out["enc_dec_model.tokens_head.weight"] = pad(state.pop("tokens_head.weight"))
    out["enc_dec_model.tokens_head.bias"] = pad(state.pop("tokens_head.bias"))
    for key in [k for k in state if ".query." in k and "self_attention" in k]:
        base, leaf = key.split(".self_attention.query.")
        out[f"{base}.self_attention.query_key_value.{leaf}"] = _fuse(
            [state.pop(f"{base}.self_attention.{p}.{leaf}") for p in ("query", "key", "value")], heads)
    for key in [k for k in state if ".inter_attention.key." in k]:
        base, leaf = key.split(".inter_attention.key.")
        out[f"{base}.inter_attention.key_value.{leaf}"] = _fuse(
            [state.pop(f"{base}.inter_attention.{p}.{leaf}") for p in ("key", "value")], heads)
    out.update(state)  # dense, layernorms, mlp, query of inter_attention: same names
    renamed = {}
    for key, tensor in out.items():
        for stack in ("encoder", "decoder"):
            if key.startswith(f"{stack}."):
                key = f"enc_dec_model.enc_dec_model.{stack}.model." + key[len(stack) + 1:]
        renamed[prefix + key] = tensor
    return renamed


def write_nemo(path: Path, model: MegaMolBart, *, rows: int, gzip: bool, nested: bool, prefix: str,
               pieces: list[str], artifacts: tuple[str, ...], decoder_embedding: str = "same") -> Path:
    """A ProtT5nv-style .nemo: model_config.yaml (flat, or per-stack `encoder:`/`decoder:`),
    model_weights.ckpt and the tokenizer artifacts `<uuid>_tokenizer.model` / `.vocab`."""
    config = model.config
    stack = {"num_layers": config.num_layers, "hidden_size": config.hidden_size, "ffn_hidden_size": config.ffn_size,
             "num_attention_heads": config.num_heads, "layernorm_epsilon": config.layer_norm_eps,
             "position_embedding_type": "learned_absolute", "activation": "gelu", "bias_gelu_fusion": True,
             "max_position_embeddings": config.max_position_embeddings}
    uuid = "1c2a5b9d8e7f4a3b9c0d1e2f3a4b5c6d"
    files = {"model": f"{uuid}_tokenizer.model", "vocab_file": f"{uuid}_tokenizer.vocab"}
    yaml_config = {
        "target": NEMO_TARGET, "seq_length": 512, "make_vocab_size_divisible_by": 128,
        "tokenizer": {"library": "sentencepiece", "type": None, "num_sentinel_tokens": 96,
                      **{key: f"nemo:{files[key]}" for key in artifacts}},
    }
    if nested:
        yaml_config["encoder"] = stack
        yaml_config["decoder"] = {**stack, "num_layers": config.num_decoder_layers}
    else:
        yaml_config.update(stack)
    members = {
        "model_config.yaml": yaml.safe_dump(yaml_config).encode(),
        files["model"]: sentencepiece_model(pieces, unk="<unk>", bos="<s>", eos="</s>", pad="<pad>",
                                            control=("<mask>",)),
        files["vocab_file"]: "".join(f"{p}\t{-float(i)}\n" for i, p in enumerate(pieces)).encode(),
    }
    buffer = io.BytesIO()
    torch.save(megatron_weights(model, rows, prefix, decoder_embedding), buffer)
    members["model_weights.ckpt"] = buffer.getvalue()
    with tarfile.open(path, "w:gz" if gzip else "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


NEMO_VARIANTS = {
    # plain tar, flat config, `model.` keys, both artifacts, 30 pieces: NeMo adds <cls> <sep> + 96 sentinels
    "tar": dict(rows=128, gzip=False, nested=False, prefix="model.", pieces=ESM1NV_PIECES,
                artifacts=("model", "vocab_file")),
    # gzip tar, nested encoder:/decoder:, no prefix, the .model only, embeddings padded beyond 128,
    # no decoder embeddings stored
    "gzip": dict(rows=256, gzip=True, nested=True, prefix="", pieces=ESM1NV_PIECES, artifacts=("model",),
                 decoder_embedding="none"),
    # an artifact that already holds the extended vocabulary (ids kept as they are); the decoder
    # has embeddings of its own
    "extended": dict(rows=128, gzip=False, nested=False, prefix="model.", artifacts=("vocab_file",),
                     pieces=[*ESM1NV_PIECES, "<cls>", "<sep>", *(f"<extra_id_{i}>" for i in range(96))],
                     decoder_embedding="other"),
}


@pytest.fixture(scope="module")
def nemo(tmp_path_factory) -> tuple[MegaMolBart, dict[str, Path]]:
    root = tmp_path_factory.mktemp("prott5nv")
    model = source_model()
    return model, {name: write_nemo(root / f"prott5nv_{name}.nemo", model, **options)
                   for name, options in NEMO_VARIANTS.items()}


def test_nemo_artifact_is_a_valid_sentencepiece_model(nemo, spm):
    checkpoint = read_checkpoint(nemo[1]["tar"])
    name = next(n for n in checkpoint.files if n.endswith("_tokenizer.model"))
    processor = spm.SentencePieceProcessor(model_proto=checkpoint.files[name])
    assert [processor.id_to_piece(i) for i in range(processor.get_piece_size())] == ESM1NV_PIECES


@pytest.mark.parametrize("variant", list(NEMO_VARIANTS))
def test_nemo_vocabulary_is_esm1nv_extended_the_nemo_t5_way(nemo, variant):
    pieces, added = nemo_vocabulary(read_checkpoint(nemo[1][variant]))
    assert len(pieces) == 128 and pieces[:30] == ESM1NV_PIECES
    assert pieces[30:32] == ["<cls>", "<sep>"]
    assert pieces[32:] == [f"<extra_id_{i}>" for i in range(96)]
    assert added == (0 if variant == "extended" else 98)


@pytest.mark.parametrize("variant", list(NEMO_VARIANTS))
def test_nemo_encoder_hiddens_equal_the_source_model(nemo, variant):
    source, paths = nemo
    checkpoint = read_checkpoint(paths[variant])
    assert checkpoint.model_class == NEMO_TARGET
    model = load_checkpoint(paths[variant])  # no family named: the target says prott5
    assert model.family.name == "prott5" and model.description["architecture"] == "Encoder"
    assert model.description["nemo_target"] == NEMO_TARGET and model.description["activation"] == "gelu_tanh"
    tokenizer = model.tokenizer
    assert tokenizer.vocab_size == 128 and tokenizer.max_length == 512
    assert tokenizer.bos_token is None and tokenizer.eos_token is None
    sequences = FAMILY.sample_sequences()
    hiddens, embeddings, encoded = encode(model, sequences)
    # no BOS/EOS: every residue is a token, the mask is the padding mask
    np.testing.assert_array_equal(encoded.residue_mask, encoded.attention_mask.astype(bool))
    for row, sequence in enumerate(sequences):
        assert encoded.input_ids[row, : len(sequence)].tolist() == [ESM1NV_PIECES.index(c) for c in sequence]
        assert (encoded.input_ids[row, len(sequence):] == ESM1NV_PIECES.index("<pad>")).all()
    with torch.no_grad():
        expected = source.encode(torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask))
    real = torch.from_numpy(encoded.attention_mask).bool()
    assert (hiddens - expected)[real].abs().max() <= 1e-5
    for row, sequence in enumerate(sequences):  # embeddings: mean over every non-pad position
        torch.testing.assert_close(embeddings[row], expected[row, : len(sequence)].mean(0), atol=1e-5, rtol=0)


def test_nemo_with_too_few_embedding_rows_is_refused(nemo, tmp_path):
    source, _ = nemo
    options = {**NEMO_VARIANTS["tar"], "pieces": [*ESM1NV_PIECES, "<cls>", "<sep>",
                                                  *(f"<extra_id_{i}>" for i in range(200))]}
    path = write_nemo(tmp_path / "bad.nemo", source, **{**options, "artifacts": ("model",)})
    with pytest.raises(CheckpointError, match="rows but the tokenizer has 232 tokens"):
        FAMILY.load(path)


def test_nemo_named_as_another_family_is_refused(nemo):
    with pytest.raises(ValueError, match="use `family` prott5"):
        load_checkpoint(nemo[1]["tar"], "esm2")


def test_cli_builds_a_nemo_without_model(nemo, tmp_path):
    out = tmp_path / "repo"
    result = CliRunner().invoke(app, ["build", "repo", "--no-optimize", "--checkpoint", str(nemo[1]["gzip"]),
                                      "--name", "prott5nv", "--tasks", "embeddings,hiddens",
                                      "--out", str(out), "--backend", "python", "--no-warmup"])
    assert result.exit_code == 0, result.output
    manifest = Manifest.read(out)
    assert manifest.family == "prott5" and manifest.verification["passed"]


# ------------------------------------------------------------------------ served end to end
@pytest.fixture(scope="module")
def served(hf, tmp_path_factory, triton_install):
    """A repository built from the Hugging Face folder (word pieces, spaces, `</s>`), served."""
    work = tmp_path_factory.mktemp("prott5_e2e")
    build_repository(BuildRequest(
        family="prott5", checkpoint=hf["spiece"], name="prott5", out=work / "repo", backend="python",
        tasks=("embeddings", "hiddens"),  # what the test reads (test_layer_states.py checks the layers graph)
        serving=ServingOptions(max_batch_size=8, max_queue_delay_microseconds=0), optimize=False,
    ))
    with TritonServer(work / "repo", install=triton_install, log_file=work / "server.log") as server:
        yield FAMILY.load(hf["spiece"]), server


def test_served_embeddings_and_hiddens_match_pytorch(served):
    loaded, server = served
    samples = sorted(FAMILY.sample_sequences(), key=len)
    batch = [samples[-1], samples[0], samples[3]]  # long, short, with rare residues: real padding
    hiddens_tensor, embeddings_tensor, encoded = encode(loaded, batch)
    ref_hiddens, ref_embeddings = hiddens_tensor.numpy(), embeddings_tensor.numpy()
    url = f"grpc://{server.endpoints.grpc_url}"
    with EncoderClient("prott5", url) as client:
        embeddings = client.seqs_to_embedding(batch)
        hiddens, mask = client.seqs_to_hidden(batch)
        spaced = client.seqs_to_embedding([" ".join(s) for s in batch])
    with TritonClient(url) as client, pytest.raises(InferenceError, match="invalid character 'J'"):
        client.infer("prott5_embeddings", {"sequences": strings_to_tensor(["MKJ"])})
    np.testing.assert_array_equal(mask, encoded.residue_mask)  # residues only: not </s>, not padding
    real = encoded.attention_mask.astype(bool)
    assert hiddens.shape == ref_hiddens.shape and np.abs(hiddens - ref_hiddens)[real].max() < 1e-4
    assert np.abs(embeddings - ref_embeddings).max() < 1e-4
    assert cosine_rows(embeddings, ref_embeddings).min() > 0.9999
    np.testing.assert_allclose(spaced, embeddings, atol=1e-6)  # "M K T" is "MKT"
    print(f"served vs PyTorch: hiddens max abs {np.abs(hiddens - ref_hiddens)[real].max():.2e}, "
          f"embeddings max abs {np.abs(embeddings - ref_embeddings).max():.2e}, "
          f"min cosine {cosine_rows(embeddings, ref_embeddings).min():.7f}")
