"""The sub-batch planner of serving/batching.py and the thread count of serving/host.py (served
repositories that join requests of different lengths: tests/e2e/test_batching.py)."""

from __future__ import annotations

import numpy as np
import pytest

from bionemo_export.serving.batching import SubBatch, padded_lengths, padding_counts, plan_sub_batches, stack_padded
from bionemo_export.serving.host import available_cores, threads_per_instance


# ----------------------------------------------------------------------------------- planner
def _check_plan(lengths, batches, *, bucket, budget, limit=None):
    rows = np.concatenate([b.rows for b in batches])
    assert sorted(rows.tolist()) == list(range(len(lengths)))  # every row exactly once
    expected = padded_lengths(np.asarray(lengths), bucket=bucket, limit=limit)
    for batch in batches:
        assert (expected[batch.rows] == batch.length).all()  # one length bucket per sub-batch
        assert (np.asarray(lengths)[batch.rows] <= batch.length).all()
        if budget > 0:
            assert batch.tokens <= budget or batch.rows.size == 1


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize(("bucket", "budget"), [(16, 512), (1, 300), (32, 0), (8, 64)])
def test_sub_batches_cover_every_row_once_within_the_token_budget(seed, bucket, budget):
    lengths = np.random.default_rng(seed).integers(1, 200, size=57)
    batches = plan_sub_batches(lengths, bucket=bucket, token_budget=budget)
    _check_plan(lengths, batches, bucket=bucket, budget=budget)


def test_token_budget_bounds_tokens_not_rows():
    short = plan_sub_batches([10] * 40, bucket=16, token_budget=256)  # 16 tokens a row: 16 rows a call
    assert [b.rows.size for b in short] == [14, 13, 13] and all(b.length == 16 for b in short)
    long = plan_sub_batches([250] * 5, bucket=16, token_budget=1024)  # 256 tokens a row: 4 rows a call
    assert [b.rows.size for b in long] == [3, 2]
    alone = plan_sub_batches([1000, 3], bucket=16, token_budget=512)  # a row over the budget runs alone
    assert [(b.rows.tolist(), b.length) for b in alone] == [([1], 16), ([0], 1008)]


def test_max_rows_splits_wide_sub_batches_evenly_within_the_budget():
    """The largest sub-batch (`max_sub_batch`): 11 short rows a budget would run together become
    calls of at most 4 rows, as even as possible; long rows stay bounded by the budget."""
    wide = plan_sub_batches([120] * 11, bucket=16, token_budget=8192, max_rows=4)
    assert [b.rows.size for b in wide] == [4, 4, 3]
    mixed = plan_sub_batches([120] * 3 + [1000] * 3, bucket=16, token_budget=2048, max_rows=4)
    assert [(b.rows.size, b.length) for b in mixed] == [(3, 128), (2, 1008), (1, 1008)]  # 2 x 1008 fit 2048
    assert [b.rows.size for b in plan_sub_batches([120] * 11, bucket=16, token_budget=8192, max_rows=0)] == [11]
    for seed in range(3):
        lengths = np.random.default_rng(seed).integers(1, 300, size=80)
        batches = plan_sub_batches(lengths, bucket=16, token_budget=1024, max_rows=3)
        _check_plan(lengths, batches, bucket=16, budget=1024)
        assert max(b.rows.size for b in batches) <= 3


def test_rows_are_sorted_and_bucketed_and_the_limit_caps_padding():
    batches = plan_sub_batches([130, 5, 120, 17, 128], bucket=16, token_budget=0, limit=130)
    assert [(b.rows.tolist(), b.length) for b in batches] == [([1], 16), ([3], 32), ([2, 4], 128), ([0], 130)]
    assert padded_lengths(np.array([5, 16, 17]), bucket=1).tolist() == [5, 16, 17]
    assert plan_sub_batches([], bucket=16, token_budget=100) == []
    real, padding = padding_counts(np.array([130, 5, 120, 17, 128]), batches)
    assert real == 400 and padding == 16 + 32 + 256 + 130 - 400


def test_bucket_zero_is_plain_dynamic_batching():
    """Bucket 0 pads every row to the longest in one call: the baseline the buckets are measured against."""
    batches = plan_sub_batches([130, 5, 120, 17], bucket=0, token_budget=0)
    assert len(batches) == 1 and batches[0].length == 130
    assert padding_counts(np.array([130, 5, 120, 17]), batches) == (272, 4 * 130 - 272)


def test_stack_padded_joins_requests_of_different_lengths():
    a = np.array([[1, 2, 3]])
    b = np.array([[4], [5]])
    joined = stack_padded([a, b], 9)
    assert joined.tolist() == [[1, 2, 3], [4, 9, 9], [5, 9, 9]]
    assert stack_padded([a], 0) is a
    assert SubBatch(np.array([0, 1]), 8).tokens == 16


def test_auto_threads_use_every_core_with_at_most_two_threads_per_core():
    assert threads_per_instance("3", 2, cores=16) == 3
    assert threads_per_instance("auto", 1, cores=16) == 16
    assert threads_per_instance("auto", 2, cores=16) == 16
    assert threads_per_instance("auto", 4, cores=16) == 8
    assert threads_per_instance("0", 4, cores=2) == 1
    assert threads_per_instance(None, 1) == available_cores() >= 1
