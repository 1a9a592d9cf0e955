"""The MiniCPM 5 template of the tiny model, rebuilt (runtime/tiny/templates.py), renders as the real one does.

The expected texts are renders of openbmb/MiniCPM5-2B's own chat_template.jinja (revision cd199ce3, sha256
cc945752…) by transformers 5.6.2, as published with their token ids in github.com/NeelM0906/Mference
(Tests/Mference/Core/Tokenization/Fixtures/MiniCPM5Tokenizer/renders.json): the tools-less, tools, tool-definition
placeholder, call and result, thinking with a call, CDATA and typed value, two calls and <tool_sep> cases.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from runtime.tiny import ensure_tiny_model

TOOLS: Any = [
    {"function": {"description": "Get the current weather for a city.", "name": "get_weather", "parameters": {
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"], "type": "string"}},
        "required": ["city"], "type": "object"}}, "type": "function"},
    {"function": {"description": "Run a snippet & return stdout.", "name": "run_code", "parameters": {
        "properties": {"code": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["code"], "type": "object"}}, "type": "function"},
]
TOOL_DEFINITIONS = (
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + "\n".join(json.dumps(t) for t in TOOLS)
    + "\n</tools>\n\nTool usage guidelines:\n- You may call zero or more functions. If no function calls are needed, "
    "just answer normally and do not include any <function ... </function>.\n- When calling a function, return an "
    'XML object within <function ... </function> using:\n<function name="function-name"><param name="param-name">'
    "param-value</param></function>\n- param-value may be multi-line. If it contains <, & or newline characters, "
    'wrap it in a CDATA block: <param name="param-name"><![CDATA[...multi-line value...]]></param>'
)
SYSTEM = "<s><|im_start|>system\n" + TOOL_DEFINITIONS + "<|im_end|>\n"
OPEN = "<|im_start|>assistant\n<think>\n"
EMPTY_THINK = "<think>\n\n</think>\n\n"


def call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


CASES: list[tuple[str, list[dict[str, Any]], Any, bool | None, str]] = [
    ("thinking undefined", [{"role": "user", "content": "Hi"}], None, None,
     "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("thinking off", [{"role": "user", "content": "Hi"}], None, False,
     "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK),
    ("an earlier answer without thinking", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}], None, True,
     "<s><|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
     "<|im_start|>assistant\n" + EMPTY_THINK + "Blue.<|im_end|>\n<|im_start|>user\nAnother?<|im_end|>\n" + OPEN),
    ("earlier answers keep their thinking", [
        {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nfirst\n</think>\n\nA1"},
        {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "<think>\nsecond\n</think>\n\nA2"},
        {"role": "user", "content": "Q3"}], None, False,
     "<s><|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n<think>\nfirst\n</think>\n\nA1<|im_end|>\n"
     "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\nsecond\n</think>\n\nA2<|im_end|>\n"
     "<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK),
    ("tools after a system message", [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "Weather in Paris?"}], TOOLS, True,
     "<s><|im_start|>system\nBe brief.\n\n" + TOOL_DEFINITIONS + "<|im_end|>\n<|im_start|>user\nWeather in Paris?"
     "<|im_end|>\n" + OPEN),
    ("tools in place of <tool_def_sep>", [{"role": "system", "content": "Intro.\n<tool_def_sep>\nOutro."},
                                          {"role": "user", "content": "Weather in Paris?"}], TOOLS, True,
     "<s><|im_start|>system\nIntro.\n" + TOOL_DEFINITIONS + "\nOutro.<|im_end|>\n<|im_start|>user\nWeather in Paris?"
     "<|im_end|>\n" + OPEN),
    ("a call with CDATA and a number, its result", [
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": "Running now.",
         "tool_calls": [call("run_code", {"code": "print(1 < 2 & 3)\nprint('x')", "timeout": 5})]},
        {"role": "tool", "content": "True\nx", "tool_call_id": "c"},
        {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}], TOOLS, False,
     SYSTEM + "<|im_start|>user\nRun it.<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK + "Running now.\n"
     "<function name=\"run_code\"><param name=\"code\"><![CDATA[print(1 < 2 & 3)\nprint('x')]]></param>"
     "<param name=\"timeout\">5</param></function><|im_end|>\n<|im_start|>user\n<tool_response>\nTrue\nx\n"
     "</tool_response><|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK + "Done.<|im_end|>\n<|im_start|>user\n"
     "Thanks<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK),
    ("thinking, content and a call", [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "<think>\nneed the tool\n</think>\n\nChecking.",
         "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "content": "cold", "tool_call_id": "c"}], TOOLS, True,
     SYSTEM + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n<think>\nneed the tool\n</think>\n\n"
     'Checking.\n<function name="get_weather"><param name="city">Oslo</param></function><|im_end|>\n'
     "<|im_start|>user\n<tool_response>\ncold\n</tool_response><|im_end|>\n" + OPEN),
    ("two calls after <tool_sep>, two results in one turn", [
        {"role": "user", "content": "Both."},
        {"role": "assistant", "content": "First<tool_sep>then",
         "tool_calls": [call("get_weather", {"city": "Rome"}), call("run_code", {"code": "2*2"})]},
        {"role": "tool", "content": "rain", "tool_call_id": "c"},
        {"role": "tool", "content": "4", "tool_call_id": "c"}],
     TOOLS, True,
     SYSTEM + "<|im_start|>user\nBoth.<|im_end|>\n<|im_start|>assistant\n" + EMPTY_THINK + "First\n"
     '<function name="get_weather"><param name="city">Rome</param></function>\n<function name="run_code">'
     '<param name="code">2*2</param></function><|im_end|>\n<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n'
     "<tool_response>\n4\n</tool_response><|im_end|>\n" + OPEN),
]


@pytest.mark.parametrize("messages, tools, thinking, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_renders_as_the_real_template(messages: list[dict[str, Any]], tools: Any, thinking: bool | None,
                                      expected: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny_model("tiny-minicpm5"))
    kwargs: dict[str, Any] = {} if thinking is None else {"enable_thinking": thinking}
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text == expected
