"""Every layer's states (issue 29, item 1) for every encoder family: the layers graph a build exports
(layers.onnx beside N_encoder's graph, run by ONNX Runtime) against transformers' own
`output_hidden_states=True` on the same files (ESM-1, ESM C, SaProt, ProtT5; ESM-2 and the real BERTs are
served and compared in tests/e2e/test_e2e_layers.py), MegaMolBART's encoder (the project's own
transformer) against its blocks run by hand, the served logic over the graph for a model without a
BOS token (ProtT5: `bos` refused), and the encoder graph unchanged by the tasks built on request
(contacts, layers, attentions).
"""

from __future__ import annotations

import hashlib
from typing import Any, cast

import numpy as np
import pytest
import torch
import transformers

from bionemo_export.build import BuildRequest, build_repository
from bionemo_export.models import load_checkpoint
from bionemo_export.serving.layers import LayerEmbeddings
from bionemo_export.serving.responses import RequestError, Responder
from bionemo_export.testing.checkpoints import save_random_checkpoint
from tests.helpers import fake_pb_utils
from tests.helpers.random_models import esmc_checkpoint, saprot_checkpoint

ATOL = 1e-4
PROTEINS = ["MKTAYIAKQRQISFVKSHFSRQ", "GVE", "MSLKRKNIALIPAAGIGVRFG"]
SMILES = ["CC(=O)Oc1ccccc1C(=O)O", "CCO", "c1ccccc1"]
REFERENCES = {"esm1": lambda path: transformers.EsmModel.from_pretrained(path, add_pooling_layer=False),
              "esmc": lambda path: transformers.EsmcModel.from_pretrained(path),
              "saprot": lambda path: transformers.EsmModel.from_pretrained(path, add_pooling_layer=False),
              "prott5": lambda path: transformers.T5EncoderModel.from_pretrained(path, attn_implementation="eager")}


SHARED_SEEDS = {"esm1": 3, "prott5": 3, "megamolbart": 5}
"""The seeds of the checkpoints tests/e2e/test_esm1.py, test_prott5.py and the MegaMolBART modules export
(the others: seed 0, docs/developing.md)."""
SHARED_CHECKPOINTS = {"esmc": esmc_checkpoint, "saprot": saprot_checkpoint}
"""The checkpoints tests/e2e/test_esmc.py and test_saprot.py serve (tests/helpers/random_models.py)."""


def _build(family: str, folder, tasks=("layers",)):
    """A build of the layers task (and of the encoder graph every build exports), of a checkpoint
    the family's e2e module builds too (SHARED_SEEDS, SHARED_CHECKPOINTS): its encoder graph from the
    run's graph cache when another test exported it first. No decoder graphs: these tests read the
    layers graph."""
    if family in SHARED_CHECKPOINTS:
        path, _ = SHARED_CHECKPOINTS[family](folder / "ck")
    else:
        path = save_random_checkpoint(family, folder / "ck", seed=SHARED_SEEDS.get(family, 0))
    result = build_repository(BuildRequest(family=family, checkpoint=path, name="g", out=folder / "repo",
                                           backend="python", tasks=tasks, optimize=False))
    return path, result


def _session(result):
    import onnxruntime as ort

    return ort.InferenceSession(str(result.repository / "g_encoder" / "1" / "layers.onnx"),
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("family", list(REFERENCES))
def test_the_exported_layers_graph_equals_transformers_output_hidden_states(tmp_path, family):
    path, result = _build(family, tmp_path)
    loaded = load_checkpoint(path, family)
    reference = REFERENCES[family](path).eval()
    encoded = loaded.tokenizer.encode(PROTEINS)
    names = [f"hiddens_{i}" for i in range(loaded.num_layers + 1)]
    served = [np.asarray(a) for a in _session(result).run(names, {"input_ids": encoded.input_ids,
                                                                  "attention_mask": encoded.attention_mask})]
    with torch.no_grad():
        expected = reference(input_ids=torch.from_numpy(encoded.input_ids),
                             attention_mask=torch.from_numpy(encoded.attention_mask),
                             output_hidden_states=True).hidden_states
    assert len(expected) == len(served) == loaded.num_layers + 1
    real = encoded.attention_mask.astype(bool)
    errors = [float(np.abs(got[real] - want.numpy()[real]).max()) for got, want in zip(served, expected)]
    print(f"{family}: max abs error per layer {errors}")
    assert max(errors) <= ATOL, errors
    # ESM's numbering: the last layer is the encoder's hiddens (after the final layer norm).
    with torch.no_grad():
        hiddens, _ = loaded.encoder(*(torch.from_numpy(a) for a in (encoded.input_ids, encoded.attention_mask,
                                                                     encoded.residue_mask)))
    assert np.abs(served[-1][real] - hiddens.numpy()[real]).max() <= 1e-5


def test_megamolbarts_encoder_layers_are_its_blocks(tmp_path):
    path, result = _build("megamolbart", tmp_path)
    loaded = load_checkpoint(path, "megamolbart")
    model = cast(Any, loaded.encoder).model  # the project's own transformer: its blocks run here one by one
    encoded = loaded.tokenizer.encode(SMILES)
    ids, mask = torch.from_numpy(encoded.input_ids), torch.from_numpy(encoded.attention_mask)
    with torch.no_grad():
        x = model.embedding(ids)
        expected = [x]
        for layer in model.encoder.layers:
            x = layer(x, mask.bool()[:, None, None, :])
            expected.append(x)
        expected[-1] = model.encoder.final_layernorm(x)
        hiddens = model.encode(ids, mask)
    served = [np.asarray(a) for a in _session(result).run([f"hiddens_{i}" for i in range(len(expected))], {
        "input_ids": encoded.input_ids, "attention_mask": encoded.attention_mask})]
    real = encoded.attention_mask.astype(bool)
    errors = [float(np.abs(got[real] - want.numpy()[real]).max()) for got, want in zip(served, expected)]
    assert max(errors) <= ATOL, errors
    assert np.abs(served[-1][real] - hiddens.numpy()[real]).max() <= 1e-5
    # SMILES rows start with their first token (no begin token before the encoder): no bos
    assert 'key: "has_bos"\n  value {\n    string_value: "false"' in \
        (result.repository / "g_layers" / "config.pbtxt").read_text()


def test_prott5_has_no_bos_and_the_served_logic_refuses_it(tmp_path, monkeypatch):
    """ProtT5's rows start with a residue: the build writes has_bos false, and N_layers' logic over
    the exported graph answers mean and max but refuses bos, naming why."""
    fake_pb_utils.install(monkeypatch)
    path, result = _build("prott5", tmp_path)
    loaded = load_checkpoint(path, "prott5")
    assert 'key: "has_bos"\n  value {\n    string_value: "false"' in \
        (result.repository / "g_layers" / "config.pbtxt").read_text()
    session = _session(result)

    def run(input_ids, attention_mask, layers):
        return [np.asarray(a) for a in session.run([f"hiddens_{i}" for i in layers],
                                                   {"input_ids": input_ids, "attention_mask": attention_mask})]

    model = LayerEmbeddings(loaded.tokenizer, run, num_layers=loaded.num_layers, has_bos=False, token_budget=4096,
                            max_rows=8, responder=Responder("g_layers"))
    column = np.array([[s.encode()] for s in PROTEINS], dtype=np.object_)
    answers, failures = model.answer([
        {"sequences": column, "layers": np.array([[1, -1]] * 3, dtype=np.int32),
         "include": np.array([[b"mean", b"max"]] * 3, dtype=np.object_)},
        {"sequences": column[:1], "include": np.array([[b"bos"]], dtype=np.object_)}])
    assert isinstance(failures[1], RequestError) and "as in ProtT5" in str(failures[1])
    reference = REFERENCES["prott5"](path).eval()
    for row, sequence in enumerate(PROTEINS):
        encoded = loaded.tokenizer.encode([sequence])
        with torch.no_grad():
            states = torch.stack(reference(input_ids=torch.from_numpy(encoded.input_ids),
                                           attention_mask=torch.from_numpy(encoded.attention_mask),
                                           output_hidden_states=True).hidden_states)[[1, -1], 0].numpy()
        residues = states[:, encoded.residue_mask[0].astype(bool)]
        assert np.abs(answers[0]["embeddings"][row] - residues.mean(1)).max() <= ATOL
        assert np.abs(answers[0]["embeddings_max"][row] - residues.max(1)).max() <= ATOL


def test_the_hosted_graphs_leave_the_encoder_graph_as_it_was(esm2_checkpoint, tmp_path):
    """A build of embeddings and hiddens has no contacts, layers or attentions; one that adds them
    serves them from N_encoder (their graphs beside its own, over one weights.bin), and its encoder
    graph is the first build's, node for node and weight for weight (the weights moved into the
    shared file).

    The default build exports its encoder afresh (no graph cache). The named build takes its graphs
    from the run's cache, where the encoder may have come from any build of this checkpoint, one
    naming these tasks included: were the tasks to change what the encoder export is given (module,
    specs, sample arguments: the cache key), that entry could not be this key's, and the digests
    would differ."""
    default = build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="d",
                                            out=tmp_path / "default", backend="python", tasks=("embeddings", "hiddens"),
                                            graph_cache=None, optimize=False))
    on_request = ("contacts", "layers", "attentions")
    named = build_repository(BuildRequest(family="esm2", checkpoint=esm2_checkpoint, name="d", out=tmp_path / "named",
                                          backend="python", tasks=("embeddings", "hiddens", *on_request),
                                          optimize=False))
    assert not set(on_request) & set(default.manifest.tasks)
    assert not {"d_contacts", "d_layers", "d_attentions"} & set(default.models)
    assert {"d_contacts", "d_layers", "d_attentions"} <= set(named.models)
    assert not [model for model in named.models if model.endswith("_graph")]

    def digest(repository):
        import onnx

        graph = onnx.load(str(repository / "d_encoder" / "1" / "model.onnx"))  # its weights read in
        for tensor in graph.graph.initializer:
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]
        return hashlib.sha256(graph.SerializeToString()).hexdigest()

    assert digest(default.repository) == digest(named.repository)
    graphs = named.manifest.verification["graphs"]
    assert [r["name"] for r in graphs["layers"]["outputs"]] == ["hiddens_0", "hiddens_1", "hiddens_2"]
    assert [r["name"] for r in graphs["contacts"]["outputs"]] == ["contacts"]
    for graph in on_request:
        assert all(r["passed"] and r["max_abs_error"] <= 1e-4 for r in graphs[graph]["outputs"]), graph
