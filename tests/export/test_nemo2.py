"""BioNeMo 2 / NeMo 2 ESM-2 directories, written from small random transformers models by the
documented layout (tests/helpers/nemo2_checkpoints.py), load to models whose hiddens and
log-probabilities equal the source's; the reader unpickles nothing but checkpoint metadata and
refuses bad directories with errors naming the file and the key."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import yaml
from typer.testing import CliRunner

from bionemo_export.models import LoadedModel, get_family, load_checkpoint
from bionemo_export.models.encoder import PooledEncoder
from bionemo_export.models.lm_head import MaskedLMHead
from bionemo_export.models.readers import CheckpointError, read_checkpoint
from tests.helpers.nemo2_checkpoints import (
    esm2_model_yaml,
    esm2_to_megatron_core,
    random_esm2,
    write_esm2_nemo2,
    write_nemo2,
)

PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "MSLKRKNIALIPAAGIGVRFG", "AC", "LAGVSERTIDPKQNFYMHWCXBUZO"]
EXACT = {"bias_activation_fusion": False}
"""torch's gelu unfused: exact GELU, as transformers' EsmModel computes."""


@pytest.fixture(scope="module")
def source():
    return random_esm2(seed=3)


@pytest.fixture(scope="module")
def exact_dir(source, tmp_path_factory) -> Path:
    return write_esm2_nemo2(tmp_path_factory.mktemp("nemo2") / "esm2", source, **EXACT)


def run(loaded, sequences):
    """(hiddens, embeddings, log-probs or None, attention mask, input ids) of the loaded model."""
    encoded = loaded.tokenizer.encode(sequences)
    ids, mask, residues = (torch.from_numpy(a) for a in (encoded.input_ids, encoded.attention_mask,
                                                          encoded.residue_mask))
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(ids, mask, residues)
        log_probs = loaded.lm_head(hiddens) if loaded.lm_head is not None else None
    return hiddens, embeddings, log_probs, mask.bool(), ids, residues


def head_alphabet_ids(loaded: LoadedModel) -> tuple[int, ...]:
    """The vocabulary ids whose log-probabilities the loaded masked-LM head returns, in order."""
    assert isinstance(loaded.lm_head, MaskedLMHead), loaded.lm_head
    return loaded.lm_head.alphabet_ids


def reference(model, ids, mask, residues, alphabet_ids, *, tanh: bool = False):
    """(hiddens, residue-mean embeddings, log_softmax of the logits over the alphabet) from the
    transformers EsmForMaskedLM itself (its MLP's GELU swapped for the tanh one when asked)."""
    originals = {}
    if tanh:
        for layer in model.esm.encoder.layer:
            originals[layer] = layer.intermediate.forward
            layer.intermediate.forward = lambda x, dense=layer.intermediate.dense: torch.nn.functional.gelu(
                dense(x), approximate="tanh")
    try:
        with torch.no_grad():
            output = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
    finally:
        for layer, forward in originals.items():
            layer.intermediate.forward = forward
    hiddens = output.hidden_states[-1]
    weights = residues.unsqueeze(-1).float()
    embeddings = (hiddens * weights).sum(1) / weights.sum(1)
    log_probs = torch.log_softmax(output.logits[..., list(alphabet_ids)], dim=-1)
    return hiddens, embeddings, log_probs


def assert_equals_source(loaded, model, *, tanh: bool = False, sequences=PROTEINS):
    hiddens, embeddings, log_probs, mask, ids, residues = run(loaded, sequences)
    expected = reference(model, ids, mask, residues, head_alphabet_ids(loaded), tanh=tanh)
    assert (hiddens[mask] - expected[0][mask]).abs().max() < 1e-5
    assert (embeddings - expected[1]).abs().max() < 1e-5
    assert log_probs is not None
    assert (log_probs[mask] - expected[2][mask]).abs().max() < 1e-5
    return hiddens, mask


# ------------------------------------------------------------------------------------ reading
def test_the_directory_is_read_with_stacked_layers_and_the_rest_skipped(exact_dir):
    checkpoint = read_checkpoint(exact_dir)
    assert (checkpoint.form, checkpoint.weights_name) == ("nemo2", "weights/")
    assert checkpoint.model_class == "bionemo.esm2.model.model.ESM2Config"
    assert checkpoint.config["config"]["num_layers"] == 2
    assert checkpoint.weights["module.encoder.layers.self_attention.linear_qkv.weight"].shape == (2, 96, 32)
    assert checkpoint.weights["module.embedding.word_embeddings.weight"].shape == (128, 32)
    assert not [key for key in checkpoint.weights if key.startswith("optimizer.") or "_extra_state" in key]
    reasons = set(checkpoint.skipped.values())
    assert "optimizer state" in reasons and "TransformerEngine metadata (_extra_state), not a weight" in reasons
    assert "common.pt" in checkpoint.skipped
    assert sum(1 for key in checkpoint.skipped if "._extra_state/shard_" in key) == 3 * 2  # 3 modules, 2 layers
    assert checkpoint.skipped["module.encoder.layers.mlp.linear_fc1._extra_state/shard_1.0_2.1"] == \
        "TransformerEngine metadata (_extra_state), not a weight"


def test_hiddens_embeddings_and_log_probs_equal_the_transformers_model(exact_dir, source):
    loaded = load_checkpoint(exact_dir, "esm2")
    assert loaded.family.name == "esm2" and loaded.description["activation"] == "gelu"
    assert loaded.description["checkpoint_form"] == "NeMo 2 directory (bionemo.esm2.model.model.ESM2Config, weights/)"
    assert loaded.tokenizer.vocab_size == 33 and loaded.tokenizer.max_length == 1024
    assert_equals_source(loaded, source, sequences=[*PROTEINS, "MKT_YIAK__QISF"])  # masked residues too


def test_the_family_is_inferred_from_the_config_class(exact_dir):
    assert load_checkpoint(exact_dir).family.name == "esm2"
    with pytest.raises(CheckpointError, match="esm2 family reads, not bert: use `family` esm2"):
        load_checkpoint(exact_dir, "bert")


def test_inspect_finds_the_esm2_family_alone(exact_dir):
    """esm1 inherits esm2's readers but reads no NeMo 2 directory: inspect finds esm2 alone."""
    from bionemo_export.checkpoint_report import inspect_checkpoint

    report = inspect_checkpoint(exact_dir)
    assert (report.form, report.family, report.ok) == ("nemo2", "esm2", True), report.problems
    with pytest.raises(CheckpointError, match="the esm1 family reads nemo, fair_esm, huggingface checkpoints"):
        get_family("esm1").describe(read_checkpoint(exact_dir))


def test_an_unknown_config_class_needs_model(source, tmp_path):
    path = write_esm2_nemo2(tmp_path / "custom", source, _target_="my_lab.models.MyProteinConfig", **EXACT)
    with pytest.raises(CheckpointError, match=r"MyProteinConfig' in context/model.yaml.*`family`"):
        load_checkpoint(path)
    assert load_checkpoint(path, "esm2").description["nemo2_config"] == "my_lab.models.MyProteinConfig"


def test_esm2configs_defaults_run_megatrons_fused_tanh_gelu(source, tmp_path):
    """ESM2Config's defaults (torch's gelu, bias_activation_fusion: true) make Megatron-core's MLP
    compute the tanh approximation; the loaded model does too, and differs from exact GELU."""
    loaded = load_checkpoint(write_esm2_nemo2(tmp_path / "fused", source))
    assert loaded.description["activation"] == "gelu_tanh"
    hiddens, mask = assert_equals_source(loaded, source, tanh=True)
    exact = load_checkpoint(write_esm2_nemo2(tmp_path / "exact", source, **EXACT))
    assert (hiddens[mask] - run(exact, PROTEINS)[0][mask]).abs().max() > 1e-4


def test_bionemos_esm_gelu_func_is_exact_gelu(source, tmp_path):
    activation = {"_call_": False, "_target_": "bionemo.esm2.model.model.esm_gelu_func"}
    loaded = load_checkpoint(write_esm2_nemo2(tmp_path / "esm_gelu", source, activation_func=activation))
    assert loaded.description["activation"] == "gelu"
    assert_equals_source(loaded, source)


def test_token_dropout_follows_the_config(source, tmp_path):
    without = load_checkpoint(write_esm2_nemo2(tmp_path / "off", source, token_dropout=False, **EXACT))
    encoder = without.encoder
    assert isinstance(encoder, PooledEncoder) and isinstance(encoder.backbone, transformers.EsmModel)
    assert not encoder.backbone.config.token_dropout
    with_it = load_checkpoint(write_esm2_nemo2(tmp_path / "on", source, **EXACT))
    masked = ["MKT_YIAKQRQ"]
    assert (run(without, masked)[0] - run(with_it, masked)[0]).abs().max() > 1e-4


def test_layers_stored_one_by_one_and_an_untied_output_layer(source, tmp_path):
    """Megatron stores non-homogeneous layers as `encoder.layers.<i>.*`; with
    share_embeddings_and_output_weights false the head projects with output_layer.weight."""
    untied = torch.randn(33, 32)

    def per_layer_and_untied(weights):
        for key in [k for k in weights if k.startswith("module.encoder.layers.")]:
            stacked = weights.pop(key)
            for i in range(stacked.shape[0]):
                weights[key.replace("layers.", f"layers.{i}.")] = stacked[i]
        weights["module.output_layer.weight"] = torch.cat([untied, torch.zeros(95, 32)])

    path = write_esm2_nemo2(tmp_path / "untied", source, per_layer_and_untied,
                            share_embeddings_and_output_weights=False, **EXACT)
    loaded = load_checkpoint(path)
    hiddens, _, log_probs, mask, ids, residues = run(loaded, PROTEINS)
    expected_hiddens, _, _ = reference(source, ids, mask, residues, head_alphabet_ids(loaded))
    assert (hiddens[mask] - expected_hiddens[mask]).abs().max() < 1e-5
    head = source.lm_head
    with torch.no_grad():
        features = head.layer_norm(torch.nn.functional.gelu(head.dense(hiddens)))
        logits = features @ untied.T + head.bias
    expected = torch.log_softmax(logits[..., list(head_alphabet_ids(loaded))], dim=-1)
    assert log_probs is not None
    assert (log_probs[mask] - expected[mask]).abs().max() < 1e-5


def test_cli_builds_a_repository_from_a_nemo2_directory(exact_dir, tmp_path):
    from bionemo_export.cli.main import app

    out = tmp_path / "repo"
    result = CliRunner().invoke(app, ["build", "repo", "--model", "esm2", "--checkpoint", str(exact_dir), "--name",
                                      "esm2nv", "--out", str(out), "--tasks", "embeddings"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["verification"]["passed"]
    assert "NeMo 2 directory" in json.dumps(manifest)


# ------------------------------------------------------------------------------------ errors
def test_a_missing_weights_folder_is_named(exact_dir, tmp_path):
    path = tmp_path / "no_weights"
    shutil.copytree(exact_dir / "context", path / "context")
    with pytest.raises(CheckpointError, match=r"no_weights has no weights/ folder"):
        read_checkpoint(path)


def test_a_missing_model_yaml_is_named(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "no_yaml")
    (path / "context" / "model.yaml").unlink()
    with pytest.raises(CheckpointError, match=r"no_yaml has no context/model.yaml"):
        read_checkpoint(path)


def test_a_model_yaml_without_a_config_section_is_named(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "no_config")
    (path / "context" / "model.yaml").write_text(yaml.safe_dump({"_target_": "x.Y", "tokenizer": None}))
    with pytest.raises(CheckpointError, match=r"context/model.yaml has no config: section"):
        load_checkpoint(path, "esm2")


def test_invalid_yaml_is_named_by_its_path(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "bad_yaml")
    (path / "context" / "model.yaml").write_text("config: [unclosed\n")
    with pytest.raises(CheckpointError, match=r"bad_yaml/context/model.yaml is not valid YAML"):
        read_checkpoint(path)


def test_a_missing_key_is_named(source, tmp_path):
    path = write_esm2_nemo2(tmp_path / "missing", source,
                            lambda w: w.pop("module.encoder.final_layernorm.bias"), **EXACT)
    with pytest.raises(CheckpointError, match=r"missing keys: encoder\.emb_layer_norm_after\.bias"):
        load_checkpoint(path)


def test_a_wrong_shape_is_named(source, tmp_path):
    path = write_esm2_nemo2(tmp_path / "ffn", source, ffn_hidden_size=96, **EXACT)
    with pytest.raises(CheckpointError, match=r"wrong shapes: encoder\.layer\.0\.intermediate\.dense\.bias is \(64,\), "
                                              r"expected \(96,\)"):
        load_checkpoint(path)
    path = write_esm2_nemo2(tmp_path / "layers", source, num_layers=3, **EXACT)
    with pytest.raises(CheckpointError,
                       match=r"module\.encoder\.layers\.\S+ has shape \(2, .*config\.num_layers \(3\)"):
        load_checkpoint(path)


@pytest.mark.parametrize(("key", "value"), [
    ("position_embedding_type", "learned_absolute"),
    ("activation_func", {"_call_": False, "_target_": "torch.nn.functional.relu"}),
    ("num_query_groups", 2),
    ("normalization", "RMSNorm"),
    ("rotary_base", 500000),
    ("softmax_scale", 0.125),
    ("biobert_spec_option", "bert_layer_with_transformer_engine_spec"),
    ("hidden_size", {"_target_": "builtins.int"}),
])
def test_settings_an_esm2_cannot_compute_are_refused_by_name(source, tmp_path, key, value):
    path = write_esm2_nemo2(tmp_path / "setting", source, **{key: value})
    with pytest.raises(CheckpointError, match=rf"context/model.yaml: config\.{key} is "):
        load_checkpoint(path, "esm2")


def test_a_zarr_checkpoint_is_refused(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "zarr")
    (path / "weights" / "metadata.json").write_text(json.dumps({"sharded_backend": "zarr"}))
    with pytest.raises(CheckpointError, match=r"sharded_backend is 'zarr'; only 'torch_dist'"):
        read_checkpoint(path)


def test_a_truncated_distcp_file_is_named(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "truncated")
    stored = _metadata(path).storage_data
    name = next(info.relative_path for index, info in stored.items() if index.fqn.startswith("module.embedding."))
    target = path / "weights" / name
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{target.name} is shorter than .*the checkpoint is truncated"):
        read_checkpoint(path)


# ---------------------------------------------------------------- nothing pickled is executed
class Touch:
    """Unpickling it creates `path` (how the tests see whether a pickle was executed)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _metadata(path: Path):
    with (path / "weights" / ".metadata").open("rb") as handle:
        return pickle.load(handle)  # the test's own file


def _write_metadata(path: Path, metadata) -> None:
    (path / "weights" / ".metadata").write_bytes(pickle.dumps(metadata))


def test_a_pickled_global_in_dot_metadata_is_refused(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "hostile")
    sentinel = tmp_path / "ran"
    metadata = _metadata(path)
    metadata.storage_meta.checkpoint_id = Touch(sentinel)
    _write_metadata(path, metadata)
    with pytest.raises(CheckpointError, match=r"\.metadata holds a pickled pathlib\.Path\.touch, which is not "
                                              r"torch\.distributed\.checkpoint metadata"):
        read_checkpoint(path)
    assert not sentinel.exists()


def test_metadata_that_sets_state_on_a_class_or_is_not_a_pickle_is_refused(exact_dir, tmp_path):
    """A BUILD on a class object would change torch's own class for the whole process."""
    import torch.distributed.checkpoint.metadata as dcp_metadata

    path = shutil.copytree(exact_dir, tmp_path / "class_state")

    def text(value: str) -> bytes:
        return b"\x8c" + bytes([len(value)]) + value.encode()

    forged = (b"\x80\x04" + text("torch.distributed.checkpoint.metadata") + text("Metadata") + b"\x93"
              + b"N}" + text("poisoned") + b"K\x01s\x86b.")
    (path / "weights" / ".metadata").write_bytes(forged)
    with pytest.raises(CheckpointError, match=r"\.metadata holds a pickled state for the class Metadata"):
        read_checkpoint(path)
    assert not hasattr(dcp_metadata.Metadata, "poisoned")
    (path / "weights" / ".metadata").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(CheckpointError, match=r"\.metadata is not readable torch\.distributed\.checkpoint metadata"):
        read_checkpoint(path)


def test_a_pickled_global_in_a_distcp_record_is_refused(exact_dir, tmp_path):
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path = shutil.copytree(exact_dir, tmp_path / "hostile_record")
    sentinel = tmp_path / "ran"
    record = path / "weights" / "__9_0.distcp"
    torch.save(Touch(sentinel), record)
    metadata = _metadata(path)
    index = next(i for i in metadata.storage_data if i.fqn == "module.encoder.final_layernorm.weight")
    metadata.storage_data[index] = _StorageInfo(record.name, 0, record.stat().st_size)
    _write_metadata(path, metadata)
    with pytest.raises(CheckpointError, match=r"weights/__9_0\.distcp:module\.encoder\.final_layernorm\.weight@\(0,\): "
                                              "it holds pickled code or objects other than tensors"):
        read_checkpoint(path)
    assert not sentinel.exists()


def test_a_chunk_stored_outside_the_weights_folder_is_refused(exact_dir, tmp_path):
    path = shutil.copytree(exact_dir, tmp_path / "escape")
    metadata = _metadata(path)
    index = next(i for i in metadata.storage_data if i.fqn == "module.encoder.final_layernorm.weight")
    info = metadata.storage_data[index]
    info.relative_path = "../" + info.relative_path
    _write_metadata(path, metadata)
    with pytest.raises(CheckpointError, match=r"is not a file of .*weights with an offset and a length"):
        read_checkpoint(path)


def test_common_pt_is_never_unpickled(source, tmp_path):
    """common.pt holds trainer state only; a pickled global in it is never loaded, let alone run."""
    sentinel = tmp_path / "ran"
    path = write_nemo2(tmp_path / "common", esm2_model_yaml(source.config, **EXACT), esm2_to_megatron_core(source),
                       common={"callbacks": Touch(sentinel)})
    loaded = load_checkpoint(path)
    assert not sentinel.exists() and loaded.family.name == "esm2"
    assert np.isfinite(run(loaded, PROTEINS)[0].numpy()).all()
