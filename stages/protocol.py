"""The shared shape of protocol entry and exit stages.

An entry stage (:class:`ProtocolDecode`) turns the HTTP request into a
protocol-neutral :class:`ChatRequest`; an exit stage (:class:`ProtocolFormat`)
turns the event stream back into the protocol's wire format. Both loops are
the same for every protocol; a protocol contributes only its ``decode``
function and its :class:`~protocols.codec.Codec`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, TypeVar

import trio
from pydantic import Field

from flow.graph.isolation import Budget, BudgetExceeded, ChildFailed, run_bounded
from flow.graph.stage import (
    EachItem,
    EntryStage,
    ExitStage,
    NotNow,
    Outbox,
    StageConfig,
    Step,
    note_request,
)
from protocols import documents
from protocols.codec import JSON_HEADERS, StreamEncoder
from protocols.errors import ApiError
from protocols.ir import (
    ChatRequest,
    FinalResult,
    HttpRequest,
    ResponseFinished,
    ResponseStarted,
    ResultBuilder,
    StreamEvent,
    WireFrame,
)
from protocols.sse import dumps

SSE_HEADERS = (("content-type", "text/event-stream"), ("cache-control", "no-cache"), ("x-accel-buffering", "no"))


def json_frame(obj: Any) -> WireFrame:
    return WireFrame(dumps(obj), headers=JSON_HEADERS)


# A list longer than this is written this many items at a time (see dumps_in_pieces).
PIECE_ITEMS = 64


def _long(value: Any) -> bool:
    return isinstance(value, list) and len(value) > PIECE_ITEMS


async def dumps_in_pieces(obj: Any) -> bytes:
    """``dumps(obj)``, the same bytes; a long list — the answer itself, or a field of it (the ``data`` of a
    list answer) — written a piece at a time, the event loop given back between pieces. One ``orjson`` call
    holds the GIL to its end: 2,048 embedding vectors took 80 ms, during which no other request moved and the
    device thread could not build its next pass. Anything else is one ``dumps`` call."""
    if _long(obj):
        pieces = []
        for start in range(0, len(obj), PIECE_ITEMS):
            pieces.append(dumps(obj[start:start + PIECE_ITEMS])[1:-1])
            await trio.lowlevel.checkpoint()
        return b"[" + b",".join(pieces) + b"]"
    if isinstance(obj, dict) and any(_long(value) for value in obj.values()) and all(isinstance(k, str) for k in obj):
        fields = [dumps(key) + b":" + await dumps_in_pieces(value) for key, value in obj.items()]
        return b"{" + b",".join(fields) + b"}"
    return dumps(obj)


In = TypeVar("In")
Out = TypeVar("Out")
T = TypeVar("T")

# A body up to this size is decoded on the event loop (well under a millisecond, no thread hop), unless it
# carries a document; a larger one on a worker thread.
INLINE_BODY_BYTES = 16 << 10
# Decoding threads at once: each holds the GIL in turns with the event loop, which waits for every other
# runnable thread's turn (5 ms each), so a flood of large bodies must not become a flood of threads.
DECODE_THREADS = trio.CapacityLimiter(2)


class BoundedDocuments:
    """How one request's decode reads PDFs: each in a child process (flow.graph.isolation), all of them within
    ``documents.PDF_CPU_SECONDS``; over it, a 413 that names the limit."""

    def __init__(self) -> None:
        self.left = documents.PDF_CPU_SECONDS

    def __call__(self, data: bytes, where: str) -> str:
        started = time.monotonic()
        try:
            if self.left <= 0:
                raise BudgetExceeded("cpu", Budget(cpu_seconds=0))
            return run_bounded(documents.extract_pdf_text, data, where, budget=Budget(cpu_seconds=self.left))
        except BudgetExceeded as exc:
            limit = {"cpu": f"{documents.PDF_CPU_SECONDS:g} s of CPU", "time": "its time",
                     "memory": f"{exc.budget.memory_bytes >> 20} MiB of memory"}[exc.limit]
            raise ApiError("request_too_large", f"Reading the text of '{where}' was stopped: a request's documents "
                           f"may take at most {limit} to read. Send fewer or simpler pages, or their text.",
                           param=where) from None
        except ChildFailed as exc:
            raise ApiError("invalid_request", f"'{where}' is not a readable PDF ({exc}).", param=where) from None
        finally:
            self.left -= time.monotonic() - started  # wall time: at least the CPU time the child had


def _refuse_on_loop(data: bytes, where: str) -> str:
    raise documents.NeedsWorker(where)


# True while a decode runs on the event loop (decode_off_loop's first try).
_on_loop: ContextVar[bool] = ContextVar("decoding_on_loop", default=False)


def off_loop_only(where: str) -> None:
    """Called by a decode before work that must not run on the event loop (reading a store's file): on the loop,
    the decode starts again on a worker thread (:func:`decode_off_loop`)."""
    if _on_loop.get():
        raise documents.NeedsWorker(where)


def _decode_with_bounded_documents(decode: Callable[..., T], http: HttpRequest, *args: Any) -> T:
    token = documents.pdf_reader.set(BoundedDocuments())
    try:
        return decode(http, *args)
    finally:
        documents.pdf_reader.reset(token)


async def decode_off_loop(decode: Callable[..., T], http: HttpRequest, *args: Any) -> T:
    """``decode(http, *args)`` without stalling the event loop: a small body inline, unless it carries a
    document or its decode reads a file (:func:`off_loop_only`); anything else on a worker thread, its PDFs read
    in bounded child processes."""
    if len(http.body) <= INLINE_BODY_BYTES:
        token, on_loop = documents.pdf_reader.set(_refuse_on_loop), _on_loop.set(True)
        try:
            return decode(http, *args)
        except documents.NeedsWorker:
            pass
        finally:
            _on_loop.reset(on_loop)
            documents.pdf_reader.reset(token)
    return await decode_on_worker(decode, http, *args)


async def decode_on_worker(decode: Callable[..., T], http: HttpRequest, *args: Any) -> T:
    """``decode(http, *args)`` on a worker thread (one that reads a store's file, or a large body), its PDFs
    read in bounded child processes."""
    return await trio.to_thread.run_sync(_decode_with_bounded_documents, decode, http, *args,
                                         limiter=DECODE_THREADS)


class BodyDecode(EntryStage[HttpRequest, Out]):
    """Entry stage: the HTTP request as the item its path works on, by one :meth:`decode`."""

    def decode(self, http: HttpRequest) -> Out:
        raise NotImplementedError

    async def _decoded(self, http: HttpRequest) -> Out:
        return await decode_off_loop(self.decode, http)

    def open_step(self) -> Step[HttpRequest, Out]:
        return EachItem(self._decoded)


class JsonFormat(ExitStage[In, WireFrame]):
    """Exit stage: each item answered as one JSON body, by one :meth:`encode`."""

    def encode(self, item: In) -> Any:
        raise NotImplementedError

    async def _frame(self, item: In) -> WireFrame:
        return WireFrame(await dumps_in_pieces(self.encode(item)), headers=JSON_HEADERS)

    def open_step(self) -> Step[In, WireFrame]:
        return EachItem(self._frame)


class ProtocolDecode(EntryStage[HttpRequest, ChatRequest]):
    """Entry stage: validates a protocol's body into a :class:`ChatRequest`."""

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        raise NotImplementedError

    async def decode_request(self, http: HttpRequest) -> ChatRequest:
        """:meth:`decode` without stalling the event loop (a stage that reads a file decodes on a worker)."""
        return await decode_off_loop(self.decode, http, int(time.time()))

    def open_step(self) -> Step[HttpRequest, ChatRequest]:
        return EachItem(self.decode_request)


class EndpointStage(EntryStage[HttpRequest, WireFrame], ExitStage[HttpRequest, WireFrame]):
    """A route's entry and exit in one: it answers each request by itself (a listing, a stored object)
    with the JSON body :meth:`answer` returns; its errors take its ``codec``'s shape."""

    async def answer(self, http: HttpRequest) -> Any:
        raise NotImplementedError

    async def _frame(self, http: HttpRequest) -> WireFrame:
        return json_frame(await self.answer(http))

    def open_step(self) -> Step[HttpRequest, WireFrame]:
        return EachItem(self._frame)


class FormatConfig(StageConfig):
    keepalive_seconds: float = Field(
        default=10.0, gt=0, description="idle seconds (e.g. a long prefill) after which a stream gets a keepalive")


class ProtocolFormat(ExitStage[StreamEvent, WireFrame]):
    """Exit stage: SSE frames as events arrive, or one JSON body at the end."""

    Config = FormatConfig

    async def finished(self, result: FinalResult, body: dict[str, Any]) -> None:
        """Called once the whole response is known (the Responses store keeps it, the agents API
        appends it to the agent's history), before its last bytes are sent: a client that follows
        up as soon as it has the response finds it recorded."""

    def open_step(self) -> Step[StreamEvent, WireFrame]:
        return _Formatting(self)


class _Formatting(Step[StreamEvent, WireFrame]):
    """One response's formatting: its header, then each event as frames (a stream) or folded into the
    result (one JSON body at the end). A stream's first frame says how to keep it open while it is quiet;
    the server writes that keepalive (flow.serve.exit)."""

    def __init__(self, stage: ProtocolFormat) -> None:
        self.stage = stage
        self.builder = ResultBuilder()
        self.started = False
        self.encoder: StreamEncoder | None = None
        # A stream folds its events into the whole result only for a stage that keeps it (``finished``: the
        # Responses store, an agent's history); otherwise its finish events are all the result needs.
        self.keeps_result = type(stage).finished is not ProtocolFormat.finished

    async def feed(self, event: StreamEvent, out: Outbox[WireFrame]) -> bool:
        stage, builder = self.stage, self.builder
        if not self.started:
            if not isinstance(event, ResponseStarted):
                raise TypeError(f"{stage.type_name} expects ResponseStarted first, got {type(event).__name__}")
            self.started = True
            builder.add(event)
            if event.request.stream:
                codec = stage.codec
                opened = self.encoder = codec.stream_encoder(event)
                headers = getattr(codec, "stream_headers", SSE_HEADERS)  # SSE, or a codec's own (NDJSON)
                await out.send(WireFrame(b"".join(opened.start()), headers=headers, streaming=True,
                                         keepalive=b"".join(opened.keepalive()),
                                         keepalive_seconds=stage.config.keepalive_seconds))  # type: ignore[attr-defined]
            return True
        result = self._fold(event)
        if result is not None and self.keeps_result:
            await stage.finished(result, stage.codec.encode_final(result))
        frame = self._frame(event)
        if frame is not None:
            await out.send(frame)
        return True

    def feed_now(self, event: StreamEvent, out: Outbox[WireFrame]) -> bool:
        if not self.started or (self.keeps_result and self.encoder is not None
                                and isinstance(event, ResponseFinished)):
            raise NotNow  # the header, or the end of a streamed result the stage keeps (``finished`` awaits)
        self._fold(event)
        frame = self._frame(event)
        if frame is not None:
            out.send_now(frame)
        return True

    def _fold(self, event: StreamEvent) -> FinalResult | None:
        """Fold ``event`` into the result as far as it is needed; the whole result once the last choice ends
        (a stream's), else ``None``."""
        builder = self.builder
        if self.encoder is None:
            builder.add(event)
            return None  # one JSON body, at the end
        if self.keeps_result or isinstance(event, ResponseFinished):
            builder.add(event)
        if isinstance(event, ResponseFinished) and builder.finished is not None:  # the last choice's
            result = builder.result()
            note_request(completion_tokens=result.usage.completion_tokens)
            return result
        return None

    def _frame(self, event: StreamEvent) -> WireFrame | None:
        """A stream's frame for ``event`` (some events have none)."""
        if self.encoder is None:
            return None
        frames = self.encoder.encode(event)
        if not frames:
            return None
        return WireFrame(frames[0] if len(frames) == 1 else b"".join(frames))

    async def end(self, out: Outbox[WireFrame]) -> None:
        if not self.started:
            raise RuntimeError(f"{self.stage.type_name}: the event stream ended before its header")
        if self.encoder is not None:
            if self.builder.finished is None:
                self.builder.result()  # raises: the stream ended without its finish event
            return
        result = self.builder.result()
        note_request(completion_tokens=result.usage.completion_tokens)
        body = self.stage.codec.encode_final(result)
        await self.stage.finished(result, body)
        await out.send(json_frame(body))
