"""Tool-call and reasoning parsers: model output text → content, reasoning, tool calls.

Theory of operation
-------------------
Every parser is a :class:`StreamParser`, made fresh for each response:

- ``feed(text) -> list[Event]`` takes detokenized text in chunks of any size and
  returns what those chunks make certain: :class:`~protocols.ir.TextDelta`,
  :class:`~protocols.ir.ReasoningDelta`, :class:`~protocols.ir.ToolCallDelta`.
  Text that could still be the start of markup is held back (as
  :mod:`protocols.stops` does for stop strings), so markup never leaks into
  content; content before a call streams at once.
- ``finish() -> list[Event]`` ends the output: held text is released, and an
  unclosed call is parsed if it is complete enough (each format says what that
  means) or released as content.
- ``parse(text)`` does both at once. For any chunking of the same text,
  ``coalesce(fed events + finish()) == parse(text)``: parsers decide only on the
  text seen so far, never on chunk boundaries.

A tool call is emitted whole, when it closes: one ``ToolCallDelta`` with its
``index`` (0, 1, … in order), an id from the injectable ``id_factory`` (default
``call_`` + 24 letters and digits; Anthropic stages pass ``id_factory("toolu_")``),
its ``name``, and its ``arguments`` — always a JSON object string, whatever the
model wrote (arguments written as a JSON string are decoded once). Markup that does
not parse is released as content exactly as written: nothing is lost or duplicated.
Whitespace right around call markup (or reasoning tags) is layout and is dropped.
Calls to names that are not among the request's tools are reported like any other
call; what to do with them is the client's business (as with the hosted APIs).

Small models often write a right call without their family's markup (bare JSON, a
fenced json block): a family with ``loose_calls`` wraps its tool parser in
:class:`~protocols.parsers.loose_calls.LooseCallParser`, which recovers such a call
when it is the whole rest of the output and names only declared tools.

Reasoning and tools compose with :class:`ResponseParser`: the reasoning parser
runs first, only its content goes through the tool parser, so nothing inside
``<think>`` is ever taken for a call.

Registries map the ids that family files name to parser classes:
:data:`TOOL_PARSERS` (made with the request's tools, an id factory and the
family's format options, such as the markers of a format that differs from
another only in them) and :data:`REASONING_PARSERS` (made with format options
such as ``starts_inside`` or the tags).

A format that interleaves reasoning, content and calls in one markup (gpt-oss's
harmony channels) is one parser registered in both registries, whose tool parser
says it :attr:`~protocols.parsers.base.ToolParser.reads_reasoning`: the family
names it twice, and :func:`make_response_parser` then runs it once, as the tool
parser when the request has tools and as the reasoning parser (calls left as text)
when it has none.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from protocols.ir import TextDelta
from protocols.parsers.base import (
    Call,
    Event,
    IdFactory,
    NullToolParser,
    StreamParser,
    ToolParser,
    coalesce,
    id_factory,
    new_call_id,
)
from protocols.parsers.gemma4 import Gemma4Parser
from protocols.parsers.harmony import HarmonyParser, harmony_reasoning
from protocols.parsers.json_calls import HermesJsonParser, Llama3JsonParser, MistralParser
from protocols.parsers.loose_calls import LooseCallParser
from protocols.parsers.pythonic import PythonicParser
from protocols.parsers.sectioned import SectionedJsonParser
from protocols.parsers.reasoning import (
    Gemma4ReasoningParser,
    GraniteReasoningParser,
    NullReasoningParser,
    ThinkTagParser,
)
from protocols.parsers.xml_calls import Glm4Parser, XmlCallParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "null": NullToolParser,
    "hermes_json": HermesJsonParser,
    "qwen3_coder": XmlCallParser,
    "xml_calls": XmlCallParser,
    "glm4": Glm4Parser,
    "llama3_json": Llama3JsonParser,
    "pythonic": PythonicParser,
    "mistral": MistralParser,
    "gemma4": Gemma4Parser,
    "sectioned_json": SectionedJsonParser,
    "harmony": HarmonyParser,
}
"""Tool-call parsers by id."""

REASONING_PARSERS: dict[str, Callable[..., StreamParser]] = {
    "null": NullReasoningParser,
    "think_tag": ThinkTagParser,
    "gemma4": Gemma4ReasoningParser,
    "granite": GraniteReasoningParser,
    "harmony": harmony_reasoning,
}
"""Reasoning parsers by id; each takes its options as keyword arguments."""


class UnknownParserError(ValueError):
    """A parser id or option that does not exist; the message lists what does."""


def register_tool_parser(parser_id: str, cls: type[ToolParser]) -> None:
    """Add a tool parser (plugins); an id can be registered once."""
    if parser_id in TOOL_PARSERS:
        raise ValueError(f"tool parser {parser_id!r} is already registered")
    TOOL_PARSERS[parser_id] = cls


def register_reasoning_parser(parser_id: str, factory: Callable[..., StreamParser]) -> None:
    """Add a reasoning parser (plugins); an id can be registered once."""
    if parser_id in REASONING_PARSERS:
        raise ValueError(f"reasoning parser {parser_id!r} is already registered")
    REASONING_PARSERS[parser_id] = factory


@functools.cache  # read for every response's parser: a signature is tens of microseconds
def _keyword_options(factory: Callable[..., Any]) -> tuple[str, ...]:
    return tuple(name for name, p in inspect.signature(factory).parameters.items()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY and name != "id_factory")


def _options_problem(kind: str, parser_id: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> str | None:
    valid = _keyword_options(factory)
    unknown = sorted(set(options) - set(valid))
    if not unknown:
        return None
    return (f"unknown option(s) {', '.join(unknown)} for {kind} parser {parser_id!r}; "
            f"valid options: {', '.join(valid) or '(none)'}")


def tool_options_problem(parser_id: str, options: Mapping[str, Any]) -> str | None:
    """Why ``options`` do not fit tool parser ``parser_id`` (``None``: they do), for checking family files."""
    return _options_problem("tool", parser_id, TOOL_PARSERS[parser_id], options)


def reasoning_options_problem(parser_id: str, options: Mapping[str, Any]) -> str | None:
    """Why ``options`` do not fit reasoning parser ``parser_id`` (``None``: they do)."""
    return _options_problem("reasoning", parser_id, REASONING_PARSERS[parser_id], options)


def make_tool_parser(
    parser_id: str | None,
    tools: Sequence[Mapping[str, Any]] = (),
    *,
    id_factory: IdFactory = new_call_id,
    loose: bool = False,
    options: Mapping[str, Any] | None = None,
) -> ToolParser:
    """A fresh tool parser for one response (``None`` means ``"null"``); ``loose`` also
    recovers calls to ``tools`` written without the format's markup; ``options`` are the
    format's (a family's ``tools.options``)."""
    cls = TOOL_PARSERS.get(parser_id or "null")
    if cls is None:
        raise UnknownParserError(
            f"unknown tool parser {parser_id!r}; valid ids: {', '.join(sorted(TOOL_PARSERS))}"
        )
    problem = _options_problem("tool", parser_id or "null", cls, options or {})
    if problem is not None:
        raise UnknownParserError(problem)
    parser = cls(tools, id_factory=id_factory, **dict(options or {}))
    # Without declared tools no loose call can match: skip the wrapper and its scanning.
    return LooseCallParser(parser) if loose and parser.schemas else parser


def make_reasoning_parser(parser_id: str | None, **options: Any) -> StreamParser:
    """A fresh reasoning parser for one response (``None`` means ``"null"``)."""
    factory = REASONING_PARSERS.get(parser_id or "null")
    if factory is None:
        raise UnknownParserError(
            f"unknown reasoning parser {parser_id!r}; valid ids: {', '.join(sorted(REASONING_PARSERS))}"
        )
    problem = _options_problem("reasoning", parser_id or "null", factory, options)
    if problem is not None:
        raise UnknownParserError(problem)
    return factory(**options)


class ResponseParser(StreamParser):
    """Reasoning first, then tools on its content; the same ``feed``/``finish``."""

    def __init__(self, reasoning: StreamParser | None = None, tools: StreamParser | None = None) -> None:
        self.reasoning = reasoning if reasoning is not None else NullReasoningParser()
        self.tools = tools if tools is not None else NullToolParser()
        # No tools parser: what comes out is the reasoning parser's text and reasoning, never a call.
        self.no_calls = type(self.tools) is NullToolParser

    def feed(self, text: str) -> list[Event]:
        return self._through_tools(self.reasoning.feed(text))

    def finish(self) -> list[Event]:
        return [*self._through_tools(self.reasoning.finish()), *self.tools.finish()]

    def _through_tools(self, events: list[Event]) -> list[Event]:
        if self.no_calls:  # no tools: the text is content as it is (per token: the list itself, unless empty text)
            for event in events:
                if isinstance(event, TextDelta) and not event.text:
                    return [event for event in events if not isinstance(event, TextDelta) or event.text]
            return events
        out: list[Event] = []
        for event in events:
            if isinstance(event, TextDelta):
                out += self.tools.feed(event.text)
            else:
                out.append(event)
        return out


def make_response_parser(
    *,
    tool_parser: str | None = None,
    reasoning_parser: str | None = None,
    tools: Sequence[Mapping[str, Any]] = (),
    id_factory: IdFactory = new_call_id,
    reasoning_options: Mapping[str, Any] | None = None,
    loose_tool_calls: bool = False,
    tool_options: Mapping[str, Any] | None = None,
) -> ResponseParser:
    """The parser for one response, from a family's parser ids and options."""
    options = tool_options if tool_parser is not None else None  # the family's options are its parser's
    tool = make_tool_parser(tool_parser, tools, id_factory=id_factory, loose=loose_tool_calls, options=options)
    if tool.reads_reasoning:
        return ResponseParser(tools=tool)  # one markup for both: the tool parser reads it all
    return ResponseParser(reasoning=make_reasoning_parser(reasoning_parser, **dict(reasoning_options or {})),
                          tools=tool)


__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "Call",
    "Event",
    "IdFactory",
    "LooseCallParser",
    "ResponseParser",
    "StreamParser",
    "ToolParser",
    "UnknownParserError",
    "coalesce",
    "id_factory",
    "make_reasoning_parser",
    "make_response_parser",
    "make_tool_parser",
    "new_call_id",
    "register_reasoning_parser",
    "register_tool_parser",
    "reasoning_options_problem",
    "tool_options_problem",
]
