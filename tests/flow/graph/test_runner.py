"""The route runner: a linear chain of steps runs in one task, everything else in tasks joined by channels, and
every stage and edge counts its figures either way.

Small stage types of the tests' own (a registry of them, no model): a source that sends each word of the
body, an upper-caser, a stage with a run loop of its own, one that fails on a word, one that wants no more
after a word, and a sink that answers each item as a frame. The same chain again with ``feed_now``, fed
without awaiting as an engine step feeds a row's stages (``stages.rows``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import trio

from flow.graph.compiled import CompiledGraph, Route
from flow.graph.compiler import compile_tables
from flow.graph.inline import inline_stages
from flow.graph.registry import Registry
from flow.graph.resource import Links
from flow.graph.runner import RouteRunner
from flow.graph.stage import EachItem, EntryStage, ExitStage, NotNow, Outbox, Stage, Step
from protocols.ir import HttpRequest, WireFrame

TASKS: dict[str, set[trio.lowlevel.Task]] = {}  # stage id → the tasks its items were handled in


def seen(stage: Stage[Any, Any]) -> None:
    TASKS.setdefault(stage.id, set()).add(trio.lowlevel.current_task())


class Words(Step[HttpRequest, str]):
    def __init__(self, stage: Stage[Any, Any]) -> None:
        self.stage = stage

    async def feed(self, item: HttpRequest, out: Outbox[str]) -> bool:
        seen(self.stage)
        for word in item.body.decode().split():
            try:
                await out.send(word)
            except trio.BrokenResourceError:  # downstream wants no more
                REFUSED.append(self.stage.id)
                return False
        return True


REFUSED: list[str] = []


class Source(EntryStage[HttpRequest, str]):
    type_name: ClassVar[str] = "test.source"

    def open_step(self) -> Step[HttpRequest, str]:
        return Words(self)


class Upper(Stage[str, str]):
    type_name: ClassVar[str] = "test.upper"

    def open_step(self) -> Step[str, str]:
        async def upper(word: str) -> str:
            seen(self)
            return word.upper()
        return EachItem(upper)


class Tasked(Stage[str, str]):
    """A stage with a run loop of its own: never inline."""

    type_name: ClassVar[str] = "test.tasked"

    async def run(self, inbox: trio.MemoryReceiveChannel[str], outbox: Outbox[str]) -> None:
        async for word in inbox:
            seen(self)
            await outbox.send(word + "!")


class Boom(Stage[str, str]):
    type_name: ClassVar[str] = "test.boom"

    def open_step(self) -> Step[str, str]:
        async def check(word: str) -> str:
            if word == "boom":
                raise ValueError("boom")
            return word
        return EachItem(check)


class UntilStop(Step[str, str]):
    async def feed(self, item: str, out: Outbox[str]) -> bool:
        if item == "stop":
            return False
        await out.send(item)
        return True

    async def end(self, out: Outbox[str]) -> None:
        await out.send("<end>")


class Stopper(Stage[str, str]):
    type_name: ClassVar[str] = "test.stopper"

    def open_step(self) -> Step[str, str]:
        return UntilStop()


class Sink(ExitStage[str, WireFrame]):
    type_name: ClassVar[str] = "test.sink"

    def open_step(self) -> Step[str, WireFrame]:
        async def frame(word: str) -> WireFrame:
            seen(self)
            return WireFrame(word.encode())
        return EachItem(frame)


class NowWords(Words):
    """Each word sent without awaiting while the chain takes it so (as a row's lane does), else awaited; what
    the chain kept waiting is drained before the next word."""

    async def feed(self, item: HttpRequest, out: Outbox[str]) -> bool:
        seen(self.stage)
        words = item.body.decode().split()
        if words[0] == "burst":  # every word in one pass, as one engine step's several events
            for word in words[1:]:
                out.send_now(word)
            await out.drain()
            return True
        for word in words:
            try:
                if out.ready():
                    out.send_now(word)
                    if not out.ready():
                        await out.drain()
                else:
                    await out.send(word)
            except trio.BrokenResourceError:
                REFUSED.append(self.stage.id)
                return False
        return True


class NowSource(EntryStage[HttpRequest, str]):
    type_name: ClassVar[str] = "test.now_source"

    def open_step(self) -> Step[HttpRequest, str]:
        return NowWords(self)


class NowStep(Step[str, str]):
    """Upper-cases, in ``feed_now`` too; a word starting "slow" needs ``feed`` (NotNow), "boom" fails, "stop"
    wants no more."""

    def __init__(self, stage: Stage[Any, Any]) -> None:
        self.stage = stage
        self.ended = 0

    def _word(self, item: str) -> str | None:
        if item == "boom":
            raise ValueError("boom")
        return None if item == "stop" else item.upper()

    async def feed(self, item: str, out: Outbox[str]) -> bool:
        await trio.lowlevel.checkpoint()
        word = self._word(item)
        if word is not None:
            await out.send(word)
        return word is not None

    def feed_now(self, item: str, out: Outbox[str]) -> bool:
        if item.startswith("slow"):
            raise NotNow
        word = self._word(item)
        if word is not None:
            out.send_now(word)
        return word is not None

    async def end(self, out: Outbox[str]) -> None:
        self.ended += 1
        await out.send("<end>")


class NowUpper(Stage[str, str]):
    type_name: ClassVar[str] = "test.now_upper"

    def open_step(self) -> Step[str, str]:
        return NowStep(self)


class NowFrame(Step[str, WireFrame]):
    async def feed(self, item: str, out: Outbox[WireFrame]) -> bool:
        await out.send(WireFrame(item.encode()))
        return True

    def feed_now(self, item: str, out: Outbox[WireFrame]) -> bool:
        out.send_now(WireFrame(item.encode()))
        return True


class NowSink(ExitStage[str, WireFrame]):
    type_name: ClassVar[str] = "test.now_sink"

    def open_step(self) -> Step[str, WireFrame]:
        return NowFrame()


class Frames(Outbox[WireFrame]):
    def __init__(self) -> None:
        super().__init__(())
        self.frames: list[bytes] = []
        self.finished = False
        self.now = 0  # frames sent without awaiting

    async def send(self, item: WireFrame) -> None:
        self.sent += 1
        self.frames.append(item.data)

    def sends_now(self) -> bool:
        return True

    def ready(self) -> bool:
        return True

    def send_now(self, item: WireFrame) -> None:
        self.now += 1
        self.frames.append(item.data)

    async def finish(self) -> None:
        self.finished = True


def graph(*chain: str, now: bool = False) -> CompiledGraph:
    """A route POST /t: the source, then ``chain``'s stage types in a line, then the sink (``now``: the
    source and sink that send without awaiting)."""
    registry = Registry()
    for cls in (Source, Upper, Tasked, Boom, Stopper, Sink, NowSource, NowUpper, NowSink):
        registry.add(cls)
    source, sink = ("test.now_source", "test.now_sink") if now else ("test.source", "test.sink")
    stages: dict[str, Any] = {"src": {"type": source, "routes": ["POST /t"], "exit": "sink"}}
    previous = "src"
    for i, type_name in enumerate(chain):
        stages[f"s{i}"] = {"type": type_name, "inputs": [previous]}
        previous = f"s{i}"
    stages["sink"] = {"type": sink, "inputs": [previous]}
    return compile_tables({"name": "runner test", "stages": stages}, "test", registry)


def runner_of(compiled: CompiledGraph) -> RouteRunner:
    (route,) = compiled.routes
    instances = {sid: stage.cls(sid, stage.config, Links()) for sid, stage in compiled.stages.items()}
    return RouteRunner(compiled, route, instances)


def run(runner: RouteRunner, body: str) -> Frames:
    exit_outbox = Frames()
    request = HttpRequest("POST", "/t", "", (), body.encode(), "r1")

    async def main() -> None:
        TASKS.clear()
        TASKS["caller"] = {trio.lowlevel.current_task()}
        await runner.run(request, exit_outbox)

    trio.run(main)
    return exit_outbox


def test_a_chain_of_steps_runs_in_the_callers_task_and_counts_every_stage_and_edge() -> None:
    runner = runner_of(graph("test.upper"))
    assert runner.route.inline == {"s0", "sink"}
    out = run(runner, "the keeper trims the wick")
    assert out.frames == [b"THE", b"KEEPER", b"TRIMS", b"THE", b"WICK"] and out.finished
    assert TASKS["src"] == TASKS["s0"] == TASKS["sink"] == TASKS["caller"]
    assert {sid: (s.runs, s.active, s.errors) for sid, s in runner.stage_stats.items()} == {
        "src": (1, 0, 0), "s0": (1, 0, 0), "sink": (1, 0, 0)}
    assert {edge: (e.items, e.streams, e.full) for edge, e in runner.edge_stats.items()} == {
        ("src", "s0"): (5, 1, 0), ("s0", "sink"): (5, 1, 0)}


def test_a_stage_with_its_own_run_loop_keeps_its_task() -> None:
    runner = runner_of(graph("test.upper", "test.tasked", "test.upper"))
    assert runner.route.inline == {"s0", "s2", "sink"}  # s1 has its own task; s2 runs inline in it
    out = run(runner, "calm sea")
    assert out.frames == [b"CALM!", b"SEA!"] and out.finished
    assert TASKS["src"] == TASKS["s0"] != TASKS["s1"] and TASKS["s2"] == TASKS["sink"] == TASKS["s1"]
    assert TASKS["caller"].isdisjoint(TASKS["src"])  # two tasks: the route runs in a nursery of its own
    assert runner.edge_stats[("s0", "s1")].items == runner.edge_stats[("s2", "sink")].items == 2


def test_an_inline_stages_error_is_charged_to_it_alone() -> None:
    runner = runner_of(graph("test.boom", "test.upper"))
    with pytest.raises(ValueError, match="boom"):
        run(runner, "fog boom wind")
    assert {sid: s.errors for sid, s in runner.stage_stats.items()} == {"src": 0, "s0": 1, "s1": 0, "sink": 0}
    assert all(s.active == 0 for s in runner.stage_stats.values())


def test_a_step_that_wants_no_more_ends_its_input_as_a_closed_inbox_would() -> None:
    REFUSED.clear()
    runner = runner_of(graph("test.stopper"))
    out = run(runner, "one two stop three")
    assert out.frames == [b"one", b"two", b"<end>"] and out.finished  # its end ran once, at the stop
    assert REFUSED == ["src"]  # the source's next send found the consumer closed
    assert runner.edge_stats[("src", "s0")].items == 3


@pytest.mark.parametrize(("edges", "inline"), [
    ([("a", "b"), ("b", "c")], {"b", "c"}),  # a line
    ([("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")], set()),  # a fan-out, then a fan-in
    ([("a", "b"), ("b", "c"), ("b", "d")], {"b"}),  # b fans out: c and d get inboxes
])
def test_the_inline_rule(edges: list[tuple[str, str]], inline: set[str]) -> None:
    stages = sorted({s for edge in edges for s in edge})
    assert inline_stages(stages, edges, "a", lambda sid: True) == inline
    assert inline_stages(stages, edges, "a", lambda sid: False) == frozenset()


def test_route_figures_keep_their_shape() -> None:
    route: Route = runner_of(graph()).route
    assert route.stages == ("src", "sink") and route.edges == (("src", "sink"),) and route.inline == {"sink"}


def test_a_chain_fed_without_awaiting_keeps_its_order_where_a_step_must_await() -> None:
    runner = runner_of(graph("test.now_upper", "test.now_upper", now=True))
    out = run(runner, "fog slowly rolls slower in over the bay")
    assert out.frames == [w.encode() for w in "FOG SLOWLY ROLLS SLOWER IN OVER THE BAY <END> <end>".split()]
    assert out.finished
    assert out.now == 6  # all but the two slow words (and the ends, which await)
    assert {edge: e.items for edge, e in runner.edge_stats.items()} == {
        ("src", "s0"): 8, ("s0", "s1"): 9, ("s1", "sink"): 10}
    assert all((s.runs, s.active, s.errors) == (1, 0, 0) for s in runner.stage_stats.values())


def test_a_step_fed_without_awaiting_that_wants_no_more_ends_once() -> None:
    REFUSED.clear()
    runner = runner_of(graph("test.now_upper", now=True))
    out = run(runner, "one two stop three")
    assert out.frames == [b"ONE", b"TWO", b"<end>"] and out.finished  # its end ran once, in the task
    assert REFUSED == ["src"]
    assert runner.edge_stats[("src", "s0")].items == 3


def test_an_error_in_a_step_fed_without_awaiting_is_charged_to_it_alone() -> None:
    runner = runner_of(graph("test.now_upper", "test.now_upper", now=True))
    with pytest.raises(ValueError, match="boom"):
        run(runner, "fog boom wind")
    assert {sid: s.errors for sid, s in runner.stage_stats.items()} == {"src": 0, "s0": 1, "s1": 0, "sink": 0}
    assert all(s.active == 0 for s in runner.stage_stats.values())


def test_items_sent_in_one_pass_behind_a_waiting_one_keep_their_order() -> None:
    runner = runner_of(graph("test.now_upper", "test.now_upper", now=True))
    out = run(runner, "burst a slow b c slower d")
    assert out.frames == [w.encode() for w in "A SLOW B C SLOWER D <END> <end>".split()]
    assert out.now == 1  # "a" alone: everything after "slow" waited for the task, in order


def test_a_step_that_wants_no_more_drops_what_waited_behind_it() -> None:
    runner = runner_of(graph("test.now_upper", "test.now_upper", now=True))
    out = run(runner, "burst a slow stop b c")
    assert out.frames == [b"A", b"SLOW", b"<END>", b"<end>"] and out.finished  # "b" and "c" were not fed
