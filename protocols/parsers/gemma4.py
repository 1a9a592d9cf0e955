"""Gemma 4's native calls (``gemma4``)::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{metric:true}}<tool_call|>

Keys are bare, strings are delimited by the ``<|"|>`` token, numbers, ``true``,
``false`` and ``null`` are bare, objects ``{k:v,...}`` and arrays ``[v,...]`` nest.
Several calls follow each other, each in its own block (several ``call:`` in one block
are accepted too). The format is established from vLLM's ``gemma4_tool_parser.py``
and mlx-lm's ``tool_parsers/gemma4.py``, which agree on it.
"""

from __future__ import annotations

import re
from typing import Any

from protocols.parsers.base import JSON, Call, make_call
from protocols.parsers.markup import MarkupToolParser, Parsed

QUOTE = '<|"|>'
_NAME = re.compile(r"\s*call:([\w.\-]+)")


class _Malformed(Exception):
    pass


class _Reader:
    """Recursive descent over one call's argument text."""

    def __init__(self, text: str, pos: int) -> None:
        self.text, self.pos = text, pos

    def space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def expect(self, ch: str) -> None:
        self.space()
        if not self.text.startswith(ch, self.pos):
            raise _Malformed(f"expected {ch!r} at {self.pos}")
        self.pos += len(ch)

    def string(self) -> str:
        self.expect(QUOTE)
        end = self.text.find(QUOTE, self.pos)
        if end == -1:
            raise _Malformed("unterminated string")
        value, self.pos = self.text[self.pos : end], end + len(QUOTE)
        return value

    def value(self) -> Any:
        self.space()
        if self.text.startswith(QUOTE, self.pos):
            return self.string()
        if self.text.startswith("{", self.pos):
            return self.object()
        if self.text.startswith("[", self.pos):
            return self.array()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}]":
            self.pos += 1
        return _bare(self.text[start : self.pos].strip())

    def object(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        self.space()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            self.space()
            if self.text.startswith(QUOTE, self.pos):
                key = self.string()
                self.expect(":")
            else:
                colon = self.text.find(":", self.pos)
                key = self.text[self.pos : colon].strip() if colon != -1 else ""
                if not key or any(c in key for c in "{}[],<>") or any(c.isspace() for c in key):
                    raise _Malformed("bad key")
                self.pos = colon + 1
            out[key] = self.value()
            if self._close("}"):
                return out

    def array(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        self.space()
        if self.text.startswith("]", self.pos):
            self.pos += 1
            return out
        while True:
            out.append(self.value())
            if self._close("]"):
                return out

    def _close(self, closer: str) -> bool:
        self.space()
        if self.text.startswith(",", self.pos):
            self.pos += 1
            return False
        self.expect(closer)
        return True


def _bare(token: str) -> Any:
    if not token:
        raise _Malformed("empty value")
    if token in ("true", "false", "null"):
        return {"true": True, "false": False, "null": None}[token]
    try:
        value = JSON.decode(token)
    except ValueError:
        return token  # an unquoted word: keep it as text
    return value if isinstance(value, (int, float)) else token


def gemma4_calls(body: str) -> list[Call] | None:
    calls: list[Call] = []
    pos = 0
    while body[pos:].strip():
        head = _NAME.match(body, pos)
        if head is None:
            return None
        reader = _Reader(body, head.end())
        try:
            arguments = reader.object()
        except _Malformed:
            return None
        call = make_call(head.group(1), arguments)
        if call is None:
            return None
        calls.append(call)
        pos = reader.pos
    return calls or None


class Gemma4Parser(MarkupToolParser):
    """See the module docstring. An unclosed block at the end of output is a call if
    its argument object is complete."""

    blocks = (("<|tool_call>", "<tool_call|>"),)

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        calls = gemma4_calls(body)
        return Parsed(tuple(calls)) if calls else None
