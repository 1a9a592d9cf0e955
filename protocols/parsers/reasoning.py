"""Reasoning parsers: split a model's thinking from its answer.

``think_tag`` handles ``<think>…</think>`` (Qwen3, DeepSeek-R1, GLM, MiniMax, …) and,
with other tags, the same shape elsewhere (``gemma4``: ``<|channel>thought…<channel|>``).

- Text before the opening tag is content; the first tagged block is reasoning; text
  after it is content and is not scanned for tags again (one block per response),
  unless ``interleaved=True``: models that think again between calls (MiniMax M2) write
  several blocks in one answer, and every one of them is reasoning.
- A tag may have several spellings (``start``/``end`` given as lists): ``granite`` is the
  same machine over Granite 3.2's phrases, "Here is my thought process:" … "Here is my
  response:" (and the "Here's" that quantized models write, as vLLM's parser accepts), and
  Granite 3.3's ``<think>`` tags, whose ``<response>`` wrapper around the reply it drops.
- ``starts_inside=True`` is for templates that open the block in the prompt (DeepSeek-R1,
  Qwen3 thinking-only models): output starts as reasoning, and a repeated opening tag
  at its very start is dropped. A family must not set it when thinking was turned off
  (Qwen3's template then pre-fills an empty block and the output is all answer).
- Thinking cut off by the end of output stays reasoning.
- Whitespace next to the tags is layout: dropped after the opening tag, before the
  closing tag, and between the closing tag and the answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from protocols.ir import ReasoningDelta, TextDelta
from protocols.parsers.base import BufferedParser, Event, StreamParser, held_suffix

_BEFORE, _OPENING, _INSIDE, _AFTER, _DONE = "before", "opening", "inside", "after", "done"


class NullReasoningParser(StreamParser):
    """No reasoning: everything is content."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []


class ThinkTagParser(BufferedParser):
    """See the module docstring."""

    def __init__(self, *, starts_inside: bool = False, start: str | Sequence[str] = "<think>",
                 end: str | Sequence[str] = "</think>", interleaved: bool = False) -> None:
        self.starts = (start,) if isinstance(start, str) else tuple(start)
        self.ends = (end,) if isinstance(end, str) else tuple(end)
        if not self.starts or not self.ends or not all(self.starts) or not all(self.ends):
            raise ValueError("think_tag needs non-empty start and end tags")
        self.starts_inside = starts_inside
        self.interleaved = interleaved
        self._state = _OPENING if starts_inside else _BEFORE
        self._buf = ""
        self._firsts = {_BEFORE: frozenset(t[0] for t in self.starts), _INSIDE: frozenset(t[0] for t in self.ends)}

    def feed(self, text: str) -> list[Event]:
        # Per token, the usual case, without the buffer: nothing is held, no tag can begin in the text, and it
        # does not end in whitespace (held as layout next to a tag): it all goes out as _run would send it.
        if not self._buf and text:
            state = self._state
            if state == _DONE:
                return [TextDelta(text)]
            firsts = self._firsts.get(state)
            if firsts is not None and not text[-1].isspace() and firsts.isdisjoint(text):
                return [TextDelta(text) if state == _BEFORE else ReasoningDelta(text)]
        return super().feed(text)

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == _DONE:
                if self._buf:
                    out.append(TextDelta(self._buf))
                self._buf = ""
                return out
            if self._state == _BEFORE:
                at, size = _find(self._buf, self.starts)
                if at == -1:
                    keep = 0 if final else held_suffix(self._buf, self.starts)
                    self._release(out, TextDelta, len(self._buf) - keep)
                    return out
                _add(out, TextDelta(self._buf[:at].rstrip()))
                self._buf = self._buf[at + size :]
                self._state = _OPENING
            if self._state in (_OPENING, _AFTER):
                self._buf = self._buf.lstrip()
                if self._state == _AFTER:
                    # Interleaved thinking: the answer may open another block later.
                    self._state = (_BEFORE if self.interleaved else _DONE) if self._buf else _AFTER
                    if not self._buf:
                        return out
                    continue
                repeated = next((t for t in self.starts if self._buf.startswith(t)), None) if self.starts_inside else None
                if repeated is not None:
                    self._buf = self._buf[len(repeated) :]
                    continue  # a repeated opening tag: drop it, and the space after it
                if not self._buf or (self.starts_inside and any(t.startswith(self._buf) for t in self.starts)):
                    if not final:
                        return out  # not yet known whether the output repeats the tag
                self._state = _INSIDE
            # inside the block
            at, size = _find(self._buf, self.ends)
            if at == -1:
                if final:
                    _add(out, ReasoningDelta(self._buf.rstrip()))
                    self._buf = ""
                    return out
                self._release(out, ReasoningDelta, len(self._buf) - held_suffix(self._buf, self.ends))
                return out
            _add(out, ReasoningDelta(self._buf[:at].rstrip()))
            self._buf = self._buf[at + size :]
            self._state = _AFTER

    def _release(self, out: list[Event], kind: type[TextDelta] | type[ReasoningDelta], cut: int) -> None:
        _add(out, kind(self._buf[:cut]))
        self._buf = self._buf[cut:]


def _find(text: str, tags: tuple[str, ...]) -> tuple[int, int]:
    """Where the first of ``tags`` occurs in ``text`` and its length (the longest at a tie); ``(-1, 0)``: none."""
    best, size = -1, 0
    for tag in tags:
        at = text.find(tag)
        if at != -1 and (best == -1 or at < best or (at == best and len(tag) > size)):
            best, size = at, len(tag)
    return best, size


def _add(out: list[Event], event: TextDelta | ReasoningDelta) -> None:
    if event.text:
        out.append(event)


class Gemma4ReasoningParser(ThinkTagParser):
    """Gemma 4's thinking channel, ``<|channel>thought\\n…<channel|>`` (as vLLM's
    ``gemma4_reasoning_parser.py`` and mlx-lm read it)."""

    def __init__(self, *, starts_inside: bool = False) -> None:
        super().__init__(starts_inside=starts_inside, start="<|channel>thought", end="<channel|>")


GRANITE_THOUGHT = ("Here is my thought process:", "Here's my thought process:", "<think>")
GRANITE_RESPONSE = ("Here is my response:", "Here's my response:", "</think>")
_RESPONSE_OPEN, _RESPONSE_CLOSE = "<response>", "</response>"


class GraniteReasoningParser(StreamParser):
    """Granite's thinking, switched by its template's ``thinking``. Granite 3.2 opens its answer with "Here is
    my thought process:" and replies after "Here is my response:" (plain phrases, not tokens: a phrase cut off by
    the end of output stays text, as any held-back prefix does); Granite 3.3 thinks in ``<think>…</think>`` and
    wraps its reply in ``<response>…</response>``, a wrapper that is dropped when it encloses the whole reply."""

    def __init__(self, *, starts_inside: bool = False) -> None:
        self._thinking = ThinkTagParser(starts_inside=starts_inside, start=GRANITE_THOUGHT, end=GRANITE_RESPONSE)
        self._reply = _ResponseWrapper()

    def feed(self, text: str) -> list[Event]:
        return self._reply.run(self._thinking.feed(text), final=False)

    def finish(self) -> list[Event]:
        return self._reply.run(self._thinking.finish(), final=True)


class _ResponseWrapper:
    """Drops ``<response>`` at the very start of the content and, once it was there, ``</response>`` at the
    very end of the output (whitespace around both is layout); anything else is content as written.
    Reasoning passes through; content held back when reasoning comes is not at the end, so it goes first."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start: the wrapper may still open; lead: after it, dropping space; body; plain

    def run(self, events: list[Event], *, final: bool) -> list[Event]:
        if self._state == "plain":
            return events  # no wrapper: content as written (this runs for every token)
        out: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta):
                self._buf += event.text
                self._release(out, final=False)
            else:
                if self._buf:
                    self._release(out, final=False, more=True)
                out.append(event)
        if final:
            self._release(out, final=True)
        return out

    def _release(self, out: list[Event], *, final: bool, more: bool = False) -> None:
        """Emit what is decided; ``more``: other events follow, so the content so far is not the output's end."""
        if self._state == "start":
            head = self._buf.lstrip()
            if not head:  # only layout so far (the reply may come after thinking)
                if final or more:
                    _add(out, TextDelta(self._buf))
                    self._buf = ""
                return
            if head.startswith(_RESPONSE_OPEN):
                self._buf, self._state = head[len(_RESPONSE_OPEN) :], "lead"
            elif _RESPONSE_OPEN.startswith(head) and not (final or more):
                return  # could still be the wrapper
            else:
                self._state = "plain"
        if self._state == "lead":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return
            self._state = "body"
        if self._state == "plain":
            _add(out, TextDelta(self._buf))
            self._buf = ""
            return
        if more:  # not the end: all of it is content
            _add(out, TextDelta(self._buf))
            self._buf = ""
            return
        body = self._buf.rstrip()
        if body.endswith(_RESPONSE_CLOSE):  # the closer, if nothing but space follows it to the end
            stem = body[: -len(_RESPONSE_CLOSE)].rstrip()
            if final:
                _add(out, TextDelta(stem))
                self._buf = ""
                return
            keep = len(self._buf) - len(stem)
        else:
            keep = 0 if final else held_suffix(self._buf, (_RESPONSE_CLOSE,))
        cut = len(self._buf) - keep
        _add(out, TextDelta(self._buf[:cut]))
        self._buf = self._buf[cut:]
