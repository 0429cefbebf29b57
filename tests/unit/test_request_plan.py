"""How the client cuts rows into requests (client/batches.py): in the caller's order or another,
and how a request's rows are named in an error."""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export.client.batches import plan_requests, row_ranges


def test_requests_follow_the_given_order():
    order = np.array([4, 0, 3, 1, 2])
    assert [rows.tolist() for rows in plan_requests(5, 2, order)] == [[4, 0], [3, 1], [2]]
    assert [rows.tolist() for rows in plan_requests(5, 2)] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("order", [[0, 1, 1], [0, 1], [0, 1, 3]])
def test_an_order_that_is_not_a_permutation_is_refused(order):
    with pytest.raises(ValueError, match="permutation of the 3 rows"):
        plan_requests(3, 2, np.array(order))


def test_rows_are_named_as_ascending_runs():
    assert row_ranges(np.array([7, 3, 4, 5, 9])) == "3-5, 7, 9"
    assert row_ranges(np.arange(32, 64)) == "32-63"
    assert row_ranges(np.array([5])) == "5"
