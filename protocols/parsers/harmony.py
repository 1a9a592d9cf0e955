"""gpt-oss's harmony format (``harmony``): reasoning, content and calls as channels.

A gpt-oss answer is a run of messages, each a header and a body::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

    <|channel|>final<|message|>It is sunny.<|return|>

(the prompt ends with ``<|start|>assistant``, so the first header starts without it).
The header names the channel and, for a call, the recipient (``to=functions.NAME``,
after the channel or right after the role); the body runs to ``<|end|>``, ``<|call|>`` or
``<|return|>`` — the last two are stop tokens, so the output usually just ends.

Theory of operation
-------------------
Three states over one buffer:

``outside``
    Between messages. Text here is content (a model that forgets its channels), released
    as it comes except a tail that could begin ``<|start|>`` or ``<|channel|>``; whitespace
    between messages is layout. At the very start of output a header may also begin with
    ``to=`` (the recipient right after the prompt's role).
``header``
    Held until ``<|message|>``. A header that does not reach it within
    :data:`HEADER_LIMIT` characters (or by the end of output) is not one: its first marker
    is released as content and the rest is read again.
``body``
    ``analysis`` is reasoning; ``final``, ``commentary`` and anything else without a
    recipient is content; both stream, holding back only what could begin a terminator
    (or a ``<|start|>``/``<|channel|>`` written without one). A body with a recipient is a
    call: held to its end, its JSON arguments make a call to ``NAME`` (``functions.``
    dropped). Arguments that are not a JSON object — or calls when the parser was made
    without them (a request without tools) — are released as content, exactly as written.

Every decision depends only on the text so far, so streaming and whole-text agree. The
one parser serves as both the family's tool and reasoning parser (see
:func:`protocols.parsers.make_response_parser`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from protocols.ir import ReasoningDelta, TextDelta
from protocols.parsers.base import BufferedParser, Event, IdFactory, ToolParser, held_suffix, make_call, new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
HEADER_LIMIT = 256
"""Headers are a role, a channel, a recipient and a content type: never longer than this."""

_OPENERS = (START, CHANNEL)
_BODY_STOPS = (*TERMINATORS, *_OPENERS)  # an opener ends a body written without its terminator
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([\w.\-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_OUTSIDE, _HEADER, _BODY = "outside", "header", "body"


class HarmonyParser(ToolParser, BufferedParser):
    """See the module docstring. ``calls=False`` leaves calls as content (no tools asked)."""

    reads_reasoning = True

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, id_factory: IdFactory = new_call_id,
                 calls: bool = True) -> None:
        super().__init__(tools, id_factory=id_factory)
        self.calls = calls
        self._buf = ""
        self._state = _OUTSIDE
        self._started = False  # past the start of output (where a header may begin with "to=")
        self._after = False  # right after a message: whitespace is layout
        self._marker = ""  # the marker that opened the current header: released if it is not one
        self._spaces = ""  # whitespace before it
        self._header = ""  # raw text of the current message up to and including <|message|>
        self._kind: type[TextDelta] | type[ReasoningDelta] | None = None  # None: a call body
        self._recipient = ""

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == _OUTSIDE and not self._outside(out, final):
                return out
            if self._state == _HEADER and not self._read_header(out, final):
                return out
            if self._state == _BODY and not self._body(out, final):
                return out

    # -- states; each returns false when it must wait for more text ------------------------

    def _outside(self, out: list[Event], final: bool) -> bool:
        if self._after:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._after = False
        if not self._started:
            head = self._buf.lstrip()
            if not head and not final:
                return False
            if not final and any(m.startswith(head) and m != head for m in ("to=", *_OPENERS)):
                return False  # could still open a header
            self._started = True
            if head.startswith("to="):
                self._spaces = self._buf[: len(self._buf) - len(head)]
                self._buf, self._marker = head, ""
                self._state = _HEADER
                return True
        at, marker = _first(self._buf, _OPENERS)
        if marker is None:
            keep = 0 if final else held_suffix(self._buf, _OPENERS)
            _add(out, TextDelta, self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        before = self._buf[:at]
        _add(out, TextDelta, before.rstrip())
        self._spaces = before[len(before.rstrip()) :]  # layout, unless the header turns out not to be one
        self._buf, self._marker = self._buf[at:], marker
        self._state = _HEADER
        return True

    def _read_header(self, out: list[Event], final: bool) -> bool:
        at = self._buf.find(MESSAGE, 0, HEADER_LIMIT + len(MESSAGE))
        if at == -1:
            if not final and len(self._buf) < HEADER_LIMIT + len(MESSAGE):
                return False
            # Not a header: its marker is content, the rest is read again.
            width = len(self._marker) or 1
            _add(out, TextDelta, self._spaces + self._buf[:width])
            self._spaces = ""
            self._buf = self._buf[width:]
            self._state = _OUTSIDE
            return True
        header = self._buf[:at]
        self._header, self._spaces = self._spaces + self._buf[: at + len(MESSAGE)], ""
        self._buf = self._buf[at + len(MESSAGE) :]
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL_NAME.search(header)
        self._recipient = recipient.group(1) if recipient else ""
        if self._recipient:
            self._kind = None
        else:
            self._kind = ReasoningDelta if channel is not None and channel.group(1) == "analysis" else TextDelta
        self._state = _BODY
        return True

    def _body(self, out: list[Event], final: bool) -> bool:
        if not final and "<" not in self._buf:  # the common case, a token of text: no marker can be near
            if self._kind is not None:
                cut = len(self._buf.rstrip())
                _add(out, self._kind, self._buf[:cut])
                self._buf = self._buf[cut:]
            return False
        at, stop = _first(self._buf, _BODY_STOPS)
        if stop is None and not final:
            if self._kind is not None:  # stream what cannot be the start of a terminator
                cut = len(self._buf) - held_suffix(self._buf, _BODY_STOPS)
                _add(out, self._kind, self._buf[:cut])
                self._buf = self._buf[cut:]
            return False
        body = self._buf if stop is None else self._buf[:at]
        consumed = stop if stop in TERMINATORS else ""
        self._buf = "" if stop is None else self._buf[at + len(consumed) :]
        if self._kind is not None:
            _add(out, self._kind, body)
        else:
            call = make_call(self._recipient.removeprefix("functions."), body) if self.calls else None
            if call is None:
                _add(out, TextDelta, self._header + body + consumed)
            else:
                out += self.emit_calls([call])
        self._state, self._after = _OUTSIDE, True
        return True


def harmony_reasoning() -> HarmonyParser:
    """The parser as a reasoning parser: channels split, calls left as content."""
    return HarmonyParser(calls=False)


def _first(text: str, markers: Sequence[str]) -> tuple[int, str | None]:
    best, found = -1, None
    for marker in markers:
        at = text.find(marker)
        if at != -1 and (best == -1 or at < best):
            best, found = at, marker
    return best, found


def _add(out: list[Event], kind: type[TextDelta] | type[ReasoningDelta], text: str) -> None:
    if text:
        out.append(kind(text))
