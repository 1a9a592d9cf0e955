"""Formats whose calls are JSON: Hermes/Qwen/Granite/Phi-4-mini (``hermes_json``), Llama 3.x
(``llama3_json``) and Mistral (``mistral``).

A call is ``{"name": ..., "arguments": {...}}`` (``"parameters"`` is accepted for
``"arguments"``, and arguments written as a JSON string are decoded once).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from protocols.parsers.base import JSON, Call, IdFactory, call_from_json, forced_call_schema, make_call, new_call_id
from protocols.parsers.markup import Brackets, Lead, MarkupToolParser, Parsed


def json_calls(text: str) -> list[Call] | None:
    """One or more JSON values, each a call or a list of calls, separated by
    whitespace; ``None`` unless all of the text is calls."""
    found = leading_json_calls(text)
    return found[0] if found is not None and not text[found[1]:].strip() else None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def leading_json_calls(text: str) -> tuple[list[Call], int] | None:
    """The calls written as JSON values (each a call or a list of calls) at the start of
    ``text`` and where they end; ``None`` unless there is at least one and all are calls."""
    calls: list[Call] = []
    pos = end = _skip_space(text, 0)
    while text.startswith(("{", "["), pos):
        try:
            value, pos = JSON.raw_decode(text, pos)
        except ValueError:
            return None
        for item in value if isinstance(value, list) else [value]:
            call = call_from_json(item)
            if call is None:
                return None
            calls.append(call)
        end, pos = pos, _skip_space(text, pos)
    return (calls, end) if calls else None


class HermesJsonParser(MarkupToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number, with text
    around them (Hermes, Qwen 2.5/3, Granite 4, many fine-tunes). An unclosed block at the
    end of output is a call if its JSON is complete; a truncated one is content.

    The markers are options, for formats that differ only in them: Granite 3.x writes
    ``<|tool_call|>[{...}, ...]`` and Phi-4-mini ``functools[{...}, ...]``, with no closing
    marker (``end = ""``): the JSON then runs as far as it parses, and text after it is
    content. A ``start`` ending in ``[`` or ``{`` opens the JSON itself."""

    blocks = (("<tool_call>", "</tool_call>"),)

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, id_factory: IdFactory = new_call_id,
                 start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        if not start:
            raise ValueError("hermes_json needs a non-empty start marker")
        self.start, self.end = start, end
        super().__init__(tools, id_factory=id_factory)

    def markers(self) -> tuple[tuple[str, str | None], ...]:
        return ((self.start, self.end or None),)

    @classmethod
    def forced_call_grammars(cls, tools: Mapping[str, Mapping[str, Any]], **options: Any) -> tuple[str, ...]:
        call = json.dumps(forced_call_schema(tools))
        start, end = options.get("start", "<tool_call>"), options.get("end", "</tool_call>")
        if (start, end) != ("<tool_call>", "</tool_call>"):
            close = end or {"[": "]", "{": "}"}.get(start[-1:], "")
            rule = " ".join([json.dumps(start), "call", *([json.dumps(close)] if close else [])])
            return (f"start: {rule}\ncall: %json {call}",)
        # The markers as the vocabulary's own tokens (Qwen, Hermes), else as text.
        return (f'start: <tool_call> "\\n" call "\\n" </tool_call>\ncall: %json {call}',
                f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {call}')

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        if self.end:
            calls = json_calls(body)
            return Parsed(tuple(calls)) if calls else None
        if opener[-1] in "[{":
            body = opener[-1] + body
        found = leading_json_calls(body)
        if found is None:
            return None
        calls, end = found
        return Parsed(tuple(calls), body[end:])


class _Llama3Lead(Lead):
    """The whole output is ``[<|python_tag|>] {call} [; {call}]...``."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.pos = -1  # next character to scan; -1 until the start is known
        self.state: Literal["expect", "group", "separator"] = "expect"
        self.group_start = 0
        self.brackets = Brackets('"')
        self.calls: list[Call] = []

    def scan(self, text: str, final: bool) -> Literal["hold", "content"] | list[Call]:
        if self.pos < 0:
            start = len(text) - len(text.lstrip())
            head = text[start:]
            if head.startswith(self.TAG):
                self.pos = start + len(self.TAG)
            elif head.startswith("{"):
                self.pos = start
            elif not final and self.TAG.startswith(head):
                return "hold"
            else:
                return "content"
        while self.pos < len(text):
            ch = text[self.pos]
            if self.state == "group":
                if self.brackets.step(ch):
                    call = _one_call(text[self.group_start : self.pos + 1])
                    if call is None:
                        return "content"
                    self.calls.append(call)
                    self.state = "separator"
            elif ch == "{":
                self.state, self.group_start, self.brackets = "group", self.pos, Brackets('"')
                self.brackets.step(ch)
            elif ch == ";" and self.state == "separator":
                self.state = "expect"
            elif not ch.isspace():
                return "content"
            self.pos += 1
        if not final:
            return "hold"
        return self.calls if self.calls and self.state != "group" else "content"


def _one_call(text: str) -> Call | None:
    try:
        value = JSON.decode(text)
    except ValueError:
        return None
    return call_from_json(value)


class Llama3JsonParser(MarkupToolParser):
    """Llama 3.1/3.2/3.3 JSON calls: the whole output (after whitespace) is
    ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``, several
    separated by ``;``. Anything else — text before or after, JSON that is not a call —
    makes the whole output content. Output that cannot be a call stream at once; output
    that could be is held to the end."""

    def make_lead(self) -> Lead | None:
        return _Llama3Lead()

    @classmethod
    def forced_call_grammars(cls, tools: Mapping[str, Mapping[str, Any]], **options: Any) -> tuple[str, ...]:
        return (f"start: call\ncall: %json {json.dumps(forced_call_schema(tools, 'parameters'))}",)

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        return None  # no markup blocks


_HEADER = re.compile(r"\s*([\w.\-:/]+)\s*(?:\[CALL_ID\]\s*(\w+)\s*)?(?:\[ARGS\])?\s*")


class MistralParser(MarkupToolParser):
    """Mistral: ``[TOOL_CALLS]`` then either a JSON list ``[{"name", "arguments"}, ...]``
    (tokenizers before v11) or ``name{json}`` / ``name[ARGS]{json}`` (v11 and later),
    repeated with one ``[TOOL_CALLS]`` per call. There is no closing marker: a block
    runs to the next ``[TOOL_CALLS]`` or to the end of output, so calls are emitted when
    the next one starts or the output ends. Text after a call's JSON is content."""

    blocks = (("[TOOL_CALLS]", None),)

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        start = _skip_space(body, 0)
        if body.startswith("[", start) or body.startswith("{", start):
            try:
                value, end = JSON.raw_decode(body, start)
            except ValueError:
                return None
            items = value if isinstance(value, list) else [value]
            calls = [call_from_json(item) for item in items]
            if not calls or any(c is None for c in calls):
                return None
            return Parsed(tuple(c for c in calls if c is not None), body[end:])
        header = _HEADER.match(body)
        if header is None or not body.startswith("{", header.end()):
            return None
        try:
            arguments, end = JSON.raw_decode(body, header.end())
        except ValueError:
            return None
        call = make_call(header.group(1), arguments)
        return Parsed((call,), body[end:]) if call is not None else None
