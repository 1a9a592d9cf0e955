"""The route runner: a linear chain of steps runs in one task, everything else in tasks joined by channels, and
every stage and edge counts its figures either way.

Small stage types of the tests' own (a registry of them, no model): a source that sends each word of the
body, an upper-caser, a stage with a run loop of its own, one that fails on a word, one that wants no more
after a word, and a sink that answers each item as a frame.
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
from flow.graph.stage import EachItem, EntryStage, ExitStage, Outbox, Stage, Step
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


class Frames(Outbox[WireFrame]):
    def __init__(self) -> None:
        super().__init__(())
        self.frames: list[bytes] = []
        self.finished = False

    async def send(self, item: WireFrame) -> None:
        self.sent += 1
        self.frames.append(item.data)

    async def finish(self) -> None:
        self.finished = True


def graph(*chain: str) -> CompiledGraph:
    """A route POST /t: the source, then ``chain``'s stage types in a line, then the sink."""
    registry = Registry()
    for cls in (Source, Upper, Tasked, Boom, Stopper, Sink):
        registry.add(cls)
    stages: dict[str, Any] = {"src": {"type": "test.source", "routes": ["POST /t"], "exit": "sink"}}
    previous = "src"
    for i, type_name in enumerate(chain):
        stages[f"s{i}"] = {"type": type_name, "inputs": [previous]}
        previous = f"s{i}"
    stages["sink"] = {"type": "test.sink", "inputs": [previous]}
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
