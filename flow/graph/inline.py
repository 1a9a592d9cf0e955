"""Which stages of a route run inline, in their producer's task: one rule, a pure function.

A route is a small DAG of stages. Giving each stage a task and each edge a channel costs, per item on each
edge, a channel send and receive and a trip through trio's scheduler — most of what a streamed token cost
when a route was one task per stage. A stage that works as a :class:`~flow.graph.stage.Step` needs no task:
its producer can call it for each item. It runs inline when

* it works as a step (``Stage.inline``: ``open_step`` and the default ``run``),
* it is not the route's entry (the runner feeds the entry; it heads the first task), and
* it has exactly one producer on the route, and that producer has no other consumer on it — a link of a
  linear chain, where nothing could run beside it anyway.

Everything else — a stage with a run loop of its own, a fan-in, a fan-out — keeps its task and its inbox.
The graph, ``flow viz`` and the per-stage and per-edge figures still show every stage and edge; an inline
edge has no queue, so its ``full`` count stays 0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


def inline_stages(stages: Iterable[str], edges: Iterable[tuple[str, str]], entry: str,
                  works_as_step: Callable[[str], bool]) -> frozenset[str]:
    """The stages of a route (its stage ids and ``(producer, consumer)`` edges) that run in their producer's
    task."""
    producers: dict[str, list[str]] = {}
    consumers: dict[str, list[str]] = {}
    for src, dst in edges:
        producers.setdefault(dst, []).append(src)
        consumers.setdefault(src, []).append(dst)
    return frozenset(sid for sid in stages
                     if sid != entry and works_as_step(sid) and len(producers.get(sid, ())) == 1
                     and len(consumers[producers[sid][0]]) == 1)
