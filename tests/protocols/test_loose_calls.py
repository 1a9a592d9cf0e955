"""Loose tool calls: a right call written without the family's markup (bare JSON, a list of
calls, a fenced json block) is taken only when it is the whole rest of the output and names
declared tools; everything else stays text, streamed as early as before, and every chunking
of the same text gives what the whole text gives."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.ir import ReasoningDelta, TextDelta, ToolCallDelta
from protocols.parsers import LooseCallParser, StreamParser, make_response_parser, make_tool_parser
from tests.protocols.test_parsers import TOOLS, C, Factory, T, assert_chunking_invariant, counting_ids, fed

PARIS = {"city": "Paris"}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def loose(parser_id: str = "hermes_json") -> Factory:
    return lambda: make_tool_parser(parser_id, TOOLS, id_factory=counting_ids(), loose=True)


TAKEN = [
    ("bare object", CALL, [C(0, "get_weather", PARIS)]),
    ("parameters for arguments", '{"name": "get_weather", "parameters": {"city": "Paris"}}', [C(0, "get_weather", PARIS)]),
    ("string-encoded arguments", '{"name": "get_time", "arguments": "{}"}', [C(0, "get_time", {})]),
    ("no arguments", '{"name": "get_time"}', [C(0, "get_time", {})]),
    ("openai shape", '{"type": "function", "function": {"name": "get_time", "arguments": {}}}', [C(0, "get_time", {})]),
    ("whitespace around", f"\n\n  {CALL}\n\n", [C(0, "get_weather", PARIS)]),
    ("fenced json", f"```json\n{CALL}\n```", [C(0, "get_weather", PARIS)]),
    ("fenced, no language", f"```\n{CALL}\n```\n", [C(0, "get_weather", PARIS)]),
    ("fenced JSON on one line", f"```JSON {CALL}```", [C(0, "get_weather", PARIS)]),
    ("after content", f"I'll check the weather.\n\n```json\n{CALL}\n```", [T("I'll check the weather."), C(0, "get_weather", PARIS)]),
    ("inline after content", f"Calling: {CALL}", [T("Calling:"), C(0, "get_weather", PARIS)]),
    (
        "a list of calls",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]',
        [C(0, "get_weather", PARIS), C(1, "get_time", {})],
    ),
    ("two objects on two lines", f'{CALL}\n{{"name": "get_time"}}', [C(0, "get_weather", PARIS), C(1, "get_time", {})]),
    ("two fenced blocks", f'```json\n{CALL}\n```\n```json\n{{"name": "get_time"}}\n```', [C(0, "get_weather", PARIS), C(1, "get_time", {})]),
    ("a fence the output ends in", f"```json\n{CALL}\n``", [C(0, "get_weather", PARIS)]),
    ("a list in a fence", f"```json\n[{CALL}]\n```", [C(0, "get_weather", PARIS)]),
    ("braces and quotes in values", '{"name": "get_weather", "arguments": {"city": "P{a}r\\"is]"}}', [C(0, "get_weather", {"city": 'P{a}r"is]'})]),
    ("content with code before the call", f"Use `f(x)` or [1].\n{CALL}", [T("Use `f(x)` or [1]."), C(0, "get_weather", PARIS)]),
    ("a dead candidate before the call", f'{{"answer": 1}} then {CALL}', [T('{"answer": 1} then'), C(0, "get_weather", PARIS)]),
]

KEPT = [
    ("plain prose", "The weather in Paris is sunny."),
    ("text after the call", f"{CALL}\nThat should do it."),
    ("an undeclared tool", '{"name": "launch", "arguments": {"n": 1}}'),
    ("an undeclared tool in a list", f'[{CALL}, {{"name": "launch"}}]'),
    ("json that is not a call", '{"answer": 42, "why": "{}"}'),
    ("a call key and then another", '{"name": "get_time", "answer": 1}'),
    ("an empty object", "{}"),
    ("a list of numbers", "[1, 2, 3]"),
    ("an empty list", "[]"),
    ("arguments that are not an object", '{"name": "get_time", "arguments": [1]}'),
    ("truncated", '{"name": "get_weather", "arguments": {"ci'),
    ("a python fence", "```python\nprint({'name': 'get_time'})\n```"),
    ("a fence with nothing in it", "```json\n"),
    ("a fence with text inside", f"```json\nHere: {CALL}\n```"),
    ("a call in the middle of prose", f"First {CALL} and then more."),
    ("single backticks", f"`{CALL}`"),
    ("four backticks", f"````json\n{CALL}\n````"),
    ("invalid json", '{"name": "get_time", arguments: {}}'),
    ("a trailing comma", '{"name": "get_time",}'),
    ("nan is not json", '{"name": "get_weather", "arguments": {"ratio": NaN}}'),
    ("markdown", "# Title\n\n- [x] done\n- `code` {braces}\n\n```\nplain fence\n```\n"),
]


@pytest.mark.parametrize(("name", "text", "expected"), TAKEN, ids=[c[0] for c in TAKEN])
def test_loose_calls_are_taken_in_every_chunking(name: str, text: str, expected: list[object]) -> None:
    assert assert_chunking_invariant(loose(), text) == expected


@pytest.mark.parametrize(("name", "text"), KEPT, ids=[c[0] for c in KEPT])
def test_everything_else_stays_text_exactly_as_written(name: str, text: str) -> None:
    assert assert_chunking_invariant(loose(), text) == [T(text)]


def test_the_familys_markup_wins_and_then_loose_calls_are_off() -> None:
    markup = f"<tool_call>\n{CALL}\n</tool_call>"
    assert assert_chunking_invariant(loose(), markup) == [C(0, "get_weather", PARIS)]
    # A bare call before real markup is content: the markup call is the answer.
    text = f'{{"name": "get_time"}}\n{markup}'
    assert assert_chunking_invariant(loose(), text) == [T('{"name": "get_time"}'), C(0, "get_weather", PARIS)]
    # After a markup call, a bare object is content too.
    text = f'{markup}\n{{"name": "get_time"}}'
    assert assert_chunking_invariant(loose(), text) == [C(0, "get_weather", PARIS), T('{"name": "get_time"}')]


def test_loose_calls_share_numbering_and_ids_with_the_inner_parser() -> None:
    text = f"```json\n[{CALL}, {{\"name\": \"get_time\"}}]\n```"
    events = make_tool_parser("hermes_json", TOOLS, loose=True).parse(text)
    assert [(e.index, e.name) for e in events if isinstance(e, ToolCallDelta)] == [(0, "get_weather"), (1, "get_time")]
    ids = [e.id for e in events if isinstance(e, ToolCallDelta)]
    assert all(i is not None and i.startswith("call_") for i in ids) and len(set(ids)) == 2


def test_off_unless_asked_and_only_with_declared_tools() -> None:
    assert make_tool_parser("hermes_json", TOOLS).parse(CALL) == [T(CALL)]
    assert not isinstance(make_tool_parser("hermes_json", (), loose=True), LooseCallParser)
    assert make_tool_parser("hermes_json", (), loose=True).parse(CALL) == [T(CALL)]


@pytest.mark.parametrize("parser_id", ["hermes_json", "null", "qwen3_coder", "pythonic"])
def test_wraps_any_family_parser(parser_id: str) -> None:
    assert assert_chunking_invariant(loose(parser_id), f"Sure.\n{CALL}") == [T("Sure."), C(0, "get_weather", PARIS)]


# -- streaming holds back no more than needed ----------------------------------------------


def stream(factory: Factory, chunks: list[str]) -> list[list[object]]:
    """The events each chunk released, chunk by chunk."""
    parser = factory()
    return [list(parser.feed(chunk)) for chunk in chunks]


def test_prose_streams_at_once() -> None:
    chunks = ["The weather ", "is sunny", " today."]
    assert stream(loose(), chunks) == [[T("The weather")], [T(" is sunny")], [T(" today.")]]


def test_prose_with_braces_brackets_and_backticks_is_released_at_the_first_character_that_rules_a_call_out() -> None:
    chunks = ["Use `", "x` and [", "1] or {", "a}."]
    assert stream(loose(), chunks) == [[T("Use")], [T(" `x` and")], [T(" [1] or")], [T(" {a}.")]]
    assert stream(loose(), ["```", "python\n", "x = 1"]) == [[], [T("```python")], [T("\nx = 1")]]


def test_a_json_answer_is_released_at_its_first_key_unless_it_looks_like_a_call() -> None:
    assert stream(loose(), ['{"ans', 'wer": ', "42}"]) == [[], [T('{"answer":')], [T(" 42}")]]
    # "name" must name a declared tool: another name releases the object at once.
    assert stream(loose(), ['{"name": "Bob"', ', "age": 3}']) == [[T('{"name": "Bob"')], [T(', "age": 3}')]]
    # A call is held to the end of output, where it is taken (nothing may follow it).
    parser = loose()()
    assert parser.feed(CALL) == [] and parser.feed("\n") == []
    assert parser.finish() == [C(0, "get_weather", PARIS)]


def test_text_after_a_complete_call_releases_it() -> None:
    parser = loose()()
    assert parser.feed(CALL) == []
    assert coalesce_text(parser.feed(" ok")) == CALL + " ok"


def coalesce_text(events: list[object]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


# -- composition with reasoning --------------------------------------------------------------


def qwen2_parser(starts_inside: bool = False) -> Callable[[], StreamParser]:
    return lambda: make_response_parser(
        tool_parser="hermes_json", reasoning_parser="think_tag", tools=TOOLS, id_factory=counting_ids(),
        reasoning_options={"starts_inside": starts_inside}, loose_tool_calls=True,
    )


def test_a_call_inside_reasoning_is_never_taken() -> None:
    text = f"<think>\nmaybe {CALL}\n</think>\n\n```json\n{{\"name\": \"get_time\"}}\n```"
    assert assert_chunking_invariant(qwen2_parser(), text) == [ReasoningDelta(f"maybe {CALL}"), C(0, "get_time", {})]
    text = f"plan: {CALL}</think>The answer."
    expected = [ReasoningDelta(f"plan: {CALL}"), T("The answer.")]
    assert assert_chunking_invariant(qwen2_parser(starts_inside=True), text) == expected


# -- property: any text from these pieces, in any chunking -----------------------------------

PIECES = [
    CALL, '{"name": "get_time"}', '{"name": "launch"}', '{"answer": 1}', "{", "}", "[", "]", ",", "```", "```json", "json",
    "`", "\n", " ", "Sure.", "x", '"', '\\"', ":", '"name"', '"get_time"', "<tool_call>", "</tool_call>", "<think>", "</think>",
    '{"name": "get_weather", "arguments": {', '"city": "Paris"', "}}", "[{", "}]",
]  # fmt: skip


@st.composite
def text_and_chunking(draw: st.DrawFn) -> tuple[str, list[str]]:
    text = "".join(draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12)))
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, len(text) - 1)), max_size=8)))
    bounds = [0, *[c for c in cuts if c < len(text)], len(text)]
    return text, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(text_and_chunking(), st.sampled_from(["hermes_json", "null"]), st.booleans())
def test_streamed_equals_whole_and_nothing_is_lost(
    sample: tuple[str, list[str]], parser_id: str, with_reasoning: bool
) -> None:
    text, chunks = sample

    def factory() -> StreamParser:
        return make_response_parser(tool_parser=parser_id, reasoning_parser="think_tag" if with_reasoning else None,
                                    tools=TOOLS, id_factory=counting_ids(), loose_tool_calls=True)

    whole = factory().parse(text)
    assert fed(factory, chunks) == whole
    assert fed(factory, list(text)) == whole
    if not any(isinstance(e, ToolCallDelta) for e in whole) and not with_reasoning:
        assert coalesce_text(whole) == text  # no call: the text comes back exactly
    for event in whole:
        if isinstance(event, ToolCallDelta):
            assert isinstance(json.loads(event.arguments), dict)
            # Markup calls report any name; a loose call names a declared tool.
            assert event.name in {"get_weather", "get_time"} or (parser_id != "null" and "<tool_call>" in text)
