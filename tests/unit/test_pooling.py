"""What a bulk job stores of each record (client/pooling.py): the choices, checked against the
model's outputs, and the poolings computed from per-residue states, against brute force."""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export.client.pooling import Include
from bionemo_export.errors import InvalidInputError

HIDDENS = {"hiddens", "mask"}
RNG = np.random.default_rng(1)


def _answer(lengths: list[int], width: int = 5, bos: bool = True) -> dict[str, np.ndarray]:
    """A padded N_hiddens answer: [BOS] residues [EOS] padding (bos=False: residues first, as ProtT5)."""
    longest = max(lengths) + 2
    mask = np.zeros((len(lengths), longest), dtype=bool)
    for row, length in enumerate(lengths):
        start = 1 if bos else 0
        mask[row, start:start + length] = True
    return {"hiddens": RNG.standard_normal((len(lengths), longest, width)).astype(np.float32), "mask": mask}


def test_the_default_is_what_the_model_answers():
    assert Include.parse(None, {"embeddings"}, "m_embeddings") == Include(("mean",), False, "m_embeddings")
    assert Include.parse(None, HIDDENS, "m_hiddens") == Include((), True, "m_hiddens")
    chosen = Include.parse("per_tok, max,mean,bos", HIDDENS, "m_hiddens")
    assert chosen.poolings == ("mean", "bos", "max") and chosen.per_residue and chosen.text() == "mean,bos,max,per_tok"


@pytest.mark.parametrize(("text", "outputs", "message"), [
    ("mean,cls", HIDDENS, r"--include 'mean,cls': choose among mean, bos, max, per_tok"),
    (",", HIDDENS, "choose among"),
    ("bos", {"embeddings"}, r"m_embeddings answers mean-pooled embeddings only; ask its N_hiddens sibling "
                            r"\(e.g. m_hiddens\) for bos"),
    ("mean", {"log_probs", "mask"}, "a bulk job needs an encoder"),
])
def test_choices_the_model_cannot_answer_are_refused_by_name(text, outputs, message):
    model = "m_embeddings" if "embeddings" in outputs else "m_hiddens"
    with pytest.raises(InvalidInputError, match=message):
        Include.parse(text, outputs, model)


def test_poolings_of_a_padded_answer_equal_brute_force_over_each_records_residues():
    answer = _answer([3, 7, 1])
    include = Include.parse("mean,bos,max,per_tok", HIDDENS, "m_hiddens")
    for row, length in enumerate([3, 7, 1]):
        pooled, residues = include.record(answer, row)
        own = answer["hiddens"][row, 1:1 + length]  # [BOS] at 0, then this record's residues
        assert residues is not None and residues.shape == (length, 5)
        np.testing.assert_array_equal(residues, own)
        np.testing.assert_allclose(pooled["mean"], own.sum(axis=0) / length, rtol=1e-6)
        np.testing.assert_array_equal(pooled["max"], [max(column) for column in own.T])
        np.testing.assert_array_equal(pooled["bos"], answer["hiddens"][row, 0])
    pooled, residues = Include.parse("max", HIDDENS, "m").record(answer, 0)
    assert list(pooled) == ["max"] and residues is None  # per-residue states only when asked for


def test_an_embeddings_answer_is_stored_as_it_came():
    answer = {"embeddings": RNG.standard_normal((2, 4)).astype(np.float32)}
    pooled, residues = Include.parse(None, {"embeddings"}, "m").record(answer, 1)
    np.testing.assert_array_equal(pooled["mean"], answer["embeddings"][1])
    assert residues is None


def test_bos_of_a_model_whose_rows_start_with_a_residue_is_refused():
    include = Include.parse("bos", HIDDENS, "prott5_hiddens")
    with pytest.raises(InvalidInputError, match="prott5_hiddens's rows start with a residue"):
        include.record(_answer([4], bos=False), 0)


def test_an_n_layers_job_stores_each_layers_poolings_under_its_own_key():
    include = Include.for_layers("bos,mean", "20,-1,20", 33, "esm2nv_layers")
    assert include.layers == (20, 33) and include.poolings == ("mean", "bos")
    assert include.text() == "mean,bos;layers=20,33"
    inputs = include.inputs(2)
    assert inputs["layers"].tolist() == [[20, 33]] * 2 and inputs["include"].tolist() == [[b"mean", b"bos"]] * 2
    answer = {"embeddings": np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3),
              "embeddings_bos": -np.arange(2 * 2 * 3, dtype=np.float32).reshape(2, 2, 3)}
    pooled, residues = include.record(answer, 1)
    assert residues is None and set(pooled) == {"mean@20", "bos@20", "mean", "bos"}
    np.testing.assert_array_equal(pooled["mean@20"], answer["embeddings"][1, 0])
    np.testing.assert_array_equal(pooled["bos"], answer["embeddings_bos"][1, 1])
    with pytest.raises(InvalidInputError, match=r"esm2nv_layers: --layers value 34 is out of range: this model's "
                                                r"layers are 0..33"):
        Include.for_layers(None, "34", 33, "esm2nv_layers")
    with pytest.raises(InvalidInputError, match="a bulk job stores pooled rows of other layers"):
        Include.for_layers("mean,per_tok", "20", 33, "esm2nv_layers")
    with pytest.raises(InvalidInputError, match="--layers 'x': comma-separated layer numbers"):
        Include.for_layers(None, "x", 33, "esm2nv_layers")
