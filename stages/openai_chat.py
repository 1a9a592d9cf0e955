"""``openai.chat.decode`` and ``openai.chat.format``: the OpenAI Chat Completions pair."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import trio

from flow.registry import register_stage
from flow.stage import EntryStage, ExitStage, Outbox
from protocols import openai_chat
from protocols.errors import ApiError
from protocols.ir import ChatRequest, HttpRequest, ResponseStarted, ResultBuilder, StreamEvent, WireFrame
from protocols.sse import dumps

SSE_HEADERS = (("content-type", "text/event-stream"), ("cache-control", "no-cache"), ("x-accel-buffering", "no"))
JSON_HEADERS = (("content-type", "application/json"),)


def error_response(error: ApiError, body: bytes) -> WireFrame:
    headers = list(JSON_HEADERS)
    if error.retry_after is not None:
        headers.append(("retry-after", str(max(1, round(error.retry_after)))))
    return WireFrame(body, status=error.status, headers=tuple(headers))


@register_stage
class OpenAIChatDecode(EntryStage[HttpRequest, ChatRequest]):
    type_name: ClassVar[str] = "openai.chat.decode"
    input_type: ClassVar[Any] = HttpRequest
    output_type: ClassVar[Any] = ChatRequest
    description = "validates an OpenAI chat.completions body into a protocol-neutral chat request"

    async def run(self, inbox: trio.MemoryReceiveChannel[HttpRequest], outbox: Outbox[ChatRequest]) -> None:
        async for http in inbox:
            await outbox.send(openai_chat.decode_chat_request(http.body, http.request_id, int(time.time())))


@register_stage
class OpenAIChatFormat(ExitStage[StreamEvent, WireFrame]):
    type_name: ClassVar[str] = "openai.chat.format"
    input_type: ClassVar[Any] = StreamEvent
    output_type: ClassVar[Any] = WireFrame
    description = "encodes events as chat.completion JSON or chat.completion.chunk SSE"

    @classmethod
    def error_response(cls, error: ApiError) -> WireFrame:
        return error_response(error, openai_chat.error_body(error))

    @classmethod
    def error_frames(cls, error: ApiError) -> list[WireFrame]:
        return [WireFrame(b"".join(openai_chat.error_frames(error)))]

    async def run(self, inbox: trio.MemoryReceiveChannel[StreamEvent], outbox: Outbox[WireFrame]) -> None:
        header = await inbox.receive()
        if not isinstance(header, ResponseStarted):
            raise TypeError(f"openai.chat.format expects ResponseStarted first, got {type(header).__name__}")
        if header.request.stream:
            encoder = openai_chat.ChatStreamEncoder(header)
            await outbox.send(WireFrame(b"".join(encoder.start()), headers=SSE_HEADERS, streaming=True))
            async for event in inbox:
                frames = encoder.encode(event)
                if frames:
                    await outbox.send(WireFrame(b"".join(frames)))
            return
        builder = ResultBuilder()
        builder.add(header)
        async for event in inbox:
            builder.add(event)
        await outbox.send(WireFrame(dumps(openai_chat.encode_completion(builder.result())), headers=JSON_HEADERS))
