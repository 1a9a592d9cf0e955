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
from protocols.ir import FinalResult, ResponseStarted, StreamEvent


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
    """A protocol's encoders and error shapes."""

    @staticmethod
    def stream_encoder(started: ResponseStarted) -> StreamEncoder: ...

    @staticmethod
    def encode_final(result: FinalResult) -> dict[str, Any]: ...

    @staticmethod
    def error_status(error: ApiError) -> int: ...

    @staticmethod
    def error_body(error: ApiError) -> bytes: ...

    @staticmethod
    def error_frames(error: ApiError) -> list[bytes]: ...


SSE_COMMENT_KEEPALIVE = b": keepalive\n\n"  # SSE comment lines are skipped by every client parser
