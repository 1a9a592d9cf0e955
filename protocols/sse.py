"""Server-sent events framing and compact JSON encoding."""

from __future__ import annotations

import json
from typing import Any

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    # An unpaired surrogate (echoed from a client's input in an error message) cannot be UTF-8: it is
    # written as its JSON escape ``\udXXX``, which is what the client sent.
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "backslashreplace")


def data_frame(obj: Any) -> bytes:
    """A ``data:`` only event (OpenAI style)."""
    return b"data: " + dumps(obj) + b"\n\n"


def event_frame(event: str, obj: Any) -> bytes:
    """An event with an ``event:`` line (Anthropic style: SDKs dispatch on it)."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(obj) + b"\n\n"
