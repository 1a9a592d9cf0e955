"""The Anthropic Messages stages: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Counting shares the inference path's ``chat.prepare`` (template, tools,
tokenizer), so the number reported is exactly what a request would prefill:
``anthropic.count_tokens.decode → chat.prepare → anthropic.count_tokens.format``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from protocols import anthropic_messages
from protocols.ir import ChatRequest, HttpRequest, PreparedPrompt
from stages.protocol import JsonFormat, ProtocolDecode, ProtocolFormat


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


class AnthropicCountTokensFormat(JsonFormat[PreparedPrompt]):
    type_name: ClassVar[str] = "anthropic.count_tokens.format"
    description = "answers {input_tokens} for a prepared prompt"
    codec = anthropic_messages.MessagesCodec

    def encode(self, item: PreparedPrompt) -> dict[str, Any]:
        return {"input_tokens": len(item.token_ids)}
