"""How the embedder builds its forward passes: everything at once when it fits, full passes for a large job
alone, and short passes that finish the small requests behind a large job first (without starving it)."""

from __future__ import annotations

import itertools
import random
from typing import Any

from runtime.embeddings import Embedder, length_groups
from runtime.pass_cost import CALIBRATION_TOKENS, PassCost, idle_pass_cost


class _Device:
    """The device thread's stepper interface; the tests call the pass builder directly."""

    def add_stepper(self, stepper: Any) -> None:
        pass

    def remove_stepper(self, stepper: Any) -> None:
        pass

    def wake(self) -> None:
        pass


def embedder(pass_tokens: int = 1000) -> Embedder:
    return Embedder(model=None, device=_Device(), pad_id=0, dims=4, pass_tokens=pass_tokens,  # type: ignore[arg-type]
                    pass_seconds=0.01)


def measured(e: Embedder) -> None:
    """Passes so far took 0.01 s per 100 padded tokens."""
    for _ in range(3):
        e.cost.add(100, 0.01)


def shape(chosen: list[Any]) -> list[int]:
    """How many inputs of each request (by its input count) a pass holds."""
    counts: dict[int, int] = {}
    for job, _ in chosen:
        counts[len(job.inputs)] = counts.get(len(job.inputs), 0) + 1
    return [counts.get(n, 0) for n in sorted(counts)]


def test_everything_that_fits_goes_in_one_pass() -> None:
    e = embedder()
    e.submit([[1] * 10] * 5)
    e.submit([[1] * 20])
    assert len(e._next_pass()) == 6 and not e.has_work()


def test_a_large_job_alone_gets_full_passes_and_newcomers_a_pass_of_their_own() -> None:
    e = embedder(pass_tokens=1000)
    big = e.submit([[1] * 10] * 500)  # 5,000 padded tokens: five full passes
    measured(e)  # a 0.01 s pass holds 100 padded tokens
    assert len(e._next_pass()) == 100  # alone, nobody asked lately: a full pass
    e.submit([[1] * 8])
    e.submit([[1] * 12] * 2)
    first = e._next_pass()  # the passes the newcomers can finish come first, and only they
    assert shape(first) == [1, 2] and not big.done()
    second = e._next_pass()  # never two such passes in a row: the large job goes on, within the time budget
    assert shape(second) == [10] and len(second) * 10 <= 100
    e.submit([[1] * 5])
    assert shape(e._next_pass()) == [1]  # the next newcomer is served at once again
    assert len(e._next_pass()) == 10  # a newcomer arrived lately: the large job keeps short passes


def test_round_robin_when_nobody_can_finish_in_one_pass() -> None:
    e = embedder(pass_tokens=1000)
    e.submit([[1] * 10] * 300)
    e.submit([[1] * 10] * 300)
    measured(e)
    chosen = e._next_pass()
    assert shape(chosen) == [10] and len({id(job) for job, _ in chosen}) == 2  # five from each


def test_the_pass_cost_separates_overhead_from_tokens() -> None:
    """On a CPU a one-input pass is mostly overhead: a time budget must not be read as a token rate of those."""
    cost = PassCost(weight=0.5)
    for tokens, seconds in [(10, 0.05), (1000, 0.5), (10, 0.05), (1000, 0.5), (500, 0.275)]:
        cost.add(tokens, seconds)
    overhead, per_token = cost.fit()
    assert abs(overhead - 0.0455) < 0.002 and abs(per_token - 0.000455) < 0.00002
    assert 115 < (cost.tokens_within(0.1) or 0) < 125  # (0.1 - overhead) / per_token


def test_the_idle_line_grows_its_larger_pass_above_the_noise() -> None:
    """A small model's pass is nearly all overhead: 16 rows cost barely more than one, and timing noise could
    make them read as cheaper (a test server on a busy CI machine got no line). The larger pass grows until it
    takes clearly longer, and the line comes out right."""
    runs: list[int] = []
    clock = [0.0]
    overhead, per_token = 0.005, 1e-6  # 5,000 tokens' worth of overhead

    def run(rows: int, tokens: int) -> None:
        runs.append(rows)
        clock[0] += overhead + per_token * rows * tokens

    line = idle_pass_cost(run, clock=lambda: clock[0])
    assert line is not None
    assert abs(line[0] - overhead) < 1e-9 and abs(line[1] - per_token) < 1e-12
    assert max(runs) * CALIBRATION_TOKENS * per_token > 0.5 * overhead  # grown past 16 rows


def test_a_measurement_swamped_by_noise_is_taken_again() -> None:
    clock, calls = [0.0], [0]
    overhead, per_token = 0.004, 2e-6

    def run(rows: int, tokens: int) -> None:
        calls[0] += 1
        noise = 0.1 if calls[0] <= 3 else 0.0  # another process held the cores while the one-row passes ran
        clock[0] += overhead + per_token * rows * tokens + noise

    line = idle_pass_cost(run, clock=lambda: clock[0])
    assert line is not None and abs(line[0] - overhead) < 1e-9 and abs(line[1] - per_token) < 1e-12


def test_no_idle_line_when_a_pass_is_too_slow_to_time() -> None:
    clock = [0.0]

    def run(rows: int, tokens: int) -> None:
        clock[0] += 0.3 + 0.01 * rows

    assert idle_pass_cost(run, clock=lambda: clock[0]) is None


def test_a_pass_is_never_budgeted_below_twice_its_fixed_cost() -> None:
    """A model whose one-input pass outlasts pass_seconds (a large model on a CPU) still batches: a time budget
    below twice the fixed cost would make every request "large" and every pass hold one input."""
    e = embedder(pass_tokens=100_000)  # pass_seconds 0.01
    e.cost = PassCost(idle=(0.05, 1e-4))
    e.cost.add(100, 0.06)  # as the idle line says: no slowdown
    assert 499 <= e.budget(e.pass_seconds) <= 500  # (2 × 0.05 - 0.05) / 1e-4
    assert e.budget(1.0) == 9500  # a longer budget is what it says


def test_with_an_idle_line_passes_under_load_only_scale_it() -> None:
    """Passes under load are slower by a factor: the overhead is not read as larger than the idle one's share."""
    cost = PassCost(weight=0.5, idle=(0.01, 0.001))
    for tokens in (100, 400, 50, 800, 200, 600):
        cost.add(tokens, 1.5 * (0.01 + 0.001 * tokens) * (1.1 if tokens < 300 else 0.95))  # noisy, 1.5x on average
    overhead, per_token = cost.fit()
    assert 1.3 < cost.slowdown < 1.7
    assert abs(overhead / per_token - 10) < 1e-9  # the idle line's shape, scaled
    assert cost.tokens_within(0.1) == int((0.1 - overhead) / per_token)


def test_many_small_requests_and_no_large_one_get_full_passes() -> None:
    e = embedder(pass_tokens=1000)
    measured(e)
    for _ in range(150):  # 64 clients' worth of one-sentence requests, more than one solo pass holds
        e.submit([[1] * 10])
    assert len(e._next_pass()) == 100  # a solo pass (1,000 padded tokens), not a short one (100)


def _cost(lengths: list[int], groups: list[slice], overhead: float, per_token: float) -> float:
    return float(sum(overhead + per_token * (g.stop - g.start) * lengths[g.stop - 1] for g in groups))


def test_a_short_query_is_not_padded_to_a_long_documents_length() -> None:
    lengths = [9] * 5 + [200]
    assert length_groups(lengths, overhead=0.005, per_token=0.0005) == [slice(0, 5), slice(5, 6)]
    # similar lengths: one more pass's overhead costs more than the padding it saves
    assert length_groups([12, 13, 13, 14], overhead=0.005, per_token=0.0005) == [slice(0, 4)]
    # before the overhead is known (no fit yet), never split
    assert length_groups(lengths, overhead=0.0, per_token=0.0005) == [slice(0, 6)]


def test_the_split_is_the_cheapest_over_every_set_of_cut_points() -> None:
    rng = random.Random(3)
    for _ in range(300):
        lengths = sorted(rng.randint(1, 40) for _ in range(rng.randint(1, 9)))
        overhead, per_token = rng.uniform(0.001, 0.05), rng.uniform(0.0001, 0.002)
        groups = length_groups(lengths, overhead, per_token)
        assert groups[0].start == 0 and groups[-1].stop == len(lengths)
        assert all(a.stop == b.start for a, b in zip(groups, groups[1:]))
        best = min(_cost(lengths, [slice(a, b) for a, b in zip((0, *cuts), (*cuts, len(lengths)))], overhead,
                         per_token)
                   for r in range(len(lengths)) for cuts in itertools.combinations(range(1, len(lengths)), r))
        assert _cost(lengths, groups, overhead, per_token) <= best + 1e-12
        # equal lengths stay together: a cut never falls between two inputs of one length
        assert all(lengths[g.start - 1] != lengths[g.start] for g in groups[1:])
