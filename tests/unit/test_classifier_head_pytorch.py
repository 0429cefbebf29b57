"""Fine-tuned heads (issue 17, part 4) in PyTorch: LoadedModel.classifier from Hugging Face
*ForSequenceClassification / *ForTokenClassification directories, compared with transformers' own
classes on the same files (tiny random models with every parameter perturbed, and rxnfp's real
bert_ft_10k_25s), plus the strict key checks and the served label model (the head graph's ONNX
export: tests/export/test_classifier_head.py)."""


from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bionemo_export.models import LoadedModel, get_family
from bionemo_export.models.bert import ANTIBERTY_VOCAB, rxnfp_checkpoint
from bionemo_export.models.classifier import ClassifierHead
from bionemo_export.models.readers import CheckpointError
from bionemo_export.serving.tokenizers import Encoded
from bionemo_export.testing.checkpoints import save_huggingface, save_random_checkpoint
from tests.helpers.random_models import perturb

ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO", ".", "-", "<null_1>", "<mask>"]


HIDDEN, LAYERS, HEADS, FFN = 32, 2, 4, 64


ATOL = 1e-4


PROTEINS = ["MKTAY", "MSLKRKNIALIPAAGIGVRFG", "EVQLVESGGGLVQ"]


LABELS = {0: "binder", 1: "non-binder", 2: "unknown"}


def esm_config(**settings) -> transformers.EsmConfig:
    base = dict(vocab_size=len(ESM_VOCAB), pad_token_id=1, mask_token_id=32, hidden_size=HIDDEN,
                num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN, layer_norm_eps=1e-5,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, position_embedding_type="rotary",
                token_dropout=True, emb_layer_norm_before=False, max_position_embeddings=1026)
    return transformers.EsmConfig(**{**base, **settings})


def bert_config(**settings) -> transformers.BertConfig:
    base = dict(vocab_size=len(ANTIBERTY_VOCAB), pad_token_id=0, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, intermediate_size=FFN, max_position_embeddings=512,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertConfig(**{**base, **settings})


CLASSES = {
    "esm-sequence": (transformers.EsmForSequenceClassification, esm_config, ESM_VOCAB, "esm2"),
    "esm-token": (transformers.EsmForTokenClassification, esm_config, ESM_VOCAB, "esm2"),
    "bert-sequence": (transformers.BertForSequenceClassification, bert_config, ANTIBERTY_VOCAB, "bert"),
    "bert-token": (transformers.BertForTokenClassification, bert_config, ANTIBERTY_VOCAB, "bert"),
}


def make(kind: str, out: Path, seed: int = 5, **settings) -> tuple[transformers.PreTrainedModel, Path]:
    cls, config, vocab, _ = CLASSES[kind]
    torch.manual_seed(seed)
    model = perturb(cls(config(**settings)), seed)
    return model, save_huggingface(model, out, vocab)


def head_of(loaded: LoadedModel) -> ClassifierHead:
    """The fine-tuned head of a checkpoint that carries one."""
    assert loaded.classifier is not None, f"{loaded.checkpoint} loaded without a classifier head"
    return loaded.classifier


def served_logits(loaded: LoadedModel, sequences: list[str]) -> tuple[torch.Tensor, Encoded]:
    """The repository's computation: encoder, then the fine-tuned head."""
    head = head_of(loaded)
    encoded = loaded.tokenizer.encode(sequences)
    with torch.inference_mode():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in
                                      (encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        return head(hiddens), encoded


def reference_logits(model, encoded) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=torch.from_numpy(encoded.input_ids),
                     attention_mask=torch.from_numpy(encoded.attention_mask)).logits


@pytest.mark.parametrize("kind", list(CLASSES))
def test_logits_match_transformers(kind, tmp_path):
    model, folder = make(kind, tmp_path / kind, num_labels=3, id2label=LABELS,
                         label2id={v: k for k, v in LABELS.items()})
    loaded = get_family(CLASSES[kind][3]).load(folder)
    head = loaded.classifier
    assert head is not None and loaded.lm_head is None
    assert head.labels == ("binder", "non-binder", "unknown")
    assert head.problem_type == "single_label_classification"
    assert head.per_token == kind.endswith("token")
    logits, encoded = served_logits(loaded, PROTEINS)
    expected = reference_logits(model, encoded)
    assert logits.shape == expected.shape
    if head.per_token:
        valid = torch.from_numpy(encoded.attention_mask.astype(bool))
        assert float((logits - expected).abs()[valid].max()) <= ATOL
    else:
        assert logits.shape == (3, 3)
        assert float((logits - expected).abs().max()) <= ATOL


def test_regression_head_returns_its_values(tmp_path):
    model, folder = make("bert-sequence", tmp_path / "reg", num_labels=1, problem_type="regression")
    loaded = get_family("bert").load(folder)
    assert head_of(loaded).problem_type == "regression" and head_of(loaded).labels == ("LABEL_0",)
    logits, encoded = served_logits(loaded, PROTEINS)
    assert logits.shape == (3, 1)
    assert float((logits - reference_logits(model, encoded)).abs().max()) <= ATOL


def test_problem_type_defaults_like_transformers(tmp_path):
    _, folder = make("esm-sequence", tmp_path / "one", num_labels=1)
    assert head_of(get_family("esm2").load(folder)).problem_type == "regression"
    _, folder = make("esm-token", tmp_path / "multi", num_labels=4, problem_type="multi_label_classification")
    assert head_of(get_family("esm2").load(folder)).problem_type == "multi_label_classification"


def test_real_rxnfp_bert_ft_10k_25s_matches_bert_for_sequence_classification():
    folder = rxnfp_checkpoint("bert_ft_10k_25s")
    loaded = get_family("bert").load(folder)
    head = head_of(loaded)
    config = json.loads((folder / "config.json").read_text())
    assert config["num_labels"] == 50 and len(config["id2label"]) == 2
    assert head.labels == tuple(f"LABEL_{i}" for i in range(50))
    assert head.problem_type == "single_label_classification" and not head.per_token
    assert loaded.lm_head is None
    model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
    assert model.config.num_labels == 50
    smiles = ["CC(=O)O.OCC>>CC(=O)OCC", "Brc1ccccc1.OB(O)c1ccccc1>>c1ccc(-c2ccccc2)cc1", "CCO"]
    logits, encoded = served_logits(loaded, smiles)
    expected = reference_logits(model, encoded)
    assert logits.shape == (3, 50)
    assert float((logits - expected).abs().max()) <= ATOL
    assert logits.argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_labels_fill_unnamed_ids(tmp_path):
    _, folder = make("bert-token", tmp_path / "tok", num_labels=3)
    config = json.loads((folder / "config.json").read_text())
    config["num_labels"], config["id2label"] = 5, {"1": "helix"}
    config.pop("label2id", None)
    (folder / "config.json").write_text(json.dumps(config))
    # the weights have 3 rows: the strict check names the file and the shapes
    with pytest.raises(CheckpointError, match="classifier.weight is .3, 32., expected .5, 32."):
        get_family("bert").load(folder)
    config["num_labels"] = 3
    (folder / "config.json").write_text(json.dumps(config))
    assert head_of(get_family("bert").load(folder)).labels == ("LABEL_0", "helix", "LABEL_2")


def test_missing_and_unexpected_head_keys_are_errors(tmp_path):
    _, folder = make("esm-sequence", tmp_path / "seq", num_labels=2)
    weights = load_file(folder / "model.safetensors")
    weights.pop("classifier.out_proj.bias")
    weights["classifier.extra.weight"] = torch.zeros(2)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing keys: .*classifier\.out_proj\.bias.*unexpected keys: "
                                              r".*classifier\.extra\.weight"):
        get_family("esm2").load(folder)


def test_keys_decide_without_architectures(tmp_path):
    _, folder = make("esm-token", tmp_path / "tok", num_labels=2)
    config = json.loads((folder / "config.json").read_text())
    config.pop("architectures", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert head_of(get_family("esm2").load(folder)).per_token


def test_masked_lm_and_base_checkpoints_have_no_classifier(tmp_path):
    folder = save_random_checkpoint("esm2", tmp_path / "mlm")
    loaded = get_family("esm2").load(folder)
    assert loaded.classifier is None and loaded.lm_head is not None


# ------------------------------------------------------------------ served label names (serving/labels.py)
def test_label_names_for_each_problem_type():
    from bionemo_export.serving.labels import label_names

    logits = np.array([[0.1, 2.0, -1.0], [3.0, -2.0, 0.5]], dtype=np.float32)
    names = ("a", "b", "c")
    assert label_names(logits, names, "single_label_classification").tolist() == [b"b", b"a"]
    assert label_names(logits, names, "multi_label_classification").tolist() == [b"a,b", b"a,c"]
    assert label_names(np.array([[0.25], [-1.5]], dtype=np.float32), ("LABEL_0",), "regression").tolist() == \
        [b"0.25", b"-1.5"]
    per_token = label_names(np.zeros((2, 4, 3), dtype=np.float32), names, "single_label_classification")
    assert per_token.shape == (2, 4) and per_token[1, 3] == b"a"


def test_label_model_answers_each_request_and_refuses_bad_shapes(monkeypatch):
    from bionemo_export.serving.labels import LabelModel
    from bionemo_export.serving.responses import Responder
    from tests.helpers import fake_pb_utils

    pb = fake_pb_utils.install(monkeypatch)
    model = LabelModel(["x", "y"], "single_label_classification", Responder("m_labels"))
    requests = [pb.request({"logits": np.array([[0.0, 1.0], [2.0, 1.0]], dtype=np.float32)}),
                pb.request({"logits": np.zeros((1, 3), dtype=np.float32)}),
                pb.request({"logits": np.array([[[1.0, 0.0], [0.0, 1.0]]], dtype=np.float32)})]
    responses, _ = model.execute(requests)
    assert responses[0].output("label").tolist() == [[b"y"], [b"x"]]
    assert responses[1].has_error() and "must have shape [batch, 2]" in responses[1].error().message()
    assert responses[1].error().code() == pb.TritonError.INVALID_ARG
    assert responses[2].output("label").tolist() == [[b"x", b"y"]]
