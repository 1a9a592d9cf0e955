"""One error type for every protocol.

Stages raise :class:`ApiError` with a protocol-neutral ``kind``; each protocol's
encoder maps the kind to its own wire shape and status code. The HTTP status is
decided here, once, so that all protocols agree on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ErrorKind = Literal[
    "invalid_request",
    "context_length_exceeded",
    "authentication",
    "permission",
    "not_found",
    "conflict",
    "method_not_allowed",
    "request_too_large",
    "rate_limit",
    "unsupported_media_type",
    "overloaded",
    "unavailable",
    "internal",
]

STATUS: dict[ErrorKind, int] = {
    "invalid_request": 400,
    "context_length_exceeded": 400,
    "authentication": 401,
    "permission": 403,
    "not_found": 404,
    "conflict": 409,  # the resource exists already (an agent id), or is busy (an agent answering a turn)
    "method_not_allowed": 405,
    "request_too_large": 413,
    "unsupported_media_type": 415,
    "rate_limit": 429,
    "overloaded": 503,
    # A part of the server cannot serve now, and retrying will not help until someone acts (a damaged store).
    "unavailable": 503,
    "internal": 500,
}


@dataclass
class ApiError(Exception):
    """An error meant for the client, in protocol-neutral terms."""

    kind: ErrorKind
    message: str
    param: str | None = None
    code: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __reduce__(self) -> tuple[type[ApiError], tuple[object, ...]]:
        # Pickled by its fields (an error raised in a worker process comes back as itself).
        return type(self), (self.kind, self.message, self.param, self.code, self.retry_after)

    @property
    def status(self) -> int:
        return STATUS[self.kind]

    @property
    def retryable(self) -> bool:
        return self.kind in ("rate_limit", "overloaded")
