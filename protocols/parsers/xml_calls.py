"""Formats that write each argument in its own tags, values as bare text: Qwen3-Coder
(``qwen3_coder``) and GLM 4.5/4.6/4.7 (``glm4``). Values are typed with the request's
JSON schema (:mod:`protocols.parsers.schema`)."""

from __future__ import annotations

import re
from typing import Any

from protocols.parsers.base import Call, make_call
from protocols.parsers.json_calls import json_calls
from protocols.parsers.markup import MarkupToolParser, Parsed
from protocols.parsers.schema import convert

_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>")
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]*)>")


class Qwen3CoderParser(MarkupToolParser):
    """``<tool_call><function=NAME><parameter=K>\\nV\\n</parameter>...</function></tool_call>``
    (Qwen3-Coder, Qwen3.5). One leading and one trailing newline of a value are layout
    and are stripped; the value is then typed by the schema (text when the parameter is
    not declared). A block without the ``<tool_call>`` wrapper is accepted too. An
    unclosed block at the end of output is a call if its ``</function>`` was written."""

    blocks = (("<tool_call>", "</tool_call>"), ("<function=", "</function>"))

    def parse_block(self, opener: str, body: str, closed: bool) -> Parsed | None:
        if opener == "<function=":
            body = opener + body + ("</function>" if closed else "")
        calls: list[Call] = []
        pos = 0
        while body[pos:].strip():
            call, pos = self._function(body, pos, closed)
            if call is None:
                return None
            calls.append(call)
        return Parsed(tuple(calls)) if calls else None

    def _function(self, body: str, pos: int, closed: bool) -> tuple[Call | None, int]:
        head = _FUNCTION.match(body, pos)
        if head is None:
            return None, pos
        name = head.group(1).strip()
        end = body.find("</function>", head.end())
        if end == -1 and not closed:
            return None, pos  # truncated: not complete enough
        inner = body[head.end() : end if end != -1 else len(body)]
        after = end + len("</function>") if end != -1 else len(body)
        arguments: dict[str, Any] = {}
        at = 0
        while inner[at:].strip():
            param = _PARAMETER.match(inner, at)
            if param is None:
                return None, pos
            key = param.group(1).strip()
            stop = inner.find("</parameter>", param.end())
            following = _PARAMETER.search(inner, param.end())
            if stop == -1 or (following is not None and following.start() < stop):
                # A missing </parameter>: the value runs to the next parameter or the end.
                stop = following.start() if following is not None else len(inner)
                at = stop
            else:
                at = stop + len("</parameter>")
            value = inner[param.end() : stop]
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            arguments[key] = convert(value, self.property_schema(name, key))
        return make_call(name, arguments), after


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
