"""Chat-template input for one family: messages, tools and kwargs as its template wants them.

Protocol decoders produce template-shaped messages (OpenAI style: ``tool_calls``
with dict arguments, ``tool`` messages with ``tool_call_id``). Families differ
in what their templates accept, and :func:`template_inputs` adapts:

* **tool delivery** — ``template``: ``tools=`` goes to the template;
  ``injected``: the tools are described in the system message (the family's
  prompt) and earlier calls are written back as text in the syntax the
  family's parser reads, so the model sees its own format; ``system``: the
  tools are described in the system message and earlier calls still go to the
  template, which renders them (DeepSeek V3.1's renders calls but not tools);
* **call arguments** — ``string``: earlier calls' arguments as JSON text, for
  templates that concatenate them;
* **tool results** — ``tool_role = "user"``: results become user turns (merged
  with neighbouring user turns, since such templates insist on alternation);
* **call ids** — ``alnum9``: ids are rewritten, consistently within the
  request, to the 9 letters and digits Mistral templates demand;
* **system turns after the first** (Claude Code sends some mid-conversation) —
  kept where the family's template renders them, else folded into the
  neighbouring user turn;
* **one call per message** — multi-call assistant turns are split, each call
  followed by its own result (Llama 3.1 refuses more than one);
* **thinking** — the request's on/off goes to the family's template switch, and its
  reasoning effort (low/medium/high) to the family's effort key (gpt-oss), its thinking
  budget in tokens to the budget key (Seed-OSS; 0 when thinking is off); earlier
  turns' reasoning goes under the key the template reads (gpt-oss: ``thinking``);
* **tool_choice** — ``none`` hides the tools; ``required`` or a named tool adds
  an instruction (local models have no constrained decoding to force it).
"""

from __future__ import annotations

import hashlib
import json
import string
from typing import Any

from flow.catalog.families import Family
from protocols.ir import ChatRequest, content_parts
from protocols.parsers.sectioned import CALL, SECTION, SEPARATOR

_ALNUM = string.ascii_letters + string.digits


def alnum9(call_id: str) -> str:
    """A stable 9-character alphanumeric id for any id."""
    number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    out = ""
    for _ in range(9):
        number, digit = divmod(number, len(_ALNUM))
        out += _ALNUM[digit]
    return out


def render_calls(parser: str, calls: list[dict[str, Any]], options: dict[str, Any] | None = None) -> str:
    """Earlier tool calls as text, in the syntax ``parser`` with the family's ``options`` reads (for injected
    delivery)."""
    pairs = [(c["function"]["name"], c["function"].get("arguments") or {}) for c in calls]
    start = (options or {}).get("start", "<tool_call>")
    if parser == "hermes_json" and start != "<tool_call>":  # a JSON list behind the family's marker (Phi-4-mini)
        listed = json.dumps([{"name": n, "arguments": a} for n, a in pairs])
        end = str((options or {}).get("end", ""))
        return str(start[:-1] if start.endswith("[") else start) + listed + end
    if parser == "sectioned_json":  # DeepSeek V3/R1's layout: the call type, the name, fenced JSON
        section, call = SECTION, CALL
        sep = str((options or {}).get("separator", SEPARATOR))
        section = tuple((options or {}).get("section", section))
        call = tuple((options or {}).get("call", call))
        body = "\n".join(f"{call[0]}function{sep}{n}\n```json\n{json.dumps(a)}\n```{call[1]}" for n, a in pairs)
        return f"{section[0]}{body}{section[1]}"
    if parser == "pythonic":
        return "[" + ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in pairs) + "]"
    if parser == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in pairs)
    if parser == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in pairs])
    return "\n".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in pairs)


def tool_prompt(family: Family, tools: tuple[dict[str, Any], ...]) -> str:
    functions = [t.get("function", t) for t in tools]
    described = "\n".join(json.dumps(f) for f in functions)
    return family.tools.prompt.format(tools=described, tools_json=json.dumps(functions, ensure_ascii=False),
                                      call_format=family.tools.call_format)


def _choice_instruction(choice: str | dict[str, Any] | None) -> str:
    if choice == "required":
        return "You must answer with at least one function call."
    if isinstance(choice, dict) and choice.get("name"):
        return f"You must answer with a call to the function {choice['name']}."
    return ""


def _split_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns with several calls → one call per turn, each followed by its result."""
    out: list[dict[str, Any]] = []
    i = 0
    while i < len(messages):
        msg = messages[i]
        calls = msg.get("tool_calls") or []
        if msg["role"] != "assistant" or len(calls) < 2:
            out.append(msg)
            i += 1
            continue
        results: dict[str, dict[str, Any]] = {}
        j = i + 1
        while j < len(messages) and messages[j]["role"] == "tool":
            results[messages[j].get("tool_call_id", f"#{j}")] = messages[j]
            j += 1
        leftovers = list(results.values())
        for k, call in enumerate(calls):
            out.append({**msg, "content": msg.get("content", "") if k == 0 else "", "tool_calls": [call]})
            result = results.get(call.get("id", ""))
            if result is None and leftovers:
                result = leftovers[0]  # results without matching ids keep their order
            if result is not None:
                leftovers.remove(result)
                out.append(result)
        out.extend(leftovers)
        i = j
    return out


def _merge_users(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in messages:
        if out and msg["role"] == "user" and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{msg['content']}"}
        else:
            out.append(msg)
    return out


def _string_arguments(call: dict[str, Any]) -> dict[str, Any]:
    """A call whose arguments are JSON text, for templates that concatenate them (DeepSeek's)."""
    function = call.get("function")
    if isinstance(function, dict) and not isinstance(function.get("arguments"), str):
        return {**call, "function": {**function, "arguments": json.dumps(function.get("arguments") or {},
                                                                          ensure_ascii=False)}}
    return call


def _described(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool with a ``description`` (empty when the client sent none): templates index it, and
    gpt-oss's concatenates it, which fails on a missing one."""
    function = tool.get("function")
    if isinstance(function, dict) and "description" not in function:
        return {**tool, "function": {**function, "description": ""}}
    return tool


_EFFORTS = ("low", "medium", "high")


def _graded_effort(request: ChatRequest) -> str | None:
    """The request's reasoning effort as templates grade it: low / medium / high. Thinking switched off (effort
    ``none``/``minimal``, Anthropic's ``disabled``) is the lowest grade: such models always reason a little."""
    effort = (request.reasoning_effort or "").lower()
    if effort in _EFFORTS:
        return effort
    if effort == "xhigh" or effort == "max":
        return "high"
    return "low" if request.thinking is False else None


def template_inputs(request: ChatRequest, family: Family, template: str | None, vision: bool = False) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]:
    """``(messages, tools, kwargs)`` for ``apply_chat_template``. For a model that reads images (``vision``),
    every content becomes a list of text and image parts, as multimodal templates expect; otherwise each image
    is a marker in the text."""
    # Contents stay strings (images as slots) through the family's adaptations, which edit text.
    messages = [{**m.to_template(), "content": m.template_content(vision)} for m in request.messages]
    tools = list(request.tools) if request.tool_choice != "none" else []
    delivery = family.tools.delivery
    if delivery == "auto":
        delivery = "template" if template and "tools" in template else "injected"

    if family.tools.call_ids == "alnum9":
        for msg in messages:
            if msg.get("tool_calls"):
                msg["tool_calls"] = [{**c, "id": alnum9(c.get("id", ""))} for c in msg["tool_calls"]]
            if msg.get("tool_call_id"):
                msg["tool_call_id"] = alnum9(msg["tool_call_id"])
    if family.tools.one_call_per_message:
        messages = _split_calls(messages)
    if family.reasoning.history_field != "reasoning_content":
        key = family.reasoning.history_field
        messages = [{key if k == "reasoning_content" else k: v for k, v in m.items()} for m in messages]

    if family.tools.arguments == "string":
        for msg in messages:
            if msg.get("tool_calls"):
                msg["tool_calls"] = [_string_arguments(c) for c in msg["tool_calls"]]

    system_extra = [_choice_instruction(request.tool_choice) if tools else ""]
    if delivery in ("injected", "system") and tools:
        system_extra.insert(0, tool_prompt(family, tuple(tools)))
    if delivery == "injected" or family.tools.calls_as_text:
        for msg in messages:
            calls = msg.pop("tool_calls", None)
            if calls:
                text = render_calls(family.tools.parser, calls, family.tools.options)
                msg["content"] = f"{msg['content']}\n{text}" if msg.get("content") else text
    merge = family.tools.tool_role == "user"  # such templates insist on alternating turns
    if family.mid_system == "user":
        for k, msg in enumerate(messages[1:], start=1):
            if msg["role"] in ("system", "developer"):
                messages[k] = {"role": "user", "content": msg["content"]}
                merge = True
    if family.tools.tool_role == "user":
        for k, msg in enumerate(messages):
            if msg["role"] == "tool":
                name = f' name="{msg["name"]}"' if msg.get("name") else ""
                messages[k] = {"role": "user", "content": f"<tool_response{name}>\n{msg['content']}\n</tool_response>"}
    if merge:
        messages = _merge_users(messages)
    switch = family.reasoning.switch
    if switch and request.thinking is not None:  # the template reads the word, not a kwarg
        system_extra.append(switch[0] if request.thinking else switch[1])
    extra = "\n\n".join(s for s in system_extra if s)
    if extra:
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{extra}"}
        else:
            messages.insert(0, {"role": "system", "content": extra})

    if vision:  # multimodal templates (SmolVLM's) iterate over parts: every content becomes a list
        messages = [{**m, "content": content_parts(m["content"]) or [{"type": "text", "text": ""}]}
                    if isinstance(m.get("content"), str) else m for m in messages]
    kwargs = dict(request.chat_template_kwargs)
    toggle = family.reasoning.toggle
    if toggle and request.thinking is not None:
        kwargs.setdefault(toggle, request.thinking)
    effort = _graded_effort(request)
    if family.reasoning.effort and effort is not None:
        kwargs.setdefault(family.reasoning.effort, effort)
    budget = 0 if request.thinking is False else request.reasoning_budget
    if family.reasoning.budget and budget is not None:
        kwargs.setdefault(family.reasoning.budget, budget)
    return messages, ([_described(t) for t in tools] if delivery == "template" and tools else None), kwargs
