"""The Anthropic Messages stages: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Counting shares the inference path's ``chat.prepare`` (template, tools,
tokenizer), so the number reported is exactly what a request would prefill:
``anthropic.count_tokens.decode → chat.prepare → anthropic.count_tokens.format``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio

from flow.stage import ExitStage, Outbox
from protocols import anthropic_messages
from protocols.ir import ChatRequest, HttpRequest, PreparedPrompt, WireFrame
from stages.protocol import ProtocolDecode, ProtocolFormat, json_frame


class AnthropicMessagesDecode(ProtocolDecode):
    type_name: ClassVar[str] = "anthropic.messages.decode"
    description = "validates an Anthropic Messages body (blocks, tools, thinking) into a chat request"

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return anthropic_messages.decode_messages_request(http.body, http.request_id, created)


class AnthropicMessagesFormat(ProtocolFormat):
    type_name: ClassVar[str] = "anthropic.messages.format"
    description = "encodes events as an Anthropic message or its SSE event grammar"
    codec = anthropic_messages.MessagesCodec


class AnthropicCountTokensDecode(ProtocolDecode):
    type_name: ClassVar[str] = "anthropic.count_tokens.decode"
    description = "validates a count_tokens body (a Messages body without max_tokens)"

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return anthropic_messages.decode_messages_request(http.body, http.request_id, created, count_only=True)


class AnthropicCountTokensFormat(ExitStage[PreparedPrompt, WireFrame]):
    type_name: ClassVar[str] = "anthropic.count_tokens.format"
    input_type: ClassVar[Any] = PreparedPrompt
    output_type: ClassVar[Any] = WireFrame
    description = "answers {input_tokens} for a prepared prompt"

    codec = anthropic_messages.MessagesCodec

    async def run(self, inbox: trio.MemoryReceiveChannel[PreparedPrompt], outbox: Outbox[WireFrame]) -> None:
        async for prompt in inbox:
            await outbox.send(json_frame({"input_tokens": len(prompt.token_ids)}))
