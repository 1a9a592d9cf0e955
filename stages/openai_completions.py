"""``openai.completions.decode`` and ``openai.completions.format``: legacy text completions."""

from __future__ import annotations

from typing import ClassVar

from flow.registry import register_stage
from protocols import openai_completions
from protocols.ir import ChatRequest, HttpRequest
from stages.protocol import ProtocolDecode, ProtocolFormat


@register_stage
class OpenAICompletionsDecode(ProtocolDecode):
    type_name: ClassVar[str] = "openai.completions.decode"
    description = "validates a legacy completions body (raw prompt text or token ids) into a chat request"

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return openai_completions.decode_completion_request(http.body, http.request_id, created)


@register_stage
class OpenAICompletionsFormat(ProtocolFormat):
    type_name: ClassVar[str] = "openai.completions.format"
    description = "encodes events as text_completion JSON or SSE chunks (echo, legacy logprobs)"
    codec = openai_completions.CompletionsCodec
