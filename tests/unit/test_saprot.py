"""The saprot family (models/saprot.py, tokenizers/structure_aware.py) against transformers' own
EsmForMaskedLM: a random SaProt directory (EsmForMaskedLM + SaProt's 446-token vocab.txt) tokenizes
as its vocab.txt read directly says, computes what transformers computes, scores variants as
SaProt's predict_mut does (brute force, tests/helpers/saprot_reference.py), and foreign or broken
directories are refused with the reason."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bionemo_export.checkpoint_report import inspect_checkpoint
from bionemo_export.errors import InvalidInputError
from bionemo_export.models import get_family, load_checkpoint
from bionemo_export.models.readers import CheckpointError
from bionemo_export.serving.responses import Responder
from bionemo_export.serving.scores import VariantScorer, structure_reader
from bionemo_export.serving.scoring import ScoringError, ScoringLimits, plan_request
from bionemo_export.serving.tokenizers.character import TokenizationError
from bionemo_export.serving.tokenizers.structure_aware import StructureAwareTokenizer, saprot_vocabulary
from bionemo_export.testing.checkpoints import save_huggingface, save_random_checkpoint, tiny_config
from tests.helpers import fake_pb_utils
from tests.helpers.random_models import saprot_checkpoint
from tests.helpers.saprot_reference import marginal_scores, pairs, predict_mut, residue_log_probs, token_ids, vocab_ids

WILD_TYPE = "MdKvTpAyYnIwArKqQhRgQdIlSvFtVmKfSsHaFeSiRkQc"  # 22 residues, every 3Di letter
PLAIN = "MKTAYIAKQRQISFVKSHFSRQ"
VARIANTS = ["M1A", "K2R:T3S", "Y5W", "A4A", "Q22E:R21K:S20T", "K2A:T3G"]


@pytest.fixture(scope="module")
def saprot(tmp_path_factory):
    """A random SaProt checkpoint with every parameter moved off its initial value (so that the
    log-probabilities are far from uniform and the scores far from 0)."""
    folder, _ = saprot_checkpoint(tmp_path_factory.mktemp("saprot") / "checkpoint", seed=11)
    return folder, load_checkpoint(folder), transformers.EsmForMaskedLM.from_pretrained(folder).eval()


# ------------------------------------------------------------------------------ vocabulary and tokenizer
def test_the_vocabulary_is_saprots_order(tmp_path):
    """Spot facts of SaProt's vocabulary (5 specials, then residue-major pairs), and the file the random
    checkpoint writes (testing/checkpoints.py, built apart from the tokenizer's) is the same list."""
    vocab = saprot_vocabulary()
    assert len(vocab) == 446 and vocab[:5] == ["<cls>", "<pad>", "<eos>", "<unk>", "<mask>"]
    assert vocab[5:8] == ["Ap", "Ay", "An"] and vocab[25] == "A#" and vocab[26] == "Cp"
    assert vocab.index("Mp") == 5 + 10 * 21 and vocab[425] == "#p" and vocab[445] == "##"
    folder = save_random_checkpoint("saprot", tmp_path / "ckpt")
    assert (folder / "vocab.txt").read_text().splitlines() == vocab


@pytest.mark.parametrize("text, plain", [(WILD_TYPE, False), (PLAIN, True), ("M#E#V#", False), ("##Kd#e", False),
                                         ("MK#AY", True), ("A", True), ("Ac", False)])
def test_tokens_are_the_vocab_txt_ids_of_the_pairs(saprot, text, plain):
    folder, loaded, _ = saprot
    vocab = vocab_ids(folder)
    encoded = loaded.tokenizer.encode([text])
    expected = token_ids(vocab, pairs(text, plain=plain))
    assert encoded.input_ids.tolist() == expected.tolist()
    assert encoded.residue_mask.tolist() == [[False] + [True] * (expected.shape[1] - 2) + [False]]


def test_a_batch_of_both_forms_is_padded_per_residue(saprot):
    folder, loaded, _ = saprot
    vocab = vocab_ids(folder)
    encoded = loaded.tokenizer.encode(["MdEv", "MEVK", b"Kc"])
    assert encoded.input_ids.tolist() == [
        [0, vocab["Md"], vocab["Ev"], 2, 1, 1], [0, vocab["M#"], vocab["E#"], vocab["V#"], vocab["K#"], 2],
        [0, vocab["Kc"], 2, 1, 1, 1]]
    assert encoded.attention_mask.sum(1).tolist() == [4, 6, 3]


@pytest.mark.parametrize("text, message", [
    ("MdEvV", "sequence 0 is structure-aware (it holds lowercase 3Di letters) but has an odd length, 5 characters"),
    ("mdEv", "sequence 0 has 'm' at character 0 (residue 1), which is not one of SaProt's residues; a residue is an "
             "uppercase letter"),
    ("MdEb", "sequence 0 has 'b' at character 3 (residue 2's structure letter), which is not a Foldseek 3Di letter"),
    ("MdEV", "sequence 0 has 'V' at character 3 (residue 2's structure letter), which is not a Foldseek 3Di letter"),
    ("MKXV", "sequence 0 has 'X' at character 2 (residue 3), which is not one of SaProt's residues; residues: "
             "ACDEFGHIKLMNPQRSTVWY, and '#' for a masked residue"),
    ("Md_v", "sequence 0 has '_' at character 2 (residue 2)"),
    ("MKé", "sequence 0 has an invalid character 'é' at character 2"),
    ("", "sequence 0 is empty"),
])
def test_bad_sequences_are_refused_naming_the_problem(text, message):
    tokenizer = StructureAwareTokenizer(saprot_vocabulary(), max_length=8)
    with pytest.raises(TokenizationError) as raised:
        tokenizer.encode(["MdEv", text][1:])
    assert message in str(raised.value)


def test_limits_count_residues_not_characters():
    tokenizer = StructureAwareTokenizer(saprot_vocabulary(), max_length=5)  # 3 residues
    assert tokenizer.encode(["MdEvVp"]).input_ids.shape == (1, 5)
    with pytest.raises(TokenizationError, match="sequence 0 has 4 residues; the maximum is 3"):
        tokenizer.encode(["MdEvVpKc"])
    assert tokenizer.encode(["MdEvVpKc"], truncate=True).input_ids.shape == (1, 5)
    again = StructureAwareTokenizer.from_dict(json.loads(json.dumps(tokenizer.to_dict())))
    assert again.encode(["MdEvVp", "MEV"]).input_ids.tolist() == tokenizer.encode(["MdEvVp", "MEV"]).input_ids.tolist()


# ------------------------------------------------------------------------------ the model
def test_hiddens_and_log_probs_equal_transformers(saprot):
    folder, loaded, reference = saprot
    assert loaded.family.name == "saprot" and loaded.alphabet == tuple("ACDEFGHIKLMNPQRSTVWY")
    vocab = vocab_ids(folder)
    texts, plain = [WILD_TYPE, PLAIN, "MdEv#vVp"], [False, True, False]
    encoded = loaded.tokenizer.encode(texts)
    with torch.no_grad():
        hiddens, embeddings = loaded.encoder(*(torch.from_numpy(a) for a in (
            encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        log_probs = loaded.lm_head(hiddens).numpy()
    for row, (text, is_plain) in enumerate(zip(texts, plain)):
        ids = token_ids(vocab, pairs(text, plain=is_plain))
        with torch.no_grad():
            expected = reference(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        tokens = ids.shape[1]
        assert (hiddens[row, :tokens] - expected).abs().max().item() < 1e-5
        assert (embeddings[row] - expected[1:-1].mean(0)).abs().max().item() < 1e-5
        wanted = residue_log_probs(reference, vocab, pairs(text, plain=is_plain))
        np.testing.assert_allclose(log_probs[row, :tokens], wanted, atol=1e-5)
        assert np.ptp(wanted[1:-1]) > 1.0  # far from uniform: the comparison can tell


# ------------------------------------------------------------------------------ scores
@pytest.fixture
def pb_utils(monkeypatch):
    return fake_pb_utils.install(monkeypatch)


def _scorer(loaded, calls, default_method="variant-masked"):
    def run(sequences: list[str]):
        calls.append(list(sequences))
        encoded = loaded.tokenizer.encode(sequences)
        with torch.inference_mode():
            hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in (
                encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
            return loaded.lm_head(hiddens).numpy(), encoded.residue_mask
    return VariantScorer(run, alphabet=loaded.alphabet, mask_char="#", limits=ScoringLimits(), chunk=4,
                         responder=Responder("saprot_scores"), default_method=default_method, structure_aware=True)


def _ask(scorer, wild_type: str, variants: list[str], method: str | None = None):
    inputs = {"sequences": np.array([[wild_type.encode()]], dtype=np.object_),
              "variants": np.array([[v.encode() for v in variants]], dtype=np.object_)}
    if method is not None:
        inputs["method"] = np.array([[method.encode()]], dtype=np.object_)
    return scorer.execute([fake_pb_utils.request(inputs)])[0][0]


@pytest.mark.parametrize("wild_type, plain", [(WILD_TYPE, False), (PLAIN, True)])
def test_the_default_scores_are_saprots_predict_mut(pb_utils, saprot, wild_type, plain):
    folder, loaded, reference = saprot
    vocab = vocab_ids(folder)
    calls: list[list[str]] = []
    response = _ask(_scorer(loaded, calls), wild_type, VARIANTS)
    assert not response.has_error(), response.error()
    served = response.output("scores")[0]
    tokens = pairs(wild_type, plain=plain)
    expected = [predict_mut(reference, vocab, tokens, variant) for variant in VARIANTS]
    np.testing.assert_allclose(served, expected, atol=1e-4)
    assert served[VARIANTS.index("A4A")] == 0.0 and np.ptp(expected) > 0.5
    # one copy per distinct set of mutated positions (K2R:T3S and K2A:T3G share theirs), all masked at once
    sent = [text for call in calls for text in call]
    assert len(sent) == 5 and all(len(call) <= 4 for call in calls)
    letters = wild_type[1::2] if not plain else "#" * len(wild_type)
    assert sent[1] == "".join(("#" if i in (1, 2) else r) + s for i, (r, s) in
                              enumerate(zip(wild_type[0::2] if not plain else wild_type, letters)))


def test_a_default_method_that_scores_no_variants_is_refused_at_load(saprot):
    _, loaded, _ = saprot
    for wrong in ("pll", "wt-marginals"):
        with pytest.raises(ValueError, match=f"parameter default_method is '{wrong}', not one of the methods that "
                                             "score variants"):
            _scorer(loaded, [], default_method=wrong)


@pytest.mark.parametrize("method", ["wt-marginal", "masked-marginal"])
def test_esms_methods_read_saprots_marginals(pb_utils, saprot, method):
    folder, loaded, reference = saprot
    response = _ask(_scorer(loaded, []), WILD_TYPE, VARIANTS, method)
    assert not response.has_error(), response.error()
    expected = marginal_scores(reference, vocab_ids(folder), pairs(WILD_TYPE), VARIANTS, method)
    np.testing.assert_allclose(response.output("scores")[0], expected, atol=1e-4)


def test_variant_masked_differs_from_masked_marginal_only_for_multi_mutants(pb_utils, saprot):
    _, loaded, _ = saprot
    joint = _ask(_scorer(loaded, []), WILD_TYPE, VARIANTS).output("scores")[0]
    single = _ask(_scorer(loaded, []), WILD_TYPE, VARIANTS, "masked-marginal").output("scores")[0]
    singles = [i for i, v in enumerate(VARIANTS) if ":" not in v]
    np.testing.assert_allclose(joint[singles], single[singles], atol=1e-5)
    multi = [i for i, v in enumerate(VARIANTS) if ":" in v]
    assert np.abs(joint[multi] - single[multi]).min() > 1e-3


@pytest.mark.parametrize("wild_type, variant, message", [
    ("MdEvV", "M1A", "input sequences: the wild type 'MdEvV' is structure-aware (it holds lowercase 3Di letters) but "
                     "has an odd length, 5 characters"),
    ("mdEv", "E2A", "input sequences: the wild type 'mdEv' has 'm' at character 0 (residue 1), which is not one of "
                    "SaProt's residues; a residue is an uppercase letter"),
    ("MdEz", "M1A", "input sequences: the wild type 'MdEz' has 'z' at character 3 (residue 2's structure letter), "
                    "which is not a Foldseek 3Di letter"),
    ("MdEv", "E1A", "variants[0] = 'E1A': position 1 is M in the wild type, not E"),
    ("MdEv", "M3A", "variants[0] = 'M3A': position 3 is out of range: the wild type has 2 residues (positions 1 to 2)"),
    ("MdEv", "M1d", "variants[0] = 'M1d': the mutant residue 'd' is not in the model's alphabet"),
    ("#dEv", "E2A", "input sequences: position 1 is the mask character '#'; a wild type to score has no masked "
                    "residues"),
])
def test_bad_scoring_input_is_refused_naming_it(wild_type, variant, message):
    with pytest.raises(ScoringError) as raised:
        plan_request(wild_type, [variant], None, alphabet=tuple("ACDEFGHIKLMNPQRSTVWY"), mask_char="#",
                     default_method="variant-masked", split_structure=structure_reader())
    assert message in str(raised.value)


# ------------------------------------------------------------------------------ checkpoints
def test_the_family_is_inferred_and_reported(saprot):
    folder, _, _ = saprot
    report = inspect_checkpoint(folder)
    assert report.ok and report.family == "saprot", report.problems
    assert report.tokenizer["kind"] == "StructureAwareTokenizer" and report.tokenizer["vocabulary"] == 446
    assert report.tasks == ["embeddings", "hiddens", "logits", "scores", "layers", "attentions"]
    assert "--model saprot" in (report.command or "")
    with pytest.raises(CheckpointError, match="whose vocab.txt pairs residues with Foldseek 3Di letters .SaProt's., "
                                              "which the saprot family reads, not esm2: use `family` saprot"):
        load_checkpoint(folder, "esm2")
    with pytest.raises(InvalidInputError, match="SaProt's vocabulary.*use `family` saprot"):
        get_family("esm2").describe(_read(folder))


def _read(folder):
    from bionemo_export.models.readers import read_checkpoint

    return read_checkpoint(folder)


def test_bad_checkpoints_are_refused_with_the_reason(tmp_path):
    esm2 = save_random_checkpoint("esm2", tmp_path / "esm2")
    with pytest.raises(CheckpointError, match=r"vocab_size is 33; SaProt's vocabulary has 446"):
        get_family("saprot").load(esm2)
    esmc = save_random_checkpoint("esmc", tmp_path / "esmc")
    with pytest.raises(CheckpointError, match="has model_type 'esmc', expected 'esm'"):
        get_family("saprot").load(esmc)

    folder = save_random_checkpoint("saprot", tmp_path / "saprot")
    vocab = saprot_vocabulary()
    vocab[5], vocab[6] = vocab[6], vocab[5]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    with pytest.raises(CheckpointError, match=r"is not SaProt's vocabulary: line 6 is 'Ay', expected 'Ap'"):
        load_checkpoint(folder)  # still recognized as SaProt's (paired tokens), then refused
    (folder / "vocab.txt").write_text("\n".join(saprot_vocabulary()[:-1]) + "\n")
    with pytest.raises(CheckpointError, match="has 445 tokens; SaProt's vocabulary has 446"):
        get_family("saprot").load(folder)
    (folder / "vocab.txt").unlink()
    with pytest.raises(CheckpointError, match="vocab.txt is missing"):
        get_family("saprot").load(folder)
    (folder / "vocab.txt").write_text("\n".join(saprot_vocabulary()) + "\n")

    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(CheckpointError, match="has model_type 'bert', expected 'esm'"):
        get_family("saprot").load(folder)
    with pytest.raises(CheckpointError, match="name its model family"):  # a paired vocab.txt alone says nothing
        load_checkpoint(folder)
    (folder / "config.json").write_text(json.dumps(config))

    weights = load_file(folder / "model.safetensors")
    key = "esm.encoder.layer.0.attention.self.query.weight"
    broken = {k: v for k, v in weights.items() if k != key}
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"missing keys: {key.removeprefix('esm.')}"):
        load_checkpoint(folder)
    broken[key] = torch.zeros(3, 3)
    save_file(broken, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"wrong shapes: encoder.layer.0.attention.self.query.weight is \(3, 3\)"):
        load_checkpoint(folder)


# ------------------------------------------------------------------------------ windows (--max-residues)
def test_long_proteins_are_cut_in_windows_of_residues_not_characters(pb_utils):
    """A model built with --max-residues cuts a structure-aware sequence between residues (two
    characters each), and a plain one likewise after reading it with unknown structure."""
    from bionemo_export.serving.encoding import WindowedRows, WindowedSequenceInputs
    from bionemo_export.serving.responses import RequestError

    tokenizer = StructureAwareTokenizer(saprot_vocabulary(), max_length=10)  # windows of 8 residues
    inputs = WindowedSequenceInputs(tokenizer, False, RequestError, max_residues=40, overlap=2)
    vocab = {token: i for i, token in enumerate(saprot_vocabulary())}
    for text, plain in ((WILD_TYPE, False), (PLAIN, True)):
        rows = inputs(fake_pb_utils.request({"sequences": np.array([[text.encode()]], dtype=np.object_)}))
        assert isinstance(rows, WindowedRows)
        layout = rows.layout
        tokens = pairs(text, plain=plain)
        assert layout.rows > 1 and int(layout.end[-1]) == len(tokens) == 22
        for row, (start, end) in enumerate(zip(layout.start.tolist(), layout.end.tolist())):
            expected = token_ids(vocab, tokens[start:end])[0].tolist()
            assert rows[0][row, :len(expected)].tolist() == expected
    with pytest.raises(TokenizationError, match="has 'z' at character 3"):
        inputs(fake_pb_utils.request({"sequences": np.array([[b"MdEz" * 6]], dtype=np.object_)}))


# ------------------------------------------------------------------------------ fine-tuned heads
@pytest.mark.parametrize("cls", [transformers.EsmForSequenceClassification, transformers.EsmForTokenClassification])
def test_fine_tuned_heads_compute_what_transformers_computes(tmp_path, cls):
    """A SaProt fine-tuned for a task (EsmFor*Classification over SaProt's vocabulary) serves
    predictions: the encoder and head give transformers' logits on vocab.txt's ids."""
    config = tiny_config("saprot", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64)
    config.num_labels, config.id2label = 3, {0: "a", 1: "b", 2: "c"}
    config.label2id = {"a": 0, "b": 1, "c": 2}
    torch.manual_seed(2)
    model = cls(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.3)
    folder = save_huggingface(model, tmp_path / "finetuned", saprot_vocabulary())
    loaded = load_checkpoint(folder)
    assert loaded.family.name == "saprot" and loaded.classifier is not None and loaded.lm_head is None
    assert loaded.servable() == ("embeddings", "hiddens", "predictions", "layers", "attentions")
    ids = token_ids(vocab_ids(folder), pairs(WILD_TYPE))
    encoded = loaded.tokenizer.encode([WILD_TYPE])
    assert encoded.input_ids.tolist() == ids.tolist()
    with torch.inference_mode():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in (
            encoded.input_ids, encoded.attention_mask, encoded.residue_mask)))
        got = loaded.classifier(hiddens)
        expected = model(input_ids=ids).logits
    assert got.shape == expected.shape and float((got - expected).abs().max()) < 1e-5


def test_other_vocabularies_with_two_letter_tokens_are_not_taken_for_saprots():
    """rxnfp's SMILES BERT has `Cl` and `Br` (an uppercase residue letter and a lowercase 3Di letter):
    it is still read as the bert family it names, not routed to saprot."""
    from bionemo_export.models.base import form_family
    from bionemo_export.models.bert import rxnfp_checkpoint

    folder = rxnfp_checkpoint("bert_pretrained")
    assert form_family(_read(folder)) is None
    assert load_checkpoint(folder, "bert").family.name == "bert"
