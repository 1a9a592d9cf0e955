"""Reasoning parsers: split a model's thinking from its answer.

``think_tag`` handles ``<think>…</think>`` (Qwen3, DeepSeek-R1, GLM, MiniMax, …) and,
with other tags, the same shape elsewhere (``gemma4``: ``<|channel>thought…<channel|>``).

- Text before the opening tag is content; the first tagged block is reasoning; text
  after it is content and is not scanned for tags again (one block per response).
- ``starts_inside=True`` is for templates that open the block in the prompt (DeepSeek-R1,
  Qwen3 thinking-only models): output starts as reasoning, and a repeated opening tag
  at its very start is dropped. A family must not set it when thinking was turned off
  (Qwen3's template then pre-fills an empty block and the output is all answer).
- Thinking cut off by the end of output stays reasoning.
- Whitespace next to the tags is layout: dropped after the opening tag, before the
  closing tag, and between the closing tag and the answer.
"""

from __future__ import annotations

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

    def __init__(self, *, starts_inside: bool = False, start: str = "<think>", end: str = "</think>") -> None:
        if not start or not end:
            raise ValueError("think_tag needs non-empty start and end tags")
        self.start, self.end = start, end
        self.starts_inside = starts_inside
        self._state = _OPENING if starts_inside else _BEFORE
        self._buf = ""

    def _run(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            if self._state == _DONE:
                if self._buf:
                    out.append(TextDelta(self._buf))
                self._buf = ""
                return out
            if self._state == _BEFORE:
                at = self._buf.find(self.start)
                if at == -1:
                    keep = 0 if final else held_suffix(self._buf, (self.start,))
                    self._release(out, TextDelta, len(self._buf) - keep)
                    return out
                _add(out, TextDelta(self._buf[:at].rstrip()))
                self._buf = self._buf[at + len(self.start) :]
                self._state = _OPENING
            if self._state in (_OPENING, _AFTER):
                self._buf = self._buf.lstrip()
                if self._state == _AFTER:
                    self._state = _DONE if self._buf else _AFTER
                    if not self._buf:
                        return out
                    continue
                if self.starts_inside and self._buf.startswith(self.start):
                    self._buf = self._buf[len(self.start) :]
                    continue  # a repeated opening tag: drop it, and the space after it
                if not self._buf or (self.starts_inside and self.start.startswith(self._buf)):
                    if not final:
                        return out  # not yet known whether the output repeats the tag
                self._state = _INSIDE
            # inside the block
            at = self._buf.find(self.end)
            if at == -1:
                if final:
                    _add(out, ReasoningDelta(self._buf.rstrip()))
                    self._buf = ""
                    return out
                self._release(out, ReasoningDelta, len(self._buf) - held_suffix(self._buf, (self.end,)))
                return out
            _add(out, ReasoningDelta(self._buf[:at].rstrip()))
            self._buf = self._buf[at + len(self.end) :]
            self._state = _AFTER

    def _release(self, out: list[Event], kind: type[TextDelta] | type[ReasoningDelta], cut: int) -> None:
        _add(out, kind(self._buf[:cut]))
        self._buf = self._buf[cut:]


def _add(out: list[Event], event: TextDelta | ReasoningDelta) -> None:
    if event.text:
        out.append(event)


class Gemma4ReasoningParser(ThinkTagParser):
    """Gemma 4's thinking channel, ``<|channel>thought\\n…<channel|>`` (as vLLM's
    ``gemma4_reasoning_parser.py`` and mlx-lm read it)."""

    def __init__(self, *, starts_inside: bool = False) -> None:
        super().__init__(starts_inside=starts_inside, start="<|channel>thought", end="<channel|>")
