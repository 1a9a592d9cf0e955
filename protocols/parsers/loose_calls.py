"""Loose tool calls: a right call written without the family's markup.

Small and quantized models often answer a tool request with the right call but
not in their family's format: a bare JSON object ``{"name": …, "arguments": …}``
(``"parameters"`` for ``"arguments"``, or OpenAI's ``{"type": "function",
"function": {…}}``), a list of such objects, or either inside a fenced code block
(three backticks, then ``json`` or no language). A family with ``loose_calls = true``
wraps its tool parser in :class:`LooseCallParser`, which recovers such calls.

Theory of operation
-------------------
The wrapper reads the *content* the family's parser lets through, so real markup
always wins; once that parser has made a call, the wrapper steps aside.

A *candidate* begins at any ``{``, ``[`` or backtick of the content. A small matcher
(:class:`_Candidate`, with :class:`_JsonValue` for each JSON value) follows it
character by character and gives up as soon as the text from there cannot be a
loose call: a ``{`` whose first key is not a call's key, a ``[`` not followed by an
object, a fence language other than json, a ``"name"`` that is not one of the
request's tools, a JSON value that does not decode to calls, non-space text after
the call. Content streams up to the leftmost live candidate, which is held (with the
whitespace before it); when it gives up, its first character is released and the
search resumes right after it. At the end of output the leftmost candidate that is
complete becomes the calls, and the whitespace around it is dropped as layout.

So the call must be the whole rest of the output and name only declared tools;
anything else comes back as text, exactly as written. Prose without braces,
brackets or backticks is never held, and a JSON answer that is not a call is held
only until its first key (or, for one that looks like a call, until it closes).
Every decision depends on the text seen so far, never on chunk boundaries, so
streaming and whole-text parsing agree.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from typing import Literal, Union

from protocols.ir import TextDelta
from protocols.parsers.base import JSON, Call, Event, ToolParser, call_from_json
from protocols.parsers.markup import Brackets

CALL_KEYS = frozenset({"name", "arguments", "parameters", "function", "type", "id"})
"""The keys a loose call object may have (see :func:`~protocols.parsers.base.call_from_json`)."""

FENCE_LANGUAGES = ("", "json")
"""Languages a fenced call may be tagged with (compared case-insensitively)."""

_CANDIDATE_START = re.compile(r"[{\[`]")
_MORE: Literal["more"] = "more"
_DEAD: Literal["dead"] = "dead"
Verdict = Union[Literal["more", "dead"], list[Call]]
"""What a JSON value says after a character: read on, give up, or (it closed) its calls."""


class _JsonValue:
    """One JSON value of a candidate: a call object, or a list of call objects.

    Checks what it can while the value streams (keys of the call object, its
    ``"name"``, that a list holds objects) and decodes it whole when it closes."""

    def __init__(self, opener: str, start: int, declared: Collection[str]) -> None:
        self.start = start  # where the value begins in the candidate's text
        self.declared = declared
        self.call_depth = 1 if opener == "{" else 2  # bracket depth of the call objects' own keys
        self.brackets = Brackets('"')
        self.expect_key = False  # at call depth, after "{" or ","
        self.string_start = -1  # a key or name string being read at call depth
        self.string_is_key = False
        self.last_key = ""

    def step(self, text: str, at: int) -> Verdict:
        """Advance over ``text[at]``."""
        ch = text[at]
        depth, quoted = self.brackets.depth, self.brackets.quote is not None
        closed = self.brackets.step(ch)
        if closed:
            return self._calls(text[self.start : at + 1])
        if quoted:
            return self._string_read(text, at) if self.brackets.quote is None else _MORE
        if ch.isspace():
            return _MORE
        if depth == 1 and self.call_depth == 2 and ch not in "{,":
            return _DEAD  # a list holds nothing but call objects
        if depth == self.call_depth:
            return self._at_call_depth(ch, at)
        if ch == "{" and self.brackets.depth == self.call_depth:  # this character opened a call object
            self.expect_key = True
        return _MORE

    def _at_call_depth(self, ch: str, at: int) -> Verdict:
        if self.expect_key and ch != '"':
            return _DEAD  # "{}" or "{1": not a call
        if ch == '"':
            self.string_start, self.string_is_key = at, self.expect_key
            self.expect_key = False
        elif ch == ",":
            self.expect_key = True
        return _MORE

    def _string_read(self, text: str, at: int) -> Verdict:
        """A string at call depth closed at ``at``: check it if it is a key or the name."""
        start, self.string_start = self.string_start, -1
        if start < 0:
            return _MORE
        try:
            value = JSON.decode(text[start : at + 1])
        except ValueError:
            return _DEAD
        if self.string_is_key:
            self.last_key = value
            return _MORE if value in CALL_KEYS else _DEAD
        if self.last_key == "name" and value.strip() not in self.declared:
            return _DEAD
        return _MORE

    def _calls(self, text: str) -> Verdict:
        try:
            value = JSON.decode(text)
        except ValueError:
            return _DEAD
        calls = [call_from_json(item) for item in (value if isinstance(value, list) else [value])]
        if not calls or any(call is None or call.name not in self.declared for call in calls):
            return _DEAD
        return [call for call in calls if call is not None]


class _Candidate:
    """Follows a candidate from its first character: can the text from there still be
    (is it, once :attr:`complete`) one or more loose calls and nothing else?

    States name what the next character may be:

    ``start``   the first character: ``{``, ``[`` or a backtick
    ``ticks``   more backticks of an opening fence (three in all), then ``lang``
    ``lang``    the fence's language, then space or the value
    ``fenced``  inside a fence, before its first value
    ``json``    inside a JSON value (:class:`_JsonValue`)
    ``inner``   inside a fence, after a value: space, another value, or the closing fence
    ``closing`` more backticks of the closing fence
    ``after``   after a complete value: space, another value, or the end of output
    """

    def __init__(self, declared: Collection[str]) -> None:
        self.declared = declared
        self.calls: list[Call] = []
        self.state = "start"
        self.fenced = False
        self.ticks = 0
        self.language = ""
        self.value: _JsonValue | None = None
        self.pos = 0  # characters of the candidate's text consumed so far
        self._steps: dict[str, Callable[[str, int], str]] = {
            "start": self._start, "ticks": self._ticks, "lang": self._lang, "fenced": self._fenced,
            "json": self._json, "inner": self._inner, "closing": self._closing, "after": self._after,
        }  # fmt: skip

    @property
    def alive(self) -> bool:
        return self.state != _DEAD

    @property
    def complete(self) -> bool:
        """Whether the text so far, were it the end of output, is calls. A fence the output
        ends in (a closing fence cut off by a stop or the token limit) counts as closed."""
        return self.state in ("after", "inner", "closing")

    def advance(self, text: str) -> None:
        """Consume the rest of ``text``, the candidate's text so far (it only grows)."""
        while self.pos < len(text) and self.state != _DEAD:
            self.state = self._steps[self.state](text, self.pos)
            self.pos += 1

    def _open_value(self, text: str, at: int) -> str:
        if text[at] == "`":
            self.ticks = 1
            return "ticks"
        self.value = _JsonValue(text[at], at, self.declared)
        self.value.step(text, at)
        return "json"

    def _start(self, text: str, at: int) -> str:
        return self._open_value(text, at)

    def _after(self, text: str, at: int) -> str:
        if text[at].isspace():
            return "after"
        return self._open_value(text, at) if text[at] in "{[`" else _DEAD

    def _ticks(self, text: str, at: int) -> str:
        if text[at] != "`":
            return _DEAD
        self.ticks += 1
        if self.ticks < 3:
            return "ticks"
        self.fenced, self.language = True, ""
        return "lang"

    def _lang(self, text: str, at: int) -> str:
        ch = text[at]
        if ch.isalnum():
            self.language += ch.lower()
            return "lang" if any(lang.startswith(self.language) for lang in FENCE_LANGUAGES) else _DEAD
        if self.language not in FENCE_LANGUAGES:
            return _DEAD
        return self._fenced(text, at)

    def _fenced(self, text: str, at: int) -> str:
        if text[at].isspace():
            return "fenced"
        return self._open_value(text, at) if text[at] in "{[" else _DEAD

    def _json(self, text: str, at: int) -> str:
        assert self.value is not None
        verdict = self.value.step(text, at)
        if isinstance(verdict, list):
            self.calls += verdict
            self.value = None
            return "inner" if self.fenced else "after"
        return "json" if verdict == _MORE else _DEAD

    def _inner(self, text: str, at: int) -> str:
        ch = text[at]
        if ch == "`":
            self.ticks = 1
            return "closing"
        if ch.isspace():
            return "inner"
        return self._open_value(text, at) if ch in "{[" else _DEAD

    def _closing(self, text: str, at: int) -> str:
        if text[at] != "`":
            return _DEAD
        self.ticks += 1
        if self.ticks < 3:
            return "closing"
        self.fenced = False
        return "after"


class LooseCallParser(ToolParser):
    """The family's tool parser, plus loose calls to the request's tools (see the module
    docstring). Calls of both kinds share one numbering and the inner parser's ids."""

    def __init__(self, inner: ToolParser) -> None:
        super().__init__()
        self.inner = inner
        self.schemas = inner.schemas
        self._space = ""  # whitespace at the end of the content so far: layout if a call follows
        self._held = ""  # the live candidate's text, from its first character
        self._candidate: _Candidate | None = None
        self._markup_called = False  # the family's own format made a call: loose calls are off

    def emit_calls(self, calls: Iterable[Call]) -> list[Event]:
        return self.inner.emit_calls(calls)

    def feed(self, text: str) -> list[Event]:
        return self._through(self.inner.feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._through(self.inner.finish(), final=True)

    def _through(self, events: list[Event], final: bool) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta) and not self._markup_called:
                self._content(event.text, out)
                continue
            if not self._markup_called:
                self._markup_called = True
                _text(out, self._space + self._held)  # what came before a real call is content
                self._space, self._held, self._candidate = "", "", None
            out.append(event)
        if final and not self._markup_called:
            self._end(out)
        return out

    def _content(self, text: str, out: list[Event]) -> None:
        if self._candidate is None:
            rest: str | None = self._space + text
            self._space = ""
        else:
            self._held += text
            rest = self._follow(out)
        while rest is not None:
            rest = self._scan(rest, out)

    def _scan(self, text: str, out: list[Event]) -> str | None:
        """Release ``text`` up to its first candidate and follow that one; the text to scan
        again if it gave up at once, else ``None``."""
        found = _CANDIDATE_START.search(text)
        head = text if found is None else text[: found.start()]
        body = head.rstrip()
        _text(out, body)
        self._space = head[len(body) :]
        if found is None:
            return None
        self._held, self._candidate = text[found.start() :], _Candidate(self.schemas)
        return self._follow(out)

    def _follow(self, out: list[Event]) -> str | None:
        """Advance the candidate over the held text; when it gives up, release its first
        character and return the rest to scan again."""
        assert self._candidate is not None
        self._candidate.advance(self._held)
        return None if self._candidate.alive else self._give_up(out)

    def _give_up(self, out: list[Event]) -> str:
        _text(out, self._space + self._held[:1])
        rest = self._held[1:]
        self._space, self._held, self._candidate = "", "", None
        return rest

    def _end(self, out: list[Event]) -> None:
        """End of output: the leftmost complete candidate is the calls; the rest is text."""
        while self._candidate is not None:
            if self._candidate.complete:
                out += self.emit_calls(self._candidate.calls)
                self._space, self._held, self._candidate = "", "", None
                return
            rest: str | None = self._give_up(out)
            while rest is not None:
                rest = self._scan(rest, out)
        _text(out, self._space)
        self._space = ""


def _text(out: list[Event], text: str) -> None:
    """Append content, merged into the text just before it (one delta per feed, not one per
    candidate given up)."""
    if not text:
        return
    if out and isinstance(out[-1], TextDelta):
        out[-1] = TextDelta(out[-1].text + text)
    else:
        out.append(TextDelta(text))
