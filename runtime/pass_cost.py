"""What a forward pass costs, measured on the idle device and fitted on the passes just run: the embedder sizes
and splits its passes by it, and speculative decoding decides from it whether a step verifies drafts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

# idle_pass_cost: the passes it times (rows × tokens), the largest number of rows it grows to, how much longer
# than the one-row pass the larger pass must take for the difference to stand above timing noise, and the
# longest a pass may take for the measurement to go on (a large model on a CPU: a few seconds of load time
# saved, the fit used instead)
CALIBRATION_TOKENS = 8
CALIBRATION_ROWS = 16
CALIBRATION_MAX_ROWS = 1024
CALIBRATION_SPREAD = 1.5
CALIBRATION_BUDGET_SECONDS = 0.25


class PassCost:
    """A pass's seconds as ``overhead + per_token × padded tokens``.

    With ``idle`` — that line measured on the idle device (:func:`idle_pass_cost`) — the passes run only fit
    a slowdown factor (exponentially weighted mean of measured / idle seconds): under load the event loop's
    work makes every pass slower, and fitting both terms on such passes reads it as overhead (0.13 s for
    MiniLM under 64 clients, against 0.011 s idle). Without it, both terms are fitted on recent passes
    (exponentially weighted least squares): on a CPU a one-input pass costs far more per token than a 64-input
    one, so a single seconds-per-token average would make time-bounded passes too small."""

    def __init__(self, weight: float = 0.1, idle: tuple[float, float] | None = None) -> None:
        self.weight = weight
        self.idle = idle
        self.passes = 0
        self.slowdown = 1.0
        self._x = self._y = self._xx = self._xy = 0.0  # weighted means of tokens, seconds, tokens², tokens×seconds

    def add(self, tokens: int, seconds: float) -> None:
        w = 1.0 if self.passes == 0 else self.weight
        self._x += w * (tokens - self._x)
        self._y += w * (seconds - self._y)
        self._xx += w * (tokens * tokens - self._xx)
        self._xy += w * (tokens * seconds - self._xy)
        if self.idle is not None:
            self.slowdown += w * (seconds / (self.idle[0] + self.idle[1] * tokens) - self.slowdown)
        self.passes += 1

    @property
    def fitted(self) -> bool:
        """Whether the passes seen differ enough in size to tell overhead from per-token cost."""
        return self.passes >= 3 and self._xx - self._x * self._x > (0.1 * self._x) ** 2

    @property
    def seconds(self) -> float:
        """The recent passes' mean seconds."""
        return self._y

    def fit(self) -> tuple[float, float]:
        """(overhead seconds, seconds per padded token): the idle line times the slowdown seen; without an idle
        line, fitted (a plain average while the sizes seen barely differ)."""
        if self.idle is not None:
            return self.idle[0] * self.slowdown, self.idle[1] * self.slowdown
        spread = self._xx - self._x * self._x
        if self.passes >= 3 and spread > (0.1 * self._x) ** 2:
            per_token = (self._xy - self._x * self._y) / spread
            if per_token > 0:
                return max(0.0, self._y - per_token * self._x), per_token
        return 0.0, self._y / max(self._x, 1.0)

    def tokens_within(self, seconds: float) -> int | None:
        """Padded tokens a pass may hold to last about ``seconds``; None before any pass."""
        if self.passes == 0:
            return None
        overhead, per_token = self.fit()
        if per_token <= 0:  # passes too quick for the clock: no bound from time
            return sys.maxsize
        return int((seconds - overhead) / per_token)


def idle_pass_cost(run: Callable[[int, int], object],
                   clock: Callable[[], float] = time.perf_counter) -> tuple[float, float] | None:
    """(overhead seconds, seconds per padded token) of a pass on the idle device, from ``run(rows, tokens)``
    (one forward pass, evaluated) timed at two sizes, the fastest of three tries each; None when a small pass
    is too slow to spend the time on (the fitted :class:`PassCost` serves then). ``clock``: seconds, for tests.

    The larger pass grows (×4 rows) until it takes clearly longer than the one-row pass: on a small model a
    pass is nearly all overhead, and 16 rows differed from one by less than a busy machine's timing noise."""
    def fastest(rows: int) -> float:
        times: list[float] = []
        for _ in range(3):
            started = clock()
            run(rows, CALIBRATION_TOKENS)
            times.append(clock() - started)
            if times[-1] > CALIBRATION_BUDGET_SECONDS:
                break
        return min(times)

    for _attempt in range(2):  # a burst of other work on the machine can swamp one measurement: once more
        one = fastest(1)
        if one > CALIBRATION_BUDGET_SECONDS:
            return None
        rows = CALIBRATION_ROWS
        several = fastest(rows)
        while (several < CALIBRATION_SPREAD * one and several < CALIBRATION_BUDGET_SECONDS
               and rows < CALIBRATION_MAX_ROWS):
            rows *= 4
            several = fastest(rows)
        per_token = (several - one) / ((rows - 1) * CALIBRATION_TOKENS)
        if per_token > 0:
            return max(0.0, one - per_token * CALIBRATION_TOKENS), per_token
    return None  # timing noise swamped the difference both times: no line to trust
