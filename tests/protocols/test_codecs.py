"""Protocol codecs without a server: error shapes and statuses, mid-stream errors, keepalives."""

from __future__ import annotations

import json

import pytest

from protocols import anthropic_messages, openai_chat, openai_completions, openai_responses
from protocols.codec import Codec
from protocols.errors import ApiError
from protocols.ir import NO_CONTEXT, ChatRequest, ResponseStarted

OPENAI_CODECS: list[type[Codec]] = [openai_chat.ChatCodec, openai_responses.ResponsesCodec,
                                    openai_completions.CompletionsCodec]


@pytest.mark.parametrize(("kind", "openai_status", "anthropic_status", "anthropic_type"), [
    ("invalid_request", 400, 400, "invalid_request_error"),
    ("authentication", 401, 401, "authentication_error"),
    ("not_found", 404, 404, "not_found_error"),
    ("overloaded", 429, 529, "overloaded_error"),
    ("internal", 500, 500, "api_error"),
])
def test_error_statuses_and_types(kind: str, openai_status: int, anthropic_status: int, anthropic_type: str) -> None:
    error = ApiError(kind, "boom")  # type: ignore[arg-type]
    for codec in OPENAI_CODECS:
        assert codec.error_status(error) == openai_status
        assert json.loads(codec.error_body(error))["error"]["message"] == "boom"
    assert anthropic_messages.MessagesCodec.error_status(error) == anthropic_status
    body = json.loads(anthropic_messages.MessagesCodec.error_body(error))
    assert body == {"type": "error", "error": {"type": anthropic_type, "message": "boom"}}


def test_mid_stream_errors() -> None:
    error = ApiError("internal", "the device failed")
    (frame,) = anthropic_messages.MessagesCodec.error_frames(error)
    assert frame.startswith(b"event: error\ndata: ")
    assert json.loads(frame.split(b"data: ", 1)[1])["error"]["type"] == "api_error"
    chat = openai_chat.ChatCodec.error_frames(error)
    assert json.loads(chat[0][6:])["error"]["message"] == "the device failed" and chat[-1] == b"data: [DONE]\n\n"
    (responses,) = openai_responses.ResponsesCodec.error_frames(error)
    assert responses.startswith(b"event: error\n")


def test_keepalives_are_ignored_by_clients() -> None:
    started = ResponseStarted(ChatRequest(model="m", messages=(), stream=True), prompt_tokens=3)
    assert anthropic_messages.MessagesCodec.stream_encoder(started).keepalive() == [
        b'event: ping\ndata: {"type":"ping"}\n\n']
    contexts = {openai_completions.CompletionsCodec: openai_completions.CompletionsContext(),
                openai_responses.ResponsesCodec: openai_responses.ResponsesContext()}
    for codec in OPENAI_CODECS:
        request = ChatRequest(model="m", messages=(), stream=True, context=contexts.get(codec, NO_CONTEXT))
        assert codec.stream_encoder(ResponseStarted(request, prompt_tokens=3)).keepalive() == [b": keepalive\n\n"]
