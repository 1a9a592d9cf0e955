"""Parser cost per token: each family's response parser on one long mixed output, streamed a token at a time.

Run::

    .venv/bin/python scripts/bench_parsers.py            # a table
    .venv/bin/python scripts/bench_parsers.py --json out.json

For every family below, one output in that family's own markup: about 300 words of reasoning (content,
for families without a reasoning parser), about 300 words of answer, then four calls with a few typed
arguments each; MiniMax M2 thinks again before every call after the first (interleaved thinking), Granite
3.2 writes its reasoning in "Here is my thought process:" / "Here is my response:" sections. The output is cut into tokens (markers such as ``<|channel|>`` or ``<｜tool▁sep｜>`` are one
token, as in the models' vocabularies; words, spaces and punctuation are one each) and fed to the parser
the family's file makes (``stages.chat.response_parser`` does the same for a request with tools), one
token per ``feed``, then ``finish``. The figure is wall time per token, the best of ``--repeats`` runs; the
families are measured round-robin in each repeat, so drift hits all alike, and each is compared with the
hermes baseline (the qwen3 family: ``<think>`` and ``<tool_call>`` JSON) of the same round. Target: no
parser above 2x hermes per token.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from typing import Any

from flow.catalog.families import builtin_families
from protocols.ir import ToolCallDelta
from protocols.parsers import StreamParser, make_response_parser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}]
CALLS = [{"city": city, "days": days, "metric": days % 2 == 0} for city, days in
         [("Paris", 3), ("Rome", 2), ("Oslo", 5), ("Lima", 4)]]
_WORDS = ("the user asks about the weather in four cities so I will look each one up and then compare the "
          "forecasts before answering with a short summary of temperatures, rain and wind").split()


def prose(words: int, seed: int) -> str:
    return " ".join(_WORDS[(i * 7 + seed) % len(_WORDS)] for i in range(words)) + "."


Writer = Callable[[dict[str, Any]], str]


def _json(args: dict[str, Any]) -> str:
    return json.dumps(args)


def _calls(family: str) -> Callable[[list[dict[str, Any]]], str]:
    """The four calls as ``family`` writes them."""
    def each(write: Writer, sep: str = "") -> Callable[[list[dict[str, Any]]], str]:
        return lambda calls: sep.join(write(a) for a in calls)

    if family == "qwen3":
        return each(lambda a: f'<tool_call>\n{{"name": "get_weather", "arguments": {_json(a)}}}\n</tool_call>', "\n")
    if family == "gpt-oss":
        return each(lambda a: "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
                              f"<|message|>{_json(a)}<|call|>")
    if family == "deepseek-v3":
        return lambda calls: "<｜tool▁calls▁begin｜>" + "".join(
            f"<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{_json(a)}<｜tool▁call▁end｜>" for a in calls
        ) + "<｜tool▁calls▁end｜>"
    if family == "kimi-k2":
        return lambda calls: "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.get_weather:{i}<|tool_call_argument_begin|>{_json(a)}<|tool_call_end|>"
            for i, a in enumerate(calls)) + "<|tool_calls_section_end|>"
    if family in ("qwen3.5", "seed-oss"):
        wrap = ("<tool_call>", "</tool_call>") if family == "qwen3.5" else ("<seed:tool_call>", "</seed:tool_call>")
        return each(lambda a: f"{wrap[0]}\n<function=get_weather>\n" + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items()
        ) + f"</function>\n{wrap[1]}", "\n")
    if family == "minimax-m2":  # interleaved thinking: a short block before each later call
        return lambda calls: "\n".join(
            (f"<think>\n{prose(12, i)}\n</think>\n\n" if i else "") + '<minimax:tool_call>\n<invoke name="get_weather">\n'
            + "".join(f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n'
                      for k, v in a.items()) + "</invoke>\n</minimax:tool_call>" for i, a in enumerate(calls))
    if family == "minicpm":
        return each(lambda a: '<function name="get_weather">' + "".join(
            f'<param name="{k}">{v if isinstance(v, str) else json.dumps(v)}</param>' for k, v in a.items()
        ) + "</function>")
    if family == "granite":
        return lambda calls: "<|tool_call|>" + json.dumps([{"name": "get_weather", "arguments": a} for a in calls])
    if family == "phi4-mini":
        return lambda calls: "functools" + json.dumps([{"name": "get_weather", "arguments": a} for a in calls])
    raise ValueError(family)


def _reasoning(family: str, text: str) -> str:
    if family == "gpt-oss":
        return f"<|channel|>analysis<|message|>{text}<|end|>"
    if family == "seed-oss":
        return f"<seed:think>{text}</seed:think>"
    if family == "granite":
        return f"Here is my thought process:\n{text}\n\nHere is my response:\n"
    if builtin_families()[family].reasoning.parser == "null":
        return text + "\n\n"  # no reasoning markup: the same words as content
    return f"<think>{text}</think>"


def _answer(family: str, text: str) -> str:
    return f"<|start|>assistant<|channel|>commentary<|message|>{text}<|end|>" if family == "gpt-oss" else text


FAMILIES = ["qwen3", "gpt-oss", "deepseek-v3", "kimi-k2", "qwen3.5", "seed-oss", "minimax-m2", "minicpm", "granite",
            "phi4-mini"]
_TOKEN = re.compile(r"<[|｜][^|｜<>]*[|｜]>|<\|[a-z_]+>|<[a-z_]+\|>|</?[\w:]+>|\w+|\s+|[^\w\s]")


def output(family: str) -> str:
    return (_reasoning(family, prose(300, 1)) + _answer(family, prose(300, 2)) + "\n\n" + _calls(family)(CALLS))


def tokens(text: str) -> list[str]:
    pieces = _TOKEN.findall(text)
    assert "".join(pieces) == text
    return pieces


def parser(family: str) -> StreamParser:
    f = builtin_families()[family]
    options = dict(f.reasoning.options)
    return make_response_parser(tool_parser=f.tools.parser, reasoning_parser=f.reasoning.parser, tools=TOOLS,
                                reasoning_options=options, tool_options=f.tools.options)


def run_once(family: str, pieces: list[str]) -> float:
    p = parser(family)
    start = time.perf_counter()
    events = []
    for piece in pieces:
        events += p.feed(piece)
    events += p.finish()
    elapsed = time.perf_counter() - start
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert len(calls) == 4 and json.loads(calls[3].arguments) == CALLS[3], (family, calls)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    pieces = {f: tokens(output(f)) for f in FAMILIES}
    best = {f: float("inf") for f in FAMILIES}
    for _ in range(args.repeats):  # round-robin: every family in every round
        for f in FAMILIES:
            best[f] = min(best[f], run_once(f, pieces[f]))
    base = best["qwen3"] / len(pieces["qwen3"])
    rows = []
    for f in FAMILIES:
        per_token = best[f] / len(pieces[f])
        family = builtin_families()[f]
        rows.append({"family": f, "tool_parser": family.tools.parser, "reasoning_parser": family.reasoning.parser,
                     "tokens": len(pieces[f]), "us_per_token": per_token * 1e6, "vs_hermes": per_token / base})
    print(f"{'family':<12} {'tool parser':<15} {'reasoning':<10} {'tokens':>6} {'µs/token':>9} {'× hermes':>9}")
    for r in rows:
        print(f"{r['family']:<12} {r['tool_parser']:<15} {r['reasoning_parser']:<10} {r['tokens']:>6} "
              f"{r['us_per_token']:>9.2f} {r['vs_hermes']:>9.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
