"""The contract between a protocol's wire code and the generic format stage.

Every protocol's exit is the same loop (see ``stages/format.py``): read the
:class:`ResponseStarted` header, then either encode each event as it comes
(streaming) or fold the events into a :class:`FinalResult` and encode that
once. What differs per protocol is only the encoding, which a protocol module
provides as a :class:`Codec`: a stream encoder (a small state machine fed
events), the whole-response encoder, and the protocol's error shapes.
"""

from __future__ import annotations

from typing import Any, Protocol

from protocols.errors import ApiError
from protocols.ir import FinalResult, ResponseStarted, StreamEvent, WireFrame


class StreamEncoder(Protocol):
    """Turns one response's events into SSE bytes; one instance per response."""

    def start(self) -> list[bytes]:
        """Frames sent as soon as the prompt is accepted (before any token)."""
        ...

    def encode(self, event: StreamEvent) -> list[bytes]:
        """Frames for one event (possibly none)."""
        ...

    def keepalive(self) -> list[bytes]:
        """Frames that keep an idle stream open during a long prefill; ignored by clients."""
        ...


class Codec(Protocol):
    """A protocol's encoders and error shapes (a class whose static methods implement these)."""

    def stream_encoder(self, started: ResponseStarted, /) -> StreamEncoder: ...

    def encode_final(self, result: FinalResult, /) -> dict[str, Any]: ...

    def error_status(self, error: ApiError, /) -> int: ...

    def error_body(self, error: ApiError, /) -> bytes: ...

    def error_frames(self, error: ApiError, /) -> list[bytes]: ...


JSON_HEADERS = (("content-type", "application/json"),)


def error_headers(error: ApiError) -> tuple[tuple[str, str], ...]:
    headers = list(JSON_HEADERS)
    if error.retry_after is not None:
        headers.append(("retry-after", str(max(1, round(error.retry_after)))))
    # Anthropic's and OpenAI's SDKs both honour this: no pointless retries of a bad request.
    headers.append(("x-should-retry", "true" if error.retryable else "false"))
    return tuple(headers)


def error_response(codec: Codec, error: ApiError) -> WireFrame:
    """A whole error response in the protocol's shape."""
    return WireFrame(codec.error_body(error), status=codec.error_status(error), headers=error_headers(error))


def error_stream_end(codec: Codec, error: ApiError) -> WireFrame:
    """The frames that end a stream that failed after it began, as one frame."""
    return WireFrame(b"".join(codec.error_frames(error)))


SSE_COMMENT_KEEPALIVE = b": keepalive\n\n"  # SSE comment lines are skipped by every client parser
