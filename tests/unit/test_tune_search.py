"""`bionemo-export tune` without a server: the settings space, and the quick search on synthetic
response surfaces (a plain algorithm over a measure callable). Writing, restoring and one tune of a
served tiny ESM-2: tests/e2e/test_tune.py."""


from __future__ import annotations

from bionemo_export.tune.search import Objective, Point, QuickSearch, SearchSettings
from bionemo_export.tune.space import Settings, around, axes, step


def test_axes_hold_the_current_value_and_steps_stop_at_the_ends():
    start = Settings(instances=1, queue_delay_us=0, threads=0, token_budget=8192, max_sub_batch=0, length_bucket=16)
    values = axes(start, cores=2)
    assert values["threads"] == (0, 1, 2) and values["instances"] == (1, 2)
    assert values["max_sub_batch"][-1] == 0  # no row limit is the widest setting
    assert step(start, 2, "max_sub_batch", +1) is None
    assert step(start, 2, "max_sub_batch", -1) == Settings(1, 0, 0, 8192, 8, 16)
    assert [s.max_sub_batch for s in around(start, 2, "max_sub_batch")] == [8, 4]  # radius 2: past a flat step
    assert [s.instances for s in around(start, 2, "instances", radius=1)] == [2]
    odd = Settings(instances=1, queue_delay_us=300, token_budget=5000)
    assert 300 in axes(odd, 2)["queue_delay_us"] and 5000 in axes(odd, 2)["token_budget"]
    assert "threads" not in axes(odd, 2)  # a model without the setting is not searched along it


# ----------------------------------------------------------------------------------------- search
START = Settings(instances=1, queue_delay_us=0, threads=0, token_budget=8192, max_sub_batch=0, length_bucket=16)


class Surface:
    """A deterministic response surface: throughput peaks at max_sub_batch 4 and 1 instance; each
    measurement advances a fake clock by `cost` seconds."""

    def __init__(self, cost: float = 10.0, confirm_penalty: float = 1.0) -> None:
        self.now, self.cost, self.calls, self.confirm_penalty = 0.0, cost, [], confirm_penalty

    def clock(self) -> float:
        return self.now

    def throughput(self, settings: Settings) -> float:
        rows = settings.max_sub_batch or 32
        return 40.0 - 3.0 * abs(rows - 4) ** 0.5 - 10.0 * (settings.instances - 1) - settings.queue_delay_us / 1000

    def __call__(self, candidate, concurrency: int) -> Point:
        self.now += self.cost
        settings = candidate["encoder"]
        self.calls.append((settings, concurrency))
        rate = self.throughput(settings) * (1 if concurrency > 1 else 0.8)
        return Point(concurrency, rate, 1000 * concurrency / rate, 1500 * concurrency / rate)


def test_the_quick_search_climbs_to_the_best_sub_batch_and_keeps_it_on_confirmation():
    surface = Surface()
    result = QuickSearch({"encoder": START}, surface, SearchSettings(concurrencies=(8, 32), budget_s=10_000),
                         cores=2, clock=surface.clock).run()
    assert result.winner.candidate["encoder"].max_sub_batch == 4
    assert result.winner.candidate["encoder"].instances == 1
    assert result.stopped_by == "converged" and result.changed
    assert result.confirmation is not None
    assert [t.role for t in result.confirmation] == ["confirm-baseline", "confirm-winner"]
    # every candidate measured once: no settings twice
    seen = [tuple(sorted(t.candidate["encoder"].values().items())) for t in result.trials]
    assert len(seen) == len(set(seen))


def test_a_candidate_far_behind_is_pruned_after_its_first_concurrency():
    surface = Surface()
    result = QuickSearch({"encoder": START}, surface, SearchSettings(concurrencies=(1, 8, 32), budget_s=10_000),
                         cores=2, clock=surface.clock).run()
    pruned = [t for t in result.trials if t.pruned]
    assert pruned and all(len(t.points) == 1 and t.points[0].concurrency == 32 for t in pruned)
    assert any(t.candidate["encoder"].instances == 2 for t in pruned)  # 10 seq/s (25%) behind: pruned at once
    assert all(len(t.points) == 3 for t in result.trials if not t.pruned)


def test_the_budget_stops_the_search_and_leaves_room_for_the_confirmation():
    surface = Surface(cost=10.0)
    result = QuickSearch({"encoder": START}, surface, SearchSettings(concurrencies=(8, 32), budget_s=100),
                         cores=2, clock=surface.clock).run()
    assert result.stopped_by == "budget"
    searched = sum(len(t.points) for t in result.trials) * 10.0
    assert searched <= 100 - 2 * 20.0 + 1e-9  # two full candidates' time kept for the confirmation


def test_a_winner_that_loses_when_measured_again_is_not_kept():
    class Flaky(Surface):
        """The first measurement of sub-batch 8 is lucky; measured again it is worse than as built."""

        def __call__(self, candidate, concurrency):
            point = super().__call__(candidate, concurrency)
            settings = candidate["encoder"]
            if settings.max_sub_batch == 8:
                lucky = sum(1 for s, _ in self.calls if s == settings) <= 2
                rate = point.throughput * (1.5 if lucky else 0.5)
                return Point(concurrency, rate, point.p50_ms, point.p99_ms)
            if settings.max_sub_batch not in (0, 8):
                return Point(concurrency, 1.0, point.p50_ms, point.p99_ms)
            return point

    surface = Flaky()
    result = QuickSearch({"encoder": START}, surface, SearchSettings(concurrencies=(8, 32), budget_s=10_000),
                         cores=2, clock=surface.clock).run()
    assert result.confirmation is not None
    assert result.winner is result.baseline and not result.changed


def test_the_latency_bound_and_objective():
    surface = Surface()
    # as built: p99 497 ms, over the bound; the climb goes on until it is within (300 ms at 4 rows)
    bounded = SearchSettings(concurrencies=(8,), budget_s=10_000, objective=Objective.LATENCY, max_p99_ms=350.0)
    result = QuickSearch({"encoder": START}, surface, bounded, cores=2, clock=surface.clock).run()
    assert not result.baseline.feasible(350.0) and result.winner.feasible(350.0)
    assert result.winner.candidate["encoder"].max_sub_batch == 4  # lowest p99 on this surface
    within = SearchSettings(concurrencies=(2, 8), budget_s=10_000, max_p99_ms=320.0)
    result = QuickSearch({"encoder": START}, surface, within, cores=2, clock=surface.clock).run()
    first_within = next(i for i, t in enumerate(result.trials) if t.feasible(320.0))
    over = [t for t in result.trials[first_within:] if not t.feasible(320.0)]
    assert over and all(t.pruned and [p.concurrency for p in t.points] == [8] for t in over)  # dropped at once


def test_a_unit_of_members_side_by_side_steps_through_its_share_of_the_cores():
    """A checkpoint ensemble's K members' models are one unit (session.py `tuned_units`) that runs K
    models at once: its instances and threads range over a K-th of the host's cores."""
    seen: list[Settings] = []
    clock = [0.0]

    def measure(candidate, concurrency: int) -> Point:
        clock[0] += 1.0
        settings = candidate["ens_m*_encoder"]
        seen.append(settings)
        rate = 10.0 + settings.instances + (settings.threads or 0)  # more always looks better: the bound decides
        return Point(concurrency, rate, 100.0, 150.0)

    start = Settings(instances=1, queue_delay_us=0, threads=0)
    search = QuickSearch({"ens_m*_encoder": start, "ens_m*_lm_head": start}, measure,
                         SearchSettings(concurrencies=(8,), budget_s=10_000), cores=16,
                         shares={"ens_m*_encoder": 5, "ens_m*_lm_head": 5}, clock=lambda: clock[0])
    assert search.cores_of("ens_m*_encoder") == 3 and search.cores_of("other") == 16
    result = search.run()
    assert max(s.instances for s in seen) == 3 and max(s.threads or 0 for s in seen) == 3
    assert result.winner.candidate["ens_m*_encoder"].instances == 3
    assert QuickSearch({"x": start}, measure, SearchSettings(), cores=2, shares={"x": 4}).cores_of("x") == 1


def test_the_memory_arena_is_a_setting_read_and_written_by_name():
    from bionemo_export.model_repository.pbtxt import ModelConfig
    from bionemo_export.tune.space import read_settings, shown, write_settings

    config = ModelConfig(name="esm2_encoder", backend="python", max_batch_size=32)
    config.instance_group.add(count=1)
    config.dynamic_batching.SetInParent()
    config.parameters["memory_arena"].string_value = "run"
    config.parameters["token_budget"].string_value = "8192"
    settings = read_settings(config)
    assert settings.memory_arena == 1 and shown("memory_arena", 2) == "true"
    assert axes(settings, 2)["memory_arena"] == (0, 1, 2)
    assert [s.memory_arena for s in around(settings, 2, "memory_arena", radius=1)] == [2, 0]
    kept = write_settings(config, step(settings, 2, "memory_arena", +1))  # type: ignore[arg-type]
    assert kept.parameters["memory_arena"].string_value == "true"
    assert read_settings(kept).memory_arena == 2 and "memory_arena true" in read_settings(kept).describe()
    config.parameters["memory_arena"].string_value = "sometimes"  # not a value it knows: not searched
    assert read_settings(config).memory_arena is None
