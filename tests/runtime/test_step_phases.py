"""The engine step's phase table (runtime/step_phases.py): the schedule's rules, asserted on the table itself
(tests/runtime/test_engine.py watches the engine step by it)."""

from __future__ import annotations

import pytest

from runtime.engine_config import STRATEGIES
from runtime.step_phases import PHASES, Phase, phases

P = Phase


@pytest.mark.parametrize("key", sorted(PHASES, key=str))
def test_every_step_decides_first_and_closes_last(key: tuple[str, bool]) -> None:
    order = PHASES[key]  # type: ignore[index]
    assert order[0] is P.INTAKE and order[-1] is P.CLOSE
    assert order.count(P.INTAKE) == order.count(P.CLOSE) == 1
    assert order.count(P.DECODE) == order.count(P.PREFILL) == order.count(P.ADMIT) == 1


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_cpu_launches_the_batch_pass_after_its_tokens_and_the_prefill_went_out(strategy: str) -> None:
    """On the CPU the batch's pass is computed by its launch: after decode read and delivered the last step's
    tokens (and, in decode_first, after the prefill's first tokens were delivered too)."""
    order = phases(strategy, pipelined=False)  # type: ignore[arg-type]
    launch = order.index(P.LAUNCH)
    assert order.index(P.DECODE) < order.index(P.DELIVER) < launch
    if strategy != "prefill_first":
        assert order.index(P.PREFILL) < launch and order[launch - 1] is P.DELIVER
    assert P.LAUNCH not in phases(strategy, pipelined=True)  # a GPU's decode launches its own pass


@pytest.mark.parametrize("pipelined", [False, True])
def test_decode_first_and_balanced_hand_out_the_batch_tokens_before_any_prefill(pipelined: bool) -> None:
    for strategy in ("decode_first", "balanced"):
        order = phases(strategy, pipelined)
        assert order.index(P.DECODE) < order.index(P.DELIVER) < order.index(P.PREFILL) < order.index(P.ADMIT)
    assert phases("decode_first", pipelined) == phases("balanced", pipelined)  # balanced differs in budget only


@pytest.mark.parametrize("pipelined", [False, True])
def test_prefill_first_admits_new_rows_into_this_steps_pass(pipelined: bool) -> None:
    order = phases("prefill_first", pipelined)
    assert order.index(P.PREFILL) < order.index(P.ADMIT) < order.index(P.DECODE)


@pytest.mark.parametrize("key", sorted(PHASES, key=str))
def test_finished_rows_are_stored_once_their_last_tokens_went_out_and_before_any_match_on_the_device(
        key: tuple[str, bool]) -> None:
    """``keep`` follows the delivery of decode's tokens (a stream's end does not wait for the store's copies) and
    precedes the audit, whose match runs on the device thread and must see them."""
    order = PHASES[key]  # type: ignore[index]
    assert order.count(P.KEEP) == 1
    keep = order.index(P.KEEP)
    assert order.index(P.DECODE) < keep and order[keep - 1] is P.DELIVER
    assert keep < order.index(P.AUDIT)
