"""Stream frames from templates are the bytes the whole frame's encoding gives.

Per token, the protocols' stream encoders fill a :class:`FrameTemplate` (the frame's bytes around its text,
encoded once) instead of building and encoding the frame's object. Each encoder here runs a response twice —
templates on, and with every template calling its ``build`` directly (the object built and encoded) — and the
two byte streams must be equal, for text that JSON must escape, reasoning and content, several choices.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from protocols import anthropic_messages, ollama, openai_chat, openai_responses
from protocols.codec import StreamEncoder
from protocols.ir import (
    ChatRequest,
    Message,
    ReasoningDelta,
    ResponseFinished,
    ResponseStarted,
    StreamEvent,
    TextDelta,
    Usage,
)
from protocols.sse import FrameTemplate, data_frame, dumps

TEXTS = ["Hello", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "\x00\x1f control", "é ü ß", "灯台守",
         "emoji 🌊🗼", "\u2028\u2029", "</script>", "", "{\"json\": [1, 2]}", "100% %s %b %%"]


def events(choices: int = 1) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    for choice in range(choices):
        out += [ReasoningDelta(t, choice=choice) for t in TEXTS[:4]]
        out += [TextDelta(t, choice=choice) for t in TEXTS]
    for choice in range(choices):
        out.append(ResponseFinished("stop", Usage(5, 7), choice=choice))
    return out


def run(encoder: StreamEncoder, stream: list[StreamEvent]) -> bytes:
    return b"".join([*encoder.start(), *(frame for event in stream for frame in encoder.encode(event))])


def both_ways(make: Callable[[], StreamEncoder], stream: list[StreamEvent], monkeypatch: pytest.MonkeyPatch) -> None:
    fast = run(make(), stream)
    with monkeypatch.context() as patch:
        patch.setattr(FrameTemplate, "__call__", lambda self, *values: self.build(*values))
        slow = run(make(), stream)
    assert fast == slow


def started(n: int = 1, **context: object) -> ResponseStarted:
    request = ChatRequest(model="tiny-ü", messages=(Message("user", "hi"),), stream=True, include_usage=True, n=n,
                          request_id="r1", created=1700000000, **context)  # type: ignore[arg-type]
    return ResponseStarted(request, prompt_tokens=5)


def test_openai_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    both_ways(lambda: openai_chat.ChatStreamEncoder(started(n=2)), events(choices=2), monkeypatch)


def test_anthropic_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    both_ways(lambda: anthropic_messages.MessagesStreamEncoder(started()), events(), monkeypatch)


def test_responses(monkeypatch: pytest.MonkeyPatch) -> None:
    context = openai_responses.ResponsesContext(echo={"store": False})
    both_ways(lambda: openai_responses.ResponsesStreamEncoder(started(context=context)), events(), monkeypatch)


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_ollama(endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    context = ollama.OllamaContext(endpoint=endpoint, started_ns=0)  # type: ignore[arg-type]
    monkeypatch.setattr(ollama, "created_at", lambda: "2026-11-27T00:00:00.000000Z")  # the one varying field
    both_ways(lambda: ollama.StreamEncoder(started(context=context)), events()[:-1], monkeypatch)


def test_a_template_with_a_number_and_a_text() -> None:
    template = FrameTemplate(lambda seq, text: data_frame({"n": seq, "text": text, "tail": [None]}), 2)
    for seq, text in enumerate(TEXTS):
        assert template(seq, text) == data_frame({"n": seq, "text": text, "tail": [None]})
    assert template(1, "\ud800 lone surrogate") == b"data: {\"n\":1,\"text\":" + dumps("\ud800 lone surrogate") + \
        b",\"tail\":[null]}\n\n"


def test_a_field_must_appear_once() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        FrameTemplate(lambda text: data_frame({"a": text, "b": text}))
    with pytest.raises(ValueError, match="exactly once"):
        FrameTemplate(lambda text: data_frame({"a": "constant"}))


def test_a_frame_with_percent_signs_around_its_fields() -> None:
    """Several fields are joined through a %-format: the frame's own % signs and the values' stay as they are."""
    template = FrameTemplate(lambda n, text: b"data: 100% " + dumps({"n": n, "t": text, "k": "%b%%"}) + b"\n\n", 2)
    for n, text in ((0, "%s"), (12, "50% off %b %%"), (2**40, "")):
        assert template(n, text) == template.build(n, text)
