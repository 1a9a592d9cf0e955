"""Tool-call and reasoning parsers: each format's outputs, fallbacks, and the promise
that streaming in any chunking gives exactly what whole-text parsing gives."""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from protocols.ir import ReasoningDelta, TextDelta, ToolCallDelta
from protocols.parsers import (
    REASONING_PARSERS,
    TOOL_PARSERS,
    Event,
    ResponseParser,
    StreamParser,
    UnknownParserError,
    coalesce,
    id_factory,
    make_reasoning_parser,
    make_response_parser,
    make_tool_parser,
    new_call_id,
)
from protocols.parsers.reasoning import ThinkTagParser
from protocols.parsers.schema import convert

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "ratio": {"type": "number"},
                "options": {"type": "object"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
                "zip": {"type": "string"},
            },
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def T(text: str) -> TextDelta:
    return TextDelta(text)


def R(text: str) -> ReasoningDelta:
    return ReasoningDelta(text)


def C(index: int, name: str, arguments: dict[str, Any]) -> ToolCallDelta:
    return ToolCallDelta(index, f"id{index}", name, json.dumps(arguments, ensure_ascii=False))


Factory = Callable[[], StreamParser]


def tools_factory(parser_id: str) -> Factory:
    return lambda: make_tool_parser(parser_id, TOOLS, id_factory=counting_ids())


def fed(factory: Factory, chunks: list[str]) -> list[Event]:
    parser = factory()
    events: list[Event] = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return coalesce(events + parser.finish())


def chunkings(text: str) -> list[list[str]]:
    """Every 2-way split, 1-character chunks, and a few seeded random chunkings."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    out.append(list(text))
    rng = random.Random(text)
    for _ in range(4):
        chunks, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, 9)
            chunks.append(text[pos : pos + size])
            pos += size
        out.append(chunks)
    return out


def assert_chunking_invariant(factory: Factory, text: str) -> list[Event]:
    whole = factory().parse(text)
    for chunks in chunkings(text):
        assert fed(factory, chunks) == whole, f"chunks: {chunks!r}"
    return whole


@dataclass(frozen=True)
class Case:
    parser: str
    name: str
    text: str
    expected: list[Event]


PARIS = {"city": "Paris"}

CASES = [
    # -- hermes_json ----------------------------------------------------------------
    Case("hermes_json", "typical", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', [C(0, "get_weather", PARIS)]),
    Case(
        "hermes_json",
        "several calls after content",
        'Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n',
        [T("Let me check both."), C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    Case("hermes_json", "string-encoded arguments", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', [C(0, "get_weather", PARIS)]),
    Case("hermes_json", "unterminated complete", 'On it. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', [T("On it."), C(0, "get_weather", PARIS)]),
    Case("hermes_json", "unterminated truncated", 'On it. <tool_call>\n{"name": "get_weather", "argu', [T('On it. <tool_call>\n{"name": "get_weather", "argu')]),
    Case("hermes_json", "malformed", "a <tool_call>not json</tool_call> b", [T("a <tool_call>not json</tool_call> b")]),
    Case("hermes_json", "json but not a call", '<tool_call>{"city": "Paris"}</tool_call>', [T('<tool_call>{"city": "Paris"}</tool_call>')]),
    Case("hermes_json", "array arguments is not a call", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [T('<tool_call>{"name": "f", "arguments": [1]}</tool_call>')]),
    Case(
        "hermes_json",
        "stray opener before a real call",
        'use <tool_call> tags: <tool_call>{"name": "get_time"}</tool_call>',
        [T("use <tool_call> tags:"), C(0, "get_time", {})],
    ),
    Case("hermes_json", "text after call", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n\nDone.', [C(0, "get_time", {}), T("Done.")]),
    Case("hermes_json", "plain text with angle brackets", "if a < b and b <tool then x\n", [T("if a < b and b <tool then x\n")]),
    Case("hermes_json", "unknown tool is reported", '<tool_call>{"name": "launch", "arguments": {"n": 1}}</tool_call>', [C(0, "launch", {"n": 1})]),
    Case("hermes_json", "raw newline inside a string", '<tool_call>{"name": "w", "arguments": {"code": "a\nb"}}</tool_call>', [C(0, "w", {"code": "a\nb"})]),
    # -- qwen3_coder ----------------------------------------------------------------
    Case(
        "qwen3_coder",
        "typical with schema conversion",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\nfalse\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n"
        '<parameter=options>\n{"units": "si"}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n'
        "<parameter=note>\nnull\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n</function>\n</tool_call>",
        [C(0, "get_weather", {"city": "Paris", "days": 3, "metric": False, "ratio": 0.5, "options": {"units": "si"}, "hours": [1, 2], "note": None, "zip": "01234"})],
    ),
    Case(
        "qwen3_coder",
        "several calls after content",
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
        [T("Checking."), C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    Case(
        "qwen3_coder",
        "only one newline is stripped",
        "<tool_call>\n<function=write>\n<parameter=text>\n\n  indented\n\n</parameter>\n</function>\n</tool_call>",
        [C(0, "write", {"text": "\n  indented\n"})],
    ),
    Case(
        "qwen3_coder",
        "unterminated with closed function",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
        [C(0, "get_weather", PARIS)],
    ),
    Case(
        "qwen3_coder",
        "unterminated truncated",
        "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [T("Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar")],
    ),
    Case("qwen3_coder", "malformed", "<tool_call>{oops}</tool_call>", [T("<tool_call>{oops}</tool_call>")]),
    Case(
        "qwen3_coder",
        "without the tool_call wrapper",
        "Ok <function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>",
        [T("Ok"), C(0, "get_weather", {"days": 2})],
    ),
    Case(
        "qwen3_coder",
        "value that fits no declared type stays text",
        "<tool_call><function=get_weather><parameter=days>\nsoon\n</parameter></function></tool_call>",
        [C(0, "get_weather", {"days": "soon"})],
    ),
    Case(
        "qwen3_coder",
        "undeclared parameters stay text",
        "<tool_call><function=launch><parameter=n>\n5\n</parameter></function></tool_call>",
        [C(0, "launch", {"n": "5"})],
    ),
    # -- glm4 -----------------------------------------------------------------------
    Case(
        "glm4",
        "typical with schema conversion",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
        "<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>hours</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
        "<arg_key>zip</arg_key>\n<arg_value>01234</arg_value>\n</tool_call>",
        [C(0, "get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [1, 2], "zip": "01234"})],
    ),
    Case(
        "glm4",
        "several calls after content, no newlines",
        "Let me see.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call><tool_call>get_time</tool_call>",
        [T("Let me see."), C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    Case(
        "glm4",
        "undeclared values are taken as JSON",
        "<tool_call>search\n<arg_key>q</arg_key>\n<arg_value>cats</arg_value>\n<arg_key>n</arg_key>\n<arg_value>5</arg_value>\n</tool_call>",
        [C(0, "search", {"q": "cats", "n": 5})],
    ),
    Case(
        "glm4",
        "string values keep their spaces",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value> Paris\n</arg_value>\n</tool_call>",
        [C(0, "get_weather", {"city": " Paris\n"})],
    ),
    Case(
        "glm4",
        "unterminated complete",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>",
        [C(0, "get_weather", PARIS)],
    ),
    Case("glm4", "unterminated truncated", "x <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", [T("x <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par")]),
    Case("glm4", "malformed", "<tool_call>get weather now</tool_call>", [T("<tool_call>get weather now</tool_call>")]),
    Case("glm4", "json body", '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', [C(0, "get_time", {})]),
    # -- llama3_json ----------------------------------------------------------------
    Case("llama3_json", "typical", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [C(0, "get_weather", PARIS)]),
    Case(
        "llama3_json",
        "python_tag and several calls",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "arguments": "{}"}',
        [C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    Case("llama3_json", "leading whitespace", '\n\n {"name": "get_time", "parameters": {}}\n', [C(0, "get_time", {})]),
    Case("llama3_json", "text before json is content", 'Sure: {"name": "get_time", "parameters": {}}', [T('Sure: {"name": "get_time", "parameters": {}}')]),
    Case("llama3_json", "text after json is content", '{"name": "get_time", "parameters": {}} and more', [T('{"name": "get_time", "parameters": {}} and more')]),
    Case("llama3_json", "json that is not a call", '{"answer": 42, "why": "{}"}', [T('{"answer": 42, "why": "{}"}')]),
    Case("llama3_json", "unterminated", '{"name": "get_weather", "parameters": {"ci', [T('{"name": "get_weather", "parameters": {"ci')]),
    Case("llama3_json", "python_tag with builtin code", '<|python_tag|>brave_search.call(query="x")', [T('<|python_tag|>brave_search.call(query="x")')]),
    Case("llama3_json", "plain text", "Hello there.", [T("Hello there.")]),
    # -- pythonic -------------------------------------------------------------------
    Case("pythonic", "typical", "[get_weather(city='Paris', days=3)]", [C(0, "get_weather", {"city": "Paris", "days": 3})]),
    Case(
        "pythonic",
        "several calls, literals",
        '[get_weather(city="Paris", options={"a": [1, 2.5]}, metric=true, note=None), get_time()]',
        [C(0, "get_weather", {"city": "Paris", "options": {"a": [1, 2.5]}, "metric": True, "note": None}), C(1, "get_time", {})],
    ),
    Case(
        "pythonic",
        "lfm2 sentinels after content",
        "Checking.<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|>Done.",
        [T("Checking."), C(0, "get_weather", PARIS), T("Done.")],
    ),
    Case("pythonic", "llama4 python_start", "<|python_start|>[get_time()]<|python_end|>", [C(0, "get_time", {})]),
    Case("pythonic", "brackets in strings", "[get_weather(city='a]b)(c')]", [C(0, "get_weather", {"city": "a]b)(c"})]),
    Case("pythonic", "unterminated", "[get_weather(city='Par", [T("[get_weather(city='Par")]),
    Case("pythonic", "lfm2 unterminated but complete", "<|tool_call_start|>[get_time()]", [C(0, "get_time", {})]),
    Case("pythonic", "positional arguments are not a call", "[get_weather('Paris')]", [T("[get_weather('Paris')]")]),
    Case("pythonic", "code is never evaluated", "[get_weather(city=__import__('os').getcwd())]", [T("[get_weather(city=__import__('os').getcwd())]")]),
    Case("pythonic", "markdown list is content", "[1] First point\n[2] Second", [T("[1] First point\n[2] Second")]),
    Case("pythonic", "text after the list is content", "[get_time()] now", [T("[get_time()] now")]),
    # -- mistral --------------------------------------------------------------------
    Case("mistral", "json list (pre-v11)", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]', [C(0, "get_weather", PARIS), C(1, "get_time", {})]),
    Case(
        "mistral",
        "name and args (v11+), several, after content",
        'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{}',
        [T("Let me look."), C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    Case("mistral", "string-encoded arguments", '[TOOL_CALLS][{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]', [C(0, "get_weather", PARIS)]),
    Case("mistral", "truncated", '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', [T('[TOOL_CALLS]get_weather[ARGS]{"city": "Pa')]),
    Case("mistral", "malformed", "[TOOL_CALLS] oops", [T("[TOOL_CALLS] oops")]),
    Case("mistral", "text after the call", '[TOOL_CALLS]get_time{} ok then', [C(0, "get_time", {}), T("ok then")]),
    # -- gemma4 ---------------------------------------------------------------------
    Case(
        "gemma4",
        "typical",
        '<|tool_call>call:get_weather{city:<|"|>Paris, {FR}: "x"<|"|>,days:3,metric:false,ratio:-1.5e1,note:null}<tool_call|>',
        [C(0, "get_weather", {"city": 'Paris, {FR}: "x"', "days": 3, "metric": False, "ratio": -15.0, "note": None})],
    ),
    Case(
        "gemma4",
        "several calls after content, nesting",
        'Sure.<|tool_call>call:get_weather{options:{units:<|"|>si<|"|>,list:[1,<|"|>a<|"|>,{b:true}]},hours:[]}<tool_call|>'
        "<|tool_call>call:get_time{}<tool_call|>",
        [T("Sure."), C(0, "get_weather", {"options": {"units": "si", "list": [1, "a", {"b": True}]}, "hours": []}), C(1, "get_time", {})],
    ),
    Case("gemma4", "unterminated complete", '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}', [C(0, "get_weather", PARIS)]),
    Case("gemma4", "unterminated truncated", '<|tool_call>call:get_weather{city:<|"|>Par', [T('<|tool_call>call:get_weather{city:<|"|>Par')]),
    Case("gemma4", "malformed", "<|tool_call>get_weather(city)<tool_call|>", [T("<|tool_call>get_weather(city)<tool_call|>")]),
    # -- null -----------------------------------------------------------------------
    Case("null", "everything is content", '<tool_call>{"name": "get_time"}</tool_call>', [T('<tool_call>{"name": "get_time"}</tool_call>')]),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.parser}: {c.name}" for c in CASES])
def test_tool_parser_output_is_the_same_in_every_chunking(case: Case) -> None:
    assert assert_chunking_invariant(tools_factory(case.parser), case.text) == case.expected


@pytest.mark.parametrize("case", [c for c in CASES if all(isinstance(e, TextDelta) for e in c.expected)], ids=lambda c: f"{c.parser}: {c.name}")
def test_fallback_loses_and_duplicates_nothing(case: Case) -> None:
    events = tools_factory(case.parser)().parse(case.text)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == case.text


def test_every_format_is_covered() -> None:
    from flow.catalog.families import builtin_families
    from tests.protocols.test_family_formats import CASES as FAMILY_CASES

    by_family = {builtin_families()[c.family].tools.parser for c in FAMILY_CASES}
    assert {c.parser for c in CASES} | by_family == set(TOOL_PARSERS)


# -- streaming behaviour -----------------------------------------------------------------


def test_content_before_a_call_streams_at_once_and_markup_never_leaks() -> None:
    parser = make_tool_parser("hermes_json", TOOLS)
    assert parser.feed("Let me check") == [T("Let me check")]
    assert parser.feed(" the weather. <tool") == [T(" the weather.")]
    assert parser.feed('_call>{"name": "get_weather", ') == []
    events = parser.feed('"arguments": {"city": "Paris"}}</tool_call>')
    assert len(events) == 1 and isinstance(events[0], ToolCallDelta)
    assert events[0].name == "get_weather" and json.loads(events[0].arguments) == PARIS
    assert parser.finish() == []


MARKUP = re.compile(r"<\|?tool|<function|\[TOOL|<arg_|<\|python")


def _clean_call_cases() -> list[Case]:
    """Cases with calls whose expected content holds no markup of its own."""
    return [
        c
        for c in CASES
        if any(isinstance(e, ToolCallDelta) for e in c.expected)
        and not any(isinstance(e, TextDelta) and MARKUP.search(e.text) for e in c.expected)
    ]


@pytest.mark.parametrize("case", _clean_call_cases(), ids=lambda c: f"{c.parser}: {c.name}")
def test_no_markup_in_content_when_fed_one_character_at_a_time(case: Case) -> None:
    parser = tools_factory(case.parser)()
    text = "".join(e.text for ch in case.text for e in parser.feed(ch) if isinstance(e, TextDelta))
    text += "".join(e.text for e in parser.finish() if isinstance(e, TextDelta))
    assert not MARKUP.search(text)


def test_non_call_output_streams_before_the_end() -> None:
    pythonic = make_tool_parser("pythonic")
    assert pythonic.feed("[Verse 1] la la") == [T("[Verse 1] la la")]
    llama = make_tool_parser("llama3_json")
    assert llama.feed("Hello") == [T("Hello")]
    llama = make_tool_parser("llama3_json")
    assert llama.feed('{"a": 1}') == [T('{"a": 1}')]  # a complete object that is not a call


def test_arguments_are_always_a_json_object_string() -> None:
    for case in CASES:
        for event in case.expected:
            if isinstance(event, ToolCallDelta):
                assert isinstance(json.loads(event.arguments), dict)


# -- ids and the registry ----------------------------------------------------------------


def test_default_ids_and_injectable_factories() -> None:
    text = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    calls = [e for e in make_tool_parser("hermes_json").parse(text) if isinstance(e, ToolCallDelta)]
    assert [c.index for c in calls] == [0, 1]
    assert all(c.id is not None and re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in calls)
    assert calls[0].id != calls[1].id
    assert re.fullmatch(r"toolu_[A-Za-z0-9]{24}", id_factory("toolu_")())
    assert re.fullmatch(r"[A-Za-z0-9]{9}", id_factory("", 9)())
    assert new_call_id().startswith("call_")


def test_unknown_ids_and_options_say_what_is_valid() -> None:
    with pytest.raises(UnknownParserError, match="valid ids: .*hermes_json"):
        make_tool_parser("hermes")
    with pytest.raises(UnknownParserError, match="valid ids: .*think_tag"):
        make_reasoning_parser("think")
    with pytest.raises(UnknownParserError, match="valid options: starts_inside, start, end"):
        make_reasoning_parser("think_tag", inside=True)
    assert set(REASONING_PARSERS) == {"null", "think_tag", "gemma4", "granite", "harmony"}
    assert isinstance(make_tool_parser(None), type(make_tool_parser("null")))


# -- reasoning and composition -----------------------------------------------------------


def think(**options: Any) -> Factory:
    return lambda: ThinkTagParser(**options)


@pytest.mark.parametrize(
    ("options", "text", "expected"),
    [
        ({}, "<think>\nLet me think.\n</think>\n\nThe answer is 4.", [R("Let me think."), T("The answer is 4.")]),
        ({}, "No thinking here.", [T("No thinking here.")]),
        ({}, "Intro <think>hmm</think> answer", [T("Intro"), R("hmm"), T("answer")]),
        ({}, "<think>\ncut off mid thou", [R("cut off mid thou")]),
        ({}, "<think>a</think>b <think>c</think>", [R("a"), T("b <think>c</think>")]),
        ({"starts_inside": True}, "reasoning\n</think>\n\nanswer", [R("reasoning"), T("answer")]),
        ({"starts_inside": True}, "<think>\nreasoning</think>answer", [R("reasoning"), T("answer")]),
        ({"starts_inside": True}, "never closed", [R("never closed")]),
        ({"start": "<|channel>thought", "end": "<channel|>"}, "<|channel>thought\nplan<channel|>Hi", [R("plan"), T("Hi")]),
        # Interleaved thinking: every block is reasoning, the text between them content.
        ({"interleaved": True}, "<think>a</think>b <think>c</think>", [R("a"), T("b"), R("c")]),
        ({"interleaved": True, "starts_inside": True}, "a</think>\nb\n<think>\nc\n</think>\nd <think>e",
         [R("a"), T("b"), R("c"), T("d"), R("e")]),
        # Several spellings of a tag: whichever comes first opens (or closes) the block.
        ({"start": ["<think>", "<reason>"], "end": ["</think>", "</reason>"]}, "x <reason>y</think>z",
         [T("x"), R("y"), T("z")]),
    ],
)
def test_think_tag(options: dict[str, Any], text: str, expected: list[Event]) -> None:
    assert assert_chunking_invariant(think(**options), text) == expected


def test_reasoning_is_never_tool_parsed() -> None:
    text = (
        '<think>\nMaybe <tool_call>{"name": "get_time"}</tool_call>?\n</think>\n\n'
        'Checking. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    )

    def factory() -> StreamParser:
        return make_response_parser(tool_parser="hermes_json", reasoning_parser="think_tag", tools=TOOLS, id_factory=counting_ids())

    assert assert_chunking_invariant(factory, text) == [
        R('Maybe <tool_call>{"name": "get_time"}</tool_call>?'),
        T("Checking."),
        C(0, "get_weather", PARIS),
    ]


def test_composer_with_starts_inside_and_gemma4() -> None:
    def qwen() -> StreamParser:
        return make_response_parser(
            tool_parser="qwen3_coder", reasoning_parser="think_tag", tools=TOOLS, id_factory=counting_ids(), reasoning_options={"starts_inside": True}
        )

    text = "plan</think>\n\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    assert assert_chunking_invariant(qwen, text) == [R("plan"), C(0, "get_time", {})]

    def gemma() -> StreamParser:
        return ResponseParser(make_reasoning_parser("gemma4"), make_tool_parser("gemma4", TOOLS, id_factory=counting_ids()))

    text = "<|channel>thought\nneed time<channel|><|tool_call>call:get_time{}<tool_call|>"
    assert assert_chunking_invariant(gemma, text) == [R("need time"), C(0, "get_time", {})]


def test_defaults_are_pass_through() -> None:
    assert ResponseParser().parse("<think>x</think><tool_call>") == [T("<think>x</think><tool_call>")]


# -- schema conversion -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "schema", "expected"),
    [
        ("42", {"type": "integer"}, 42),
        ("42.0", {"type": "integer"}, 42),
        ("4.5", {"type": "integer"}, "4.5"),  # fits no declared type: the text is kept
        ("3", {"type": "number"}, 3),
        ("3.0", {"type": "number"}, 3.0),
        ("nan", {"type": "number"}, "nan"),
        ("True", {"type": "boolean"}, True),
        ("null", {"type": ["string", "null"]}, None),
        ("null", {"type": "string"}, "null"),
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
        ("{'a': True, 'b': null}", {"type": "object"}, {"a": True, "b": None}),
        ("(1, 2)", {"type": "array"}, [1, 2]),
        ("[1]", {"type": "object"}, "[1]"),
        ("2", {"enum": [1, 2, 3]}, 2),
        ("2", {"enum": ["1", "2"]}, "2"),
        ("5", {"type": "int"}, 5),
        ("5", {"properties": {}}, "5"),
        (" 5 ", None, " 5 "),
    ],
)
def test_schema_conversion(raw: str, schema: dict[str, Any] | None, expected: Any) -> None:
    value = convert(raw, schema)
    assert value == expected and type(value) is type(expected)


def test_untyped_values_as_json() -> None:
    assert convert(" 5 ", None, untyped="json") == 5
    assert convert("[1, 2]", {}, untyped="json") == [1, 2]
    assert convert("plain words", None, untyped="json") == "plain words"


# -- fuzz: random mixes of markup fragments ----------------------------------------------

FRAGMENTS = [
    "<tool_call>", "</tool_call>", '{"name": "a"}', '{"name": "b", "arguments": {"x": 1}}', " ", "\n", "x", "<", "[", "]",
    "(", ")", "{", "}", ";", "[get_time(a=1)]", "[TOOL_CALLS]", "f", '{"a": 1}', "<|tool_call>", "call:f{}", "<tool_call|>",
    'call:g{a:<|"|>s<|"|>}', "<function=f>", "<parameter=a>", "\n1\n", "</parameter>", "</function>", "<arg_key>", "k",
    "</arg_key>", "<arg_value>", "v", "</arg_value>", "<|python_tag|>", "<|tool_call_start|>", "<|tool_call_end|>",
    "'", '"', "\\", "<think>", "</think>",
    "<|channel|>", "analysis", "final", " to=functions.f", "<|message|>", "<|end|>", "<|start|>", "<|call|>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>",
]  # fmt: skip


@pytest.mark.parametrize("parser_id", sorted(TOOL_PARSERS))
def test_fuzz_chunking_and_conservation(parser_id: str) -> None:
    rng = random.Random(parser_id)
    for _ in range(10):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 10)))
        for reasoning in (None, "think_tag"):

            def factory() -> StreamParser:
                return make_response_parser(tool_parser=parser_id, reasoning_parser=reasoning, id_factory=counting_ids())

            whole = factory().parse(text)
            channels = TOOL_PARSERS[parser_id].reads_reasoning  # harmony: channel markup is the format's own
            if reasoning is None and not channels and not any(isinstance(e, ToolCallDelta) for e in whole):
                # No calls: the text comes back exactly, markup and whitespace included.
                assert "".join(e.text for e in whole if isinstance(e, TextDelta)) == text
            for chunks in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
                assert fed(factory, chunks) == whole, f"{text!r} in {chunks!r}"
