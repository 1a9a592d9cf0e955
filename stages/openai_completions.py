"""``openai.completions.decode`` and ``openai.completions.format``: legacy text completions."""

from __future__ import annotations

from typing import ClassVar

from protocols import openai_completions
from protocols.ir import ChatRequest, HttpRequest
from stages.protocol import ProtocolDecode, ProtocolFormat


class OpenAICompletionsDecode(ProtocolDecode):
    type_name: ClassVar[str] = "openai.completions.decode"
    description = "validates a legacy completions body (raw prompt text or token ids) into a chat request"
    context_type = openai_completions.CompletionsContext

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return openai_completions.decode_completion_request(http.body, http.request_id, created)


class OpenAICompletionsFormat(ProtocolFormat):
    type_name: ClassVar[str] = "openai.completions.format"
    description = "encodes events as text_completion JSON or SSE chunks (echo, legacy logprobs)"
    codec = openai_completions.CompletionsCodec
    reads_context = openai_completions.CompletionsContext
