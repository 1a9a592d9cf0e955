"""Calls in a section of special tokens, each a header and JSON arguments
(``sectioned_json``): DeepSeek V3 / V3.1 / R1 and Kimi K2. One parser, the markers
are options::

    DeepSeek V3, R1:  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
                      ```json
                      {"city": "Paris"}
                      ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
    DeepSeek V3.1:    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
                      <｜tool▁calls▁end｜>
    Kimi K2:          <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>
                      {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

A section holds one or more calls (whitespace between them is layout). In each, the
text before the separator is the header, after it the arguments: a JSON object, or —
V3's layout, when the header is the call type ``function`` — the name on its own line
and the object in a fenced ``json`` block. Kimi's header is the call's id,
``functions.NAME:INDEX``: with ``model_ids`` the call keeps it as its id, unchanged, since
Kimi's template numbers calls across the conversation and expects its own ids back.
An unclosed section at the end of output is calls if every call in it was closed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from protocols.parsers.base import Call, IdFactory, decode_arguments, make_call, new_call_id
from protocols.parsers.markup import MarkupToolParser, Parsed

_FENCED = re.compile(r"\s*([^\n`]+?)\s*\n\s*```(?:json)?\s*\n(.*?)\n?\s*```\s*", re.DOTALL)
_KIMI_ID = re.compile(r"(?:functions\.)?([\w.\-]+):\d+")


SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALL = ("<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>")
SEPARATOR = "<｜tool▁sep｜>"
"""DeepSeek's markers, the defaults."""


class SectionedJsonParser(MarkupToolParser):
    """See the module docstring; the defaults are DeepSeek's markers."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, id_factory: IdFactory = new_call_id,
                 section: Sequence[str] = SECTION, call: Sequence[str] = CALL, separator: str = SEPARATOR,
                 model_ids: bool = False) -> None:
        if len(section) != 2 or len(call) != 2 or not all([*section, *call, separator]):
            raise ValueError("sectioned_json: section and call are [begin, end], separator is non-empty")
        self.section, self.call, self.separator = tuple(section), tuple(call), separator
        self.model_ids = model_ids
        super().__init__(tools, id_factory=id_factory)

    def markers(self) -> tuple[tuple[str, str | None], ...]:
        return ((self.section[0], self.section[1]),)

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        begin, end = self.call
        calls: list[Call] = []
        pos = 0
        while body[pos:].strip():
            start = body.find(begin, pos)
            if start == -1 or body[pos:start].strip():
                return None
            stop = body.find(end, start)
            if stop == -1:
                return None  # a call cut off (closed or not, the section is not calls)
            call = self._call(body[start + len(begin) : stop])
            if call is None:
                return None
            calls.append(call)
            pos = stop + len(end)
        return Parsed(tuple(calls)) if calls else None

    def _call(self, text: str) -> Call | None:
        head, sep, tail = text.partition(self.separator)
        if not sep:
            return None
        head = head.strip()
        fenced = _FENCED.fullmatch(tail) if head == "function" else None
        if fenced is not None:
            name, arguments = fenced.group(1), fenced.group(2)
        else:
            name, arguments = head, tail.strip()
        if decode_arguments(arguments) is None:
            return None  # arguments must be JSON (decode_arguments also takes "" as {})
        kimi = _KIMI_ID.fullmatch(name) if self.model_ids else None
        call = make_call(kimi.group(1) if kimi else name, arguments)
        return replace(call, id=name) if call is not None and kimi is not None else call
