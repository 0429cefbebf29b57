"""runtime/lifecycle.py's RestartPolicy: when serve starts a crashed tritonserver again (no server)."""

from __future__ import annotations

import pytest

from bionemo_export.runtime.lifecycle import RestartPolicy


def test_restart_policy_doubles_its_pause_and_gives_up_on_repeated_crashes():
    policy = RestartPolicy(max_crashes=4, window=600.0, first_pause=1.0, max_pause=3.0)
    assert [policy.pause_after_crash(t) for t in (0.0, 10.0, 20.0)] == [1.0, 2.0, 3.0]
    assert policy.pause_after_crash(30.0) is None  # the 4th crash within 10 minutes
    spaced = RestartPolicy(max_crashes=2, window=600.0)
    assert spaced.pause_after_crash(0.0) == 1.0 and spaced.pause_after_crash(700.0) == 1.0  # the first fell out


def test_a_single_allowed_crash_gives_up_at_once():
    assert RestartPolicy(max_crashes=1).pause_after_crash(0.0) is None


@pytest.mark.parametrize("settings", [{"max_crashes": 0}, {"window": 0.0}, {"first_pause": -1.0},
                                      {"first_pause": 5.0, "max_pause": 1.0}])
def test_a_policy_that_could_never_restart_sensibly_is_refused_where_it_is_made(settings):
    with pytest.raises(ValueError, match="RestartPolicy"):
        RestartPolicy(**settings)
