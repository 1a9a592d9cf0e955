"""``openai.chat.decode`` and ``openai.chat.format``: the OpenAI Chat Completions pair."""

from __future__ import annotations

from typing import ClassVar

from protocols import openai_chat
from protocols.ir import ChatRequest, HttpRequest
from stages.protocol import ProtocolDecode, ProtocolFormat


class OpenAIChatDecode(ProtocolDecode):
    type_name: ClassVar[str] = "openai.chat.decode"
    description = "validates an OpenAI chat.completions body into a protocol-neutral chat request"

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return openai_chat.decode_chat_request(http.body, http.request_id, created)


class OpenAIChatFormat(ProtocolFormat):
    type_name: ClassVar[str] = "openai.chat.format"
    description = "encodes events as chat.completion JSON or chat.completion.chunk SSE"
    codec = openai_chat.ChatCodec
