"""Stop strings matched on text, with hold-back.

:class:`StopMatcher` is fed decoded text as it arrives and returns only text
that can no longer be part of a stop string: any tail that is a prefix of some
stop string is held back until the next feed decides it. So no part of a stop
string ever reaches a client, even when it is split across tokens or chunks.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit. After a match, ``matched`` is set
        and the returned text ends right before the stop string."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        cut, found = len(buffer), None
        for stop in self.stops:
            at = buffer.find(stop)
            if at != -1 and at < cut:
                cut, found = at, stop
        if found is not None:
            self.matched = found
            self._held = ""
            return buffer[:cut]
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), keep, -1):
                if buffer.endswith(stop[:n]):
                    keep = n
                    break
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The stream ended without a match: release what was held back."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""
