"""The stage contract: declared ports, a config model, and a per-request ``run``.

A stage class declares, as class attributes, everything the compiler needs
without instantiating it: its registry ``type_name``, the item type its input
accepts, the item type its output produces, its ``Config`` model (pydantic,
unknown keys forbidden), and which config fields name resources (``references``).

One instance is built per stage in a graph when the server starts (config
validated, referenced resources linked). Per request, a stage either runs as a task —
``run(inbox, outbox)``, called once per request on that request's path, per-request state
in locals — or, if it does its work as a :class:`Step` (``open_step``), is fed its items in
turn by whoever produces them: in its producer's task when it is the only consumer of the
only producer it has on the route (the runner fuses such chains, see
:mod:`flow.graph.runner`), else by the default ``run`` from an inbox. A step may await
anything (a worker thread, a store); it only must not need a task of its own.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import trio
from pydantic import BaseModel, ConfigDict

from flow.graph.resource import Links, Reference
from protocols.codec import Codec, error_response, error_stream_end
from protocols.errors import ApiError
from protocols.ir import ProtocolContext, WireFrame

log = logging.getLogger("flow.graph.stage")

In = TypeVar("In")
Out = TypeVar("Out")


class StageConfig(BaseModel):
    """Base for stage config models: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class EdgeStats:
    """Traffic on one graph edge, summed over requests (``/stats``, ``/metrics``)."""

    items: int = 0  # items sent along the edge
    full: int = 0  # sends that found the consumer's inbox full: the consumer is the bottleneck
    streams: int = 0  # requests that used the edge


@dataclass
class StageStats:
    """One stage's runs, summed over requests (``/stats``): what is running now, and what failed."""

    active: int = 0  # requests whose task for this stage is running now
    runs: int = 0
    errors: int = 0  # runs that ended with an exception (a client's cancellation is not one)
    queued: int = 0  # items waiting in the inboxes of the active runs (filled in when read)


# The callbacks to run when the current request ends; set by the route runner, inherited by
# every stage task of the request (and the worker threads they start).
_REQUEST_END: ContextVar[list[Callable[[], None]] | None] = ContextVar("flow_request_end", default=None)


# What stages tell about the current request for the console's recent list (model, tokens); set per request
# by the server, inherited by every stage task of the request.
_REQUEST_NOTES: ContextVar[dict[str, Any] | None] = ContextVar("flow_request_notes", default=None)


def note_request(**fields: Any) -> None:
    """Record facts about the current request (``model=``, ``completion_tokens=``) for ``/stats``'s recent
    requests; a no-op outside a request."""
    notes = _REQUEST_NOTES.get()
    if notes is not None:
        notes.update(fields)


@contextmanager
def request_notes(notes: dict[str, Any], pace: Callable[[], Awaitable[None]] | None = None) -> Iterator[None]:
    """The scope in which :func:`note_request` writes into ``notes``, and :func:`paced` waits on ``pace``."""
    token, paced_by = _REQUEST_NOTES.set(notes), _REQUEST_PACE.set(pace)
    try:
        yield
    finally:
        _REQUEST_PACE.reset(paced_by)
        _REQUEST_NOTES.reset(token)


# How a request waits its turn before work that comes in waves; set per request by the server (its admission
# pacer: a few requests a turn of the event loop), inherited by the request's stage tasks.
_REQUEST_PACE: ContextVar[Callable[[], Awaitable[None]] | None] = ContextVar("flow_request_pace", default=None)


async def paced() -> None:
    """Wait for this request's turn, before work that many requests may have at once: the end of a request (a
    stream's last frames, a whole body's formatting), when every row of an engine step finished together (all
    asked for the same number of tokens). Spread over turns of the event loop, the streams still running get
    their tokens between them. No wait outside a server."""
    pace = _REQUEST_PACE.get()
    if pace is not None:
        await pace()


def on_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current request ends, however it ends: answered, failed, cancelled, or
    its client gone. For what a stage holds for the request's whole life (an agent's turn)."""
    callbacks = _REQUEST_END.get()
    if callbacks is None:
        raise RuntimeError("on_request_end() is for stages running a request")
    callbacks.append(callback)


@contextmanager
def request_lifetime() -> Iterator[None]:
    """The scope of one request: callbacks registered inside run at its exit, last first."""
    callbacks: list[Callable[[], None]] = []
    token = _REQUEST_END.set(callbacks)
    try:
        yield
    finally:
        _REQUEST_END.reset(token)
        for callback in reversed(callbacks):
            try:
                callback()
            except Exception:  # one failing release must not skip the others, nor fail the request
                log.exception("request-end callback failed")


class Outbox(Generic[Out]):
    """A stage's output: every on-path consumer gets every item (usually there is one).

    This one sends into its consumers' inboxes; a consumer that runs inline in the producer's task is fed
    through another kind (:class:`flow.graph.runner.InlineOutbox`), with the same methods."""

    def __init__(self, channels: Sequence[trio.MemorySendChannel[Any]],
                 stats: Sequence[EdgeStats] | None = None) -> None:
        self._channels = list(channels)
        self._stats = list(stats) if stats is not None else []
        for edge in self._stats:
            edge.streams += 1
        self.sent = 0

    async def send(self, item: Out) -> None:
        self.sent += 1
        if self._stats:
            for channel, edge in zip(self._channels, self._stats):
                numbers = channel.statistics()
                if numbers.current_buffer_used >= numbers.max_buffer_size:
                    edge.full += 1
                edge.items += 1
                await channel.send(item)
            return
        for channel in self._channels:
            await channel.send(item)

    def sends_now(self) -> bool:
        """Whether this outbox has :meth:`send_now` at all. A channel's has not: its consumer is a task of its
        own."""
        return False

    def ready(self) -> bool:
        """Whether :meth:`send_now` would hand an item on without waiting, now."""
        return False

    def send_now(self, item: Out) -> None:
        """Send without waiting, from code that cannot await (an engine step's delivery, see
        :mod:`stages.rows`), where :meth:`sends_now`. The item is taken even if it cannot go all the way at
        once: what must wait is kept, in order, until :meth:`drain`."""
        raise NotImplementedError(f"{type(self).__name__} does not send without waiting")

    async def drain(self) -> None:
        """Finish what :meth:`send_now` left waiting (a step that had to await, bytes the socket did not take),
        in order."""

    async def finish(self) -> None:
        """The producer's output is complete (its ``run`` returned): the consumers see the end of the stream."""
        self.close()

    def close(self) -> None:
        """End the stream however the producer ended (raised, cancelled): after :meth:`finish`, or instead."""
        # Synchronous on purpose: it must complete even inside a cancelled scope.
        for channel in self._channels:
            channel.close()


class Step(Generic[In, Out]):
    """One request's pass through a stage that needs no task of its own: its items are fed to it in turn, and
    what it makes of each it sends on through ``out``. Per-request state lives on the step (one per request).

    ``feed`` returns whether it takes more items: ``False`` once it has all it wants (a stop string matched),
    which ends its input as closing a task's inbox would (the producer's next send raises
    ``BrokenResourceError``). ``end`` is called once the input is complete or the step wants no more, unless the
    request failed first."""

    async def feed(self, item: In, out: Outbox[Out]) -> bool:
        raise NotImplementedError

    async def end(self, out: Outbox[Out]) -> None:
        return None

    def feed_now(self, item: In, out: Outbox[Out]) -> bool:
        """``feed`` without awaiting, sending through ``out.send_now``, for a step whose per-item work is
        synchronous (a streamed token's detokenizing and encoding): called by whoever cannot await — an engine
        step handing every row its token at once. Raises :class:`NotNow`, having changed nothing, for an item it
        can only take by awaiting (then ``feed`` gets it, from the request's task)."""
        raise NotNow


class NotNow(Exception):
    """A step cannot take this item without awaiting; nothing was changed (see :meth:`Step.feed_now`)."""


def takes_now(step: Step[Any, Any]) -> bool:
    """Whether ``step`` has a :meth:`Step.feed_now` of its own."""
    return type(step).feed_now is not Step.feed_now


class EachItem(Step[In, Out]):
    """A step that answers each item with one item: ``await answer(item)``."""

    def __init__(self, answer: Callable[[In], Awaitable[Out]]) -> None:
        self._answer = answer

    async def feed(self, item: In, out: Outbox[Out]) -> bool:
        await out.send(await self._answer(item))
        return True


def _ports(cls: type, bound: Mapping[Any, Any]) -> tuple[Any, Any] | None:
    """The ``(In, Out)`` that ``cls`` gives :class:`Stage`, following its generic bases (``BodyDecode[X]`` is
    ``EntryStage[HttpRequest, X]``, which is ``Stage[HttpRequest, X]``); ``bound``: the type variables of
    ``cls`` already given."""
    for base in getattr(cls, "__orig_bases__", ()):
        origin = typing.get_origin(base) or base
        if not (isinstance(origin, type) and issubclass(origin, Stage)):
            continue
        args = tuple(bound.get(arg, arg) for arg in typing.get_args(base))
        if origin is Stage:
            return (args[0], args[1]) if len(args) == 2 else None
        found = _ports(origin, dict(zip(getattr(origin, "__parameters__", ()), args)))
        if found is not None:
            return found
    return None


class Stage(Generic[In, Out]):
    """A stage type. Its ports are its type arguments: ``class ChatPrepare(Stage[ChatRequest, PreparedPrompt])``
    takes ``ChatRequest`` items and sends ``PreparedPrompt`` ones; :attr:`input_type` and :attr:`output_type`
    are read from them when the class is made, for the compiler (no instance needed)."""

    type_name: ClassVar[str]
    input_type: ClassVar[Any]
    output_type: ClassVar[Any]
    # Whether the stage works as a Step (``open_step``) with the default ``run``: then it may run inline in its
    # producer's task. Read from the class when it is made, for the compiler.
    inline: ClassVar[bool] = False
    Config: ClassVar[type[StageConfig]] = StageConfig
    # Config fields whose values name resources (checked and resolved by the compiler).
    references: ClassVar[Mapping[str, Reference]] = {}
    description: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ports = _ports(cls, {})
        if ports is not None and not any(isinstance(port, TypeVar) for port in ports):
            cls.input_type, cls.output_type = ports
        # A class with a run loop of its own keeps its task, whatever step a base class offers.
        cls.inline = cls.open_step is not Stage.open_step and cls.run is Stage.run

    def __init__(self, stage_id: str, config: StageConfig, links: Links) -> None:
        self.id = stage_id
        self.config = config
        self.links = links
        self.setup()

    def setup(self) -> None:
        """Called once the stage is made, its config and resources in place: a stage type looks up what it
        uses here (``self.links``), rather than overriding ``__init__``."""

    def open_step(self) -> Step[In, Out]:
        """The request's step, for a stage that works as one (see :class:`Step`)."""
        raise NotImplementedError

    async def run(self, inbox: trio.MemoryReceiveChannel[In], outbox: Outbox[Out]) -> None:
        """The stage as a task: by default, its step fed from ``inbox``."""
        step = self.open_step()
        async for item in inbox:
            if not await step.feed(item, outbox):
                break  # it has all it wants: the inbox closes when the task ends, which tells the producer
        await step.end(outbox)


class EntryStage(Stage[In, Out]):
    """A stage fed by the HTTP shell; its graph table carries ``routes`` and ``exit``.

    ``context_type``: what it hands its exit stage inside the request (see :class:`ProtocolContext`).
    ``public``: its routes answer without the API key (a page that holds no server data, like the console's
    shell: a browser opening it cannot send a key, so the page asks for one).
    ``body_types``: the content types its routes take (JSON; file uploads add ``multipart/form-data``).
    ``monitoring_methods``: methods whose requests only read the server's own state (the console's page, the
    library, the downloads list): counted and timed like any, but left out of ``/stats``' recent requests, which
    a console open for minutes would otherwise fill with its own reads."""

    context_type: ClassVar[type[ProtocolContext]] = ProtocolContext
    public: ClassVar[bool] = False
    monitoring_methods: ClassVar[frozenset[str]] = frozenset()
    body_types: ClassVar[frozenset[str]] = frozenset({"application/json"})


class ExitStage(Stage[In, Out]):
    """A stage whose output goes to the client; errors are rendered by its protocol's ``codec``.

    ``reads_context``: the context it needs from its route's entry stage (the compiler checks each route)."""

    codec: ClassVar[Codec]
    reads_context: ClassVar[type[ProtocolContext]] = ProtocolContext

    @classmethod
    def error_response(cls, error: ApiError) -> WireFrame:
        """The whole response for an error raised before anything was sent."""
        return error_response(cls.codec, error)

    @classmethod
    def error_frames(cls, error: ApiError) -> list[WireFrame]:
        """Frames that end a stream that failed after it began."""
        return [error_stream_end(cls.codec, error)]
