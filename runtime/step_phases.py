"""The order of an engine step's phases, per scheduling strategy and device: the whole schedule, as a table.

A step decides (take new sequences and cancellations), executes (decode the batch, prefill, launch the batch's
pass, admit started rows) and delivers (hand what was decided to trio). Every step starts with ``intake`` and ends
with ``close`` (counters, then a last ``deliver``); ``keep`` takes the rows that finished in ``decode`` out of the
batch and stores them in the prefix cache right after their last tokens were delivered (a stream's end never waits
for the store's copies, nor for the filter's read of the cache's padding, which waits for the pass in flight; the
rows' old arrays live no longer than before), and ``audit`` (a prefix-cache hit's cold rerun, one chunk,
only when nothing decodes or waits) comes just before ``close``; between them the table below gives the order:

* ``decode_first`` (default): decode the batch and hand its tokens out, then prefill with the full budget —
  streams never wait for more than one chunk of someone else's prompt per token.
* ``balanced``: the same order; from half a batch on, prefill runs only every other step (its budget is 0 in
  between), halving the prefill share of a busy batch's time.
* ``prefill_first``: prefill and admit *before* decoding, so new rows take part in this step's pass: lowest time
  to first token, at the cost of the running streams' inter-token latency.

On a GPU ``async_eval`` returns at once, so ``decode`` launches the batch's pass itself before reading the last
step's tokens (the device computes step *n+1* while Python hands out step *n*). On the CPU it computes most of
the pass before returning, so the pass waits for a ``launch`` phase: after the prefill's first tokens went out
(decode_first), so a new arrival's first token does not wait for a step of the batch while trio streams the
batch's tokens on the other core. While no prompt waits, ``decode`` launches the pass itself on the CPU too
(mlx-lm's order: reading first left the device idle between two passes, 5 % of an 80M model's step); the
``launch`` phase then has nothing to do.

Pure data: imports nothing of the engine; ``tests/runtime/test_step_phases.py`` asserts the table's rules.
"""

from __future__ import annotations

from enum import Enum

from runtime.engine_config import STRATEGIES, Strategy


class Phase(Enum):
    INTAKE = "intake"  # decide: the sequences that arrived and the cancellations (distributed: rank 0's message)
    DECODE = "decode"  # execute: the batch's pass (GPU: launched here), the last step's tokens read and decided
    PREFILL = "prefill"  # execute: the step's prompt budget; each started group's first tokens go out at once
    LAUNCH = "launch"  # execute (CPU): compute the batch's pass that decode left
    ADMIT = "admit"  # decide: started rows join the decode batch
    DELIVER = "deliver"  # deliver: what the step decided so far, one crossing per trio run
    KEEP = "keep"  # once their last tokens went out: the finished rows leave the batch, their KV to the prefix cache
    AUDIT = "audit"  # idle time only (nothing decoding or waiting): a chunk of a prefix-cache hit's cold rerun
    CLOSE = "close"  # the step's counters and gauges, then a last deliver


P = Phase
_DECODE_FIRST_GPU = (P.INTAKE, P.DECODE, P.DELIVER, P.KEEP, P.PREFILL, P.ADMIT, P.AUDIT, P.CLOSE)
_DECODE_FIRST_CPU = (P.INTAKE, P.DECODE, P.DELIVER, P.KEEP, P.PREFILL, P.DELIVER, P.LAUNCH, P.ADMIT, P.AUDIT,
                     P.CLOSE)
_PREFILL_FIRST_GPU = (P.INTAKE, P.PREFILL, P.ADMIT, P.DECODE, P.DELIVER, P.KEEP, P.AUDIT, P.CLOSE)
_PREFILL_FIRST_CPU = (P.INTAKE, P.PREFILL, P.ADMIT, P.DECODE, P.DELIVER, P.KEEP, P.LAUNCH, P.AUDIT, P.CLOSE)

# (strategy, pipelined — a device whose async_eval returns at once) → the step's phases in order.
PHASES: dict[tuple[Strategy, bool], tuple[Phase, ...]] = {
    ("decode_first", True): _DECODE_FIRST_GPU,
    ("decode_first", False): _DECODE_FIRST_CPU,
    ("balanced", True): _DECODE_FIRST_GPU,
    ("balanced", False): _DECODE_FIRST_CPU,
    ("prefill_first", True): _PREFILL_FIRST_GPU,
    ("prefill_first", False): _PREFILL_FIRST_CPU,
}
assert set(PHASES) == {(s, p) for s in STRATEGIES for p in (True, False)}


def phases(strategy: Strategy, pipelined: bool) -> tuple[Phase, ...]:
    return PHASES[(strategy, pipelined)]
