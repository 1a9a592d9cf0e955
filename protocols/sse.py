"""Server-sent events framing and compact JSON encoding."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. orjson writes it about 20× faster than the standard library — a 2,048-vector
    embeddings answer in 0.08 s instead of 1.5 s of the event loop — and numpy float32 arrays as their
    shortest exact decimals. What orjson refuses goes through the standard library: an unpaired surrogate
    (echoed from a client's input in an error message) cannot be UTF-8 and is written as its JSON escape
    ``\\udXXX``, which is what the client sent; integers past 64 bits; non-string keys."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), default=_plain).encode(
            "utf-8", "backslashreplace")


def _plain(obj: Any) -> Any:
    tolist = getattr(obj, "tolist", None)  # a numpy array or scalar
    if tolist is None:
        raise TypeError(f"{type(obj).__name__} is not JSON serializable")
    return tolist()


def data_frame(obj: Any) -> bytes:
    """A ``data:`` only event (OpenAI style)."""
    return b"data: " + dumps(obj) + b"\n\n"


def event_frame(event: str, obj: Any) -> bytes:
    """An event with an ``event:`` line (Anthropic style: SDKs dispatch on it)."""
    return b"event: " + event.encode() + b"\ndata: " + dumps(obj) + b"\n\n"


class FrameTemplate:
    """One kind of frame whose few varying fields are a string or an integer, encoded once.

    ``build`` makes the frame (its object, encoded) from the fields' values; it is called once, with a marker
    string for each field, and its bytes are split at the markers. Calling the template with values then gives
    the bytes ``build`` would give for them, by joining the pieces with each value's encoding: a stream's text
    delta per token without building its object and encoding it whole. Each field must appear in the frame
    exactly once, in the order of ``build``'s parameters.
    """

    def __init__(self, build: Callable[..., bytes], fields: int = 1) -> None:
        marks = [dumps(f"\u0000flow-field-{i}\u0000") for i in range(fields)]
        rest = build(*(f"\u0000flow-field-{i}\u0000" for i in range(fields)))
        pieces: list[bytes] = []
        for mark in marks:
            head, found, rest = rest.partition(mark)
            if not found or any(m in rest for m in marks[:len(pieces) + 1]):
                raise ValueError("each field must appear exactly once in the frame, in order")
            pieces.append(head)
        pieces.append(rest)
        self._pieces = tuple(pieces)
        # The same as a %-format with a %b per field: the fields' encodings joined into it in one call.
        self._format = b"%b".join(piece.replace(b"%", b"%%") for piece in pieces)
        self.build = build

    def __call__(self, *values: str | int) -> bytes:
        if len(values) == 1:  # one field: two concatenations beat building the format's tuple
            pieces = self._pieces
            return pieces[0] + dumps(values[0]) + pieces[1]
        return self._format % tuple(map(dumps, values))
