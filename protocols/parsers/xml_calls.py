"""Formats that write each argument in its own tags, values as bare text: the
``<function>``/``<parameter>`` family (``xml_calls``, alias ``qwen3_coder``: Qwen3-Coder,
Qwen3.5, Qwen3-Next, Seed-OSS, MiniMax M2, MiniCPM 5, by their markers) and GLM
4.5/4.6/4.7 (``glm4``). Values are typed with the request's JSON schema
(:mod:`protocols.parsers.schema`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from protocols.parsers.base import Call, IdFactory, make_call, new_call_id
from protocols.parsers.json_calls import json_calls
from protocols.parsers.markup import MarkupToolParser, Parsed
from protocols.parsers.schema import convert

_CDATA = re.compile(r"\s*<!\[CDATA\[(.*)\]\]>\s*", re.DOTALL)


def _unquote(name: str) -> str:
    name = name.strip()
    return name[1:-1] if len(name) > 1 and name[0] == name[-1] and name[0] in "\"'" else name


class XmlCallParser(MarkupToolParser):
    """A function element holding one element per argument, values as bare text. The
    markers are options, so one parser reads the whole family of formats:

    - Qwen3-Coder, Qwen3.5, Qwen3-Next (the defaults): ``<tool_call><function=NAME>
      <parameter=K>\\nV\\n</parameter>...</function></tool_call>``;
    - Seed-OSS: the same in ``<seed:tool_call>…</seed:tool_call>``;
    - MiniMax M2: ``<minimax:tool_call><invoke name="NAME"><parameter name="K">V</parameter>
      …</invoke></minimax:tool_call>``;
    - MiniCPM 5: ``<function name="NAME"><param name="K">V</param></function>``, no wrapper,
      values with ``<``, ``&`` or newlines in ``<![CDATA[…]]>``.

    ``wrapper`` is ``[open, close]`` (empty: none), ``function`` and ``parameter`` are
    ``[open, end of open tag, close]``. Names may be quoted. A CDATA value is taken
    exactly; otherwise one leading and one trailing newline are layout. Values are typed
    by the schema (text when the parameter is not declared). Several functions may share
    one wrapper, and a function without the wrapper is accepted too. An unclosed block at
    the end of output is a call if its function's close tag was written."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] = (), *, id_factory: IdFactory = new_call_id,
                 wrapper: Sequence[str] = ("<tool_call>", "</tool_call>"),
                 function: Sequence[str] = ("<function=", ">", "</function>"),
                 parameter: Sequence[str] = ("<parameter=", ">", "</parameter>")) -> None:
        if len(wrapper) not in (0, 2) or len(function) != 3 or len(parameter) != 3 or not all(
                [*wrapper, *function, *parameter]):
            raise ValueError("xml calls: wrapper is [open, close] or [], function and parameter are "
                             "[open, end of open tag, close], all non-empty")
        self.wrapper, self.function, self.parameter = tuple(wrapper), tuple(function), tuple(parameter)
        self._head = re.compile(r"\s*" + re.escape(function[0]) + r"([^\n]*?)" + re.escape(function[1]))
        self._param = re.compile(r"\s*" + re.escape(parameter[0]) + r"([^\n]*?)" + re.escape(parameter[1]))
        super().__init__(tools, id_factory=id_factory)

    def markers(self) -> tuple[tuple[str, str | None], ...]:
        bare = ((self.function[0], self.function[2]),)
        return ((self.wrapper[0], self.wrapper[1]), *bare) if self.wrapper else bare

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        if opener == self.function[0]:
            body = opener + body + (self.function[2] if closed else "")
        calls: list[Call] = []
        pos = 0
        while body[pos:].strip():
            call, pos = self._function(body, pos, closed)
            if call is None:
                return None
            calls.append(call)
        return Parsed(tuple(calls)) if calls else None

    def _function(self, body: str, pos: int, closed: bool) -> tuple[Call | None, int]:
        head = self._head.match(body, pos)
        if head is None:
            return None, pos
        name = _unquote(head.group(1))
        close = self.function[2]
        end = body.find(close, head.end())
        if end == -1 and not closed:
            return None, pos  # truncated: not complete enough
        inner = body[head.end() : end if end != -1 else len(body)]
        after = end + len(close) if end != -1 else len(body)
        arguments: dict[str, Any] = {}
        at = 0
        while inner[at:].strip():
            param = self._param.match(inner, at)
            if param is None:
                return None, pos
            key = _unquote(param.group(1))
            stop = inner.find(self.parameter[2], param.end())
            following = self._param.search(inner, param.end())
            if stop == -1 or (following is not None and following.start() < stop):
                # A missing close tag: the value runs to the next parameter or the end.
                stop = following.start() if following is not None else len(inner)
                at = stop
            else:
                at = stop + len(self.parameter[2])
            arguments[key] = self._value(inner[param.end() : stop], name, key)
        return make_call(name, arguments), after

    def _value(self, raw: str, tool: str, key: str) -> Any:
        cdata = _CDATA.fullmatch(raw)
        if cdata is not None:
            raw = cdata.group(1)
        else:
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
        return convert(raw, self.property_schema(tool, key))


Qwen3CoderParser = XmlCallParser  # the defaults are Qwen3-Coder's markers


_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm4Parser(MarkupToolParser):
    """``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>``
    (GLM-4.5/4.6/4.7; the newlines are optional). Values declared as strings are kept
    exactly; others are typed by the schema, and undeclared ones are taken as JSON when
    they are JSON. A JSON object body (which GLM sometimes writes) is accepted too. An
    unclosed block is a call at the end of output only if it has a complete argument
    and no tag left open."""

    blocks = (("<tool_call>", "</tool_call>"),)

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        if body.lstrip().startswith("{"):
            calls = json_calls(body)
            return Parsed(tuple(calls)) if calls else None
        first = body.find("<arg_key>")
        name = (body if first == -1 else body[:first]).strip()
        arguments: dict[str, Any] = {}
        pos = len(body) if first == -1 else first
        for match in _ARG.finditer(body, pos):
            if body[pos : match.start()].strip():
                return None  # stray text between arguments: not this format
            key = match.group(1).strip()
            schema = self.property_schema(name, key)
            arguments[key] = convert(match.group(2), schema, untyped="json")
            pos = match.end()
        if body[pos:].strip():
            return None  # an open or malformed tag
        if not closed and not arguments:
            return None  # a bare name cut off by the end of output: not complete enough
        call = make_call(name, arguments)
        return Parsed((call,)) if call is not None and "<" not in name else None
