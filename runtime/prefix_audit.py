"""The prefix cache's audit: a cache hit never changes the answer, and flow can prove it.

Theory of operation
-------------------
With ``audit_rate`` above 0 (the prefix cache resource's setting; 0, off, by default) the engine marks that share
of its prefix-cache hits at submission. When a marked sequence's first token is sampled, the logits of that pass
— the next-token logits the hit's cache gave — are kept (:meth:`PrefixAuditor.queue`). The auditor then
recomputes the same prompt **cold**, from an empty cache, on idle device time only: the engine's ``audit`` phase
runs one prefill chunk of it when the step had nothing else to do (no row decoding, no prompt waiting), so a
request arriving meanwhile waits for one chunk at most. At the end the two next-token logit vectors are
compared (:func:`compare`): whether their argmax — the greedy next token — agrees, and the largest absolute
difference. Both go to the prefix cache's :class:`runtime.prefix_cache.AuditStats` (``/stats``, ``/metrics``); a
disagreement is logged as a warning with the sequence's request label and the prefix length.

A hit's logits can differ from a cold run's in the last bits (a grouped pass's rows, another chunking of the
prompt): ``max_difference`` shows how far; a wrong block (a bug, a damaged file that passed its checksum) moves
them far and usually moves the argmax. At most ``MAX_PENDING`` audits wait; past that a sampled hit is counted
as ``dropped`` (a device never idle has no time for audits, and an audit must not cost throughput).

:func:`verify_prompt` is the same comparison on demand (``flow cache verify``): one prompt, its hit and its cold
run, as one device job.

Never imports the engine or trio.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from runtime.adapters import Adapter
from runtime.passes import ModelPasses
from runtime.prefix_cache import AuditStats, PrefixCache

log = logging.getLogger("flow.prefix_audit")

MAX_PENDING = 4


@dataclass(frozen=True)
class AuditOutcome:
    prefix_tokens: int  # the prompt tokens the hit supplied
    agree: bool  # the hit's and the cold run's next token (argmax) are the same
    max_difference: float  # the largest |hit - cold| next-token logit
    hit_token: int
    cold_token: int


def compare(prefix_tokens: int, hit: mx.array, cold: mx.array) -> AuditOutcome:
    """Two next-token logit vectors (one per vocabulary entry) of the same prompt."""
    hit, cold = hit.astype(mx.float32), cold.astype(mx.float32)
    argmax: list[int] = mx.argmax(mx.stack([hit, cold]), axis=-1).tolist()  # type: ignore[assignment]
    hit_token, cold_token = argmax
    difference: float = mx.max(mx.abs(hit - cold)).item()  # type: ignore[assignment]
    return AuditOutcome(prefix_tokens, hit_token == cold_token, difference, hit_token, cold_token)


@dataclass(eq=False)
class _Audit:
    label: str  # the request it came from, as the log names it
    prompt: list[int]
    prefix_tokens: int
    hit_logits: mx.array
    adapters: tuple[Adapter, ...]
    cache: list[Any] | None = None  # the cold run's own cache, while it runs
    done: int = 0  # prompt tokens of the cold run in ``cache``
    outcome: AuditOutcome | None = field(default=None)


class PrefixAuditor:
    """One engine's audits (device thread, but :meth:`wants` from trio)."""

    def __init__(self, prefix: PrefixCache | None, passes: ModelPasses, chunk: int) -> None:
        self._stats: AuditStats | None = prefix.audit if prefix is not None else None
        self.rate = prefix.config.audit_rate if prefix is not None else 0.0
        self._passes = passes
        self._chunk = chunk
        self._random = random.Random()
        self._pending: deque[_Audit] = deque()

    def wants(self) -> bool:
        """Whether to audit a hit about to be submitted (drawn at ``audit_rate``)."""
        return self.rate > 0 and self._random.random() < self.rate

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def queue(self, label: str, prompt: list[int], prefix_tokens: int, logits: mx.array,
              adapters: tuple[Adapter, ...], asked: bool = False) -> None:
        """A marked hit's next-token logits, to recompute cold when the device is idle (``asked``: the request
        asked for its audit, which is never dropped)."""
        assert self._stats is not None
        if len(self._pending) >= MAX_PENDING and not asked:
            self._stats.dropped += 1
            return
        kept = logits.astype(mx.float32)
        mx.eval(kept)  # a copy of its own: the pass's graph is not kept for it
        self._pending.append(_Audit(label, list(prompt), prefix_tokens, kept, adapters))

    def run_chunk(self) -> None:
        """One chunk of the oldest audit's cold run; at its end, the comparison."""
        audit = self._pending[0]
        if audit.cache is None:
            audit.cache = make_prompt_cache(self._passes.model)
        try:
            cold = advance(self._passes, audit.cache, audit.prompt, audit.done, self._chunk, audit.adapters)
        except Exception:
            self._pending.popleft()
            log.exception("prefix audit: the cold run of %s failed; the audit is dropped", audit.label)
            return
        if cold is None:
            audit.done = min(audit.done + self._chunk, len(audit.prompt) - 1)
            return
        self._pending.popleft()
        self.record(audit.label, compare(audit.prefix_tokens, audit.hit_logits, cold))

    def record(self, label: str, outcome: AuditOutcome) -> None:
        stats = self._stats
        assert stats is not None
        stats.audits += 1
        stats.max_difference = max(stats.max_difference, outcome.max_difference)
        stats.recent.append({"request": label, "prefix_tokens": outcome.prefix_tokens, "agree": outcome.agree,
                             "hit_token": outcome.hit_token, "cold_token": outcome.cold_token,
                             "max_difference": round(outcome.max_difference, 6)})
        if outcome.agree:
            stats.agreements += 1
            return
        stats.last_disagreement = {"request": label, "prefix_tokens": outcome.prefix_tokens,
                                   "hit_token": outcome.hit_token, "cold_token": outcome.cold_token,
                                   "max_difference": round(outcome.max_difference, 6)}
        log.warning("prefix audit: %s disagrees with its cold run (prefix %d tokens): next token %d from the hit, "
                    "%d cold; largest logit difference %.4g", label, outcome.prefix_tokens, outcome.hit_token,
                    outcome.cold_token, outcome.max_difference)


def advance(passes: ModelPasses, cache: list[Any], prompt: list[int], done: int, chunk: int,
            adapters: tuple[Adapter, ...] = ()) -> mx.array | None:
    """Run the next ``chunk`` tokens of ``prompt`` (all but its last) from position ``done`` into ``cache``; once
    they are all in, the last token's pass: its next-token logits (else None)."""
    end = min(done + chunk, len(prompt) - 1)
    if done < end:
        passes.run(mx.array(prompt[done:end])[None], cache, [adapters])
        passes.quantize(cache)  # as the served sequence's cache was
        mx.eval([c.state for c in cache])
        return None
    logits, _ = passes.run(mx.array(prompt[-1:])[None], cache, [adapters])
    last: mx.array = logits[0, -1]
    mx.eval(last)
    return last


def next_token_logits(passes: ModelPasses, cache: list[Any], prompt: list[int], start: int, chunk: int,
                      adapters: tuple[Adapter, ...] = ()) -> mx.array:
    """The next-token logits of ``prompt`` from ``cache`` holding its first ``start`` tokens."""
    done = start
    while (logits := advance(passes, cache, prompt, done, chunk, adapters)) is None:
        done = min(done + chunk, len(prompt) - 1)
    return logits


def verify_prompt(passes: ModelPasses, prefix: PrefixCache, namespace: bytes, windows: Any, prompt: list[int],
                  chunk: int) -> AuditOutcome | None:
    """A device job: the prompt's next-token logits from its prefix-cache hit against a cold run's (None when the
    cache holds no prefix of it). The hit's blocks are released."""
    hit = prefix.match(namespace, prompt, windows)
    if not hit.blocks:
        prefix.release(hit)
        return None
    cached = hit.tokens
    cache = prefix.build(hit)
    passes.quantize(cache)
    from_hit = next_token_logits(passes, cache, prompt, cached, chunk)
    cold = next_token_logits(passes, make_prompt_cache(passes.model), prompt, 0, chunk)
    return compare(cached, from_hit, cold)
