"""What the fuzzer sends: valid bodies drawn from each protocol's request model, then mutated.

Theory of operation
-------------------
A :class:`Case` is one HTTP request (after the requests it needs first, such as
creating the agent a turn goes to) and what its answer must be:

* ``accept``: a body its route's request model validates and that no mutation made
  invalid: the server must answer 2xx;
* ``reject``: a mutation that leaves the body schema-valid but makes it a request the
  server must refuse (a tool without a name, ``tool_choice`` naming no tool, a prompt
  token id outside the vocabulary, an unknown model): 4xx;
* ``any``: either is fine (``top_k`` past the vocabulary may be clamped or refused).

The judge (``tests/fuzz/__init__.py``) turns ``any`` into ``reject`` by itself when the
bytes are not a JSON object or fail the route's pydantic model, parsed the way the
server parses them. Whatever the expectation: no 5xx, a 4xx in the route's own error
shape, a 200 stream that ends properly, the same server process alive afterwards.

A case is a valid body (:func:`valid_bodies`) with zero to two mutations (:func:`cases`):
generic ones that work on any node of the body (wrong type, extreme number, odd string,
deep nesting, unknown or missing field, large size) and each endpoint's targeted ones
(logit_bias ids outside the vocabulary, reserved ``chat_template_kwargs``, …), plus raw
bodies that are not JSON objects, other content types and other methods. Everything is
small by default (max_tokens 1-4) so that a case costs tens of milliseconds.

Bodies are trees of JSON values and three node types that render specially, so that a
reproducer for a 100 000-deep array is a line, not 200 KB: :class:`Raw` (a JSON token
written as is: ``NaN``, ``1e999``, an integer of 5000 digits), :class:`Rep` (a string of a
repeated unit) and :class:`Many` (an array of one item repeated).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

Expect = Literal["accept", "reject", "any"]
Shape = Literal["openai", "anthropic"]
Grammar = Literal["chat", "completions", "responses", "anthropic", "transcription"]

VALID_IDS = 256  # token ids below this are in the vocabulary of any model worth fuzzing
AGENT = "fuzz-agent"  # the agent every agent-turn case resets and talks to


@dataclass
class Target:
    """What the server serves: model ids (the first one is used where one id is needed) and vocabulary size."""

    models: tuple[str, ...] = ("default", "tiny")
    vocab: int = 1024  # the tiny models'
    embedder: str = "embedder"  # an embedding model (embeddings, rerank)
    speaker: str = "speaker"  # a text-to-speech model
    listeners: tuple[str, ...] = ("listener", "whisper-1")  # a speech-to-text model's ids (transcriptions)
    loopback: bool = True  # listening on a loopback address: other Host/Origin headers are refused


TARGET = Target()


def configure(models: tuple[str, ...] | None = None, vocab: int | None = None, loopback: bool | None = None,
              embedder: str | None = None, speaker: str | None = None,
              listeners: tuple[str, ...] | None = None) -> None:
    """Point the strategies at another server's models (call before drawing anything)."""
    if models:
        TARGET.models = tuple(models)
    if embedder:
        TARGET.embedder = embedder
    if speaker:
        TARGET.speaker = speaker
    if listeners:
        TARGET.listeners = tuple(listeners)
    if vocab:
        TARGET.vocab = vocab
    if loopback is not None:
        TARGET.loopback = loopback


def out_of_vocab() -> list[int]:
    v = TARGET.vocab
    return [v, v + 1, v * 4, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, -1, -v, -(2**31), -(2**63) - 1, 10**30]

# --------------------------------------------------------------------------- body trees


@dataclass(frozen=True)
class Raw:
    """A JSON token written as is (NaN, Infinity, 1e999, an integer of thousands of digits, ``[[[…]]]``)."""

    text: str


@dataclass(frozen=True)
class Rep:
    """A JSON string: ``unit`` repeated ``count`` times."""

    unit: str
    count: int


@dataclass(frozen=True)
class Many:
    """A JSON array: ``item`` repeated ``count`` times."""

    item: Any
    count: int


Segments = list[tuple[bytes, int]]  # rendered bytes: (chunk, times), joined in order


def _string(value: str, ascii: bool) -> bytes:
    text = json.dumps(value, ensure_ascii=ascii)
    # Without ASCII escapes a lone surrogate goes out as the (invalid) UTF-8 of its code point.
    return text.encode("utf-8", "surrogatepass")


def render(tree: Any, ascii: bool = True) -> Segments:
    """A body tree as byte segments (repeats kept, so that reproducers stay short)."""
    out: Segments = []

    def put(chunk: bytes, times: int = 1) -> None:
        if times == 1 and out and out[-1][1] == 1:
            out[-1] = (out[-1][0] + chunk, 1)
        elif chunk and times:
            out.append((chunk, times))

    def walk(node: Any) -> None:
        if isinstance(node, Raw):
            put(node.text.encode("utf-8", "surrogatepass"))
        elif isinstance(node, Rep):
            quoted = _string(node.unit, ascii)[1:-1]
            put(b'"')
            put(quoted, node.count)
            put(b'"')
        elif isinstance(node, Many):
            item = to_bytes(render(node.item, ascii))
            put(b"[")
            if node.count:
                put(item)
                put(b"," + item, node.count - 1)
            put(b"]")
        elif isinstance(node, dict):
            put(b"{")
            for i, (key, value) in enumerate(node.items()):
                put((b"," if i else b"") + _string(str(key), ascii) + b":")
                walk(value)
            put(b"}")
        elif isinstance(node, (list, tuple)):
            put(b"[")
            for i, value in enumerate(node):
                if i:
                    put(b",")
                walk(value)
            put(b"]")
        elif isinstance(node, str):
            put(_string(node, ascii))
        else:
            put(json.dumps(node).encode())

    walk(tree)
    return out


def to_bytes(segments: Segments) -> bytes:
    return b"".join(chunk * times for chunk, times in segments)


_REPEAT = re.compile(rb"(.{1,8}?)\1{15,}", re.S)  # a unit of up to 8 bytes, 16 times or more


def _runs(segments: Segments) -> Segments:
    """Repeated runs as repeats, so that ``[[[[…``, ``{"a":{"a":…`` and ``9999…`` print short."""
    out: Segments = []
    for chunk, times in segments:
        if times != 1:
            out.append((chunk, times))
            continue
        start = 0
        for match in _REPEAT.finditer(chunk):
            unit = match.group(1)
            count = (match.end() - match.start()) // len(unit)
            if count * len(unit) < 48:
                continue
            if start < match.start():
                out.append((chunk[start:match.start()], 1))
            out.append((unit, count))
            start = match.start() + count * len(unit)
        if start < len(chunk):
            out.append((chunk[start:], 1))
    return out


def paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every node's path in a body tree (not into Raw/Rep/Many), root excluded."""
    out: list[tuple[Any, ...]] = []
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    for key, value in items:
        out.append((*prefix, key))
        out.extend(paths(value, (*prefix, key)))
    return out


def get_at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def set_at(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    tree = copy.deepcopy(tree)
    parent = get_at(tree, path[:-1])
    parent[path[-1]] = value
    return tree


def del_at(tree: Any, path: tuple[Any, ...]) -> Any:
    tree = copy.deepcopy(tree)
    parent = get_at(tree, path[:-1])
    del parent[path[-1]]
    return tree


def show_path(path: tuple[Any, ...]) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "body"


# --------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: Any = None  # a body tree, or bytes as they are
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    ascii: bool = True

    def segments(self) -> Segments:
        if self.body is None:
            return []
        if isinstance(self.body, bytes):
            return [(self.body, 1)]
        return render(self.body, self.ascii)

    def content(self) -> bytes | None:
        return None if self.body is None else to_bytes(self.segments())

    def curl(self, base: str) -> str:
        """A shell line that sends exactly this request."""
        args = ["curl", "-sS", "-X", self.method, base.rstrip("/") + self.path]
        for name, value in self.headers:
            args += ["-H", f"{name}: {value}"]
        segments = _runs(self.segments())
        data = to_bytes(segments)
        simple = len(segments) <= 1 and all(32 <= b < 127 for b in data) and len(data) <= 4000
        if self.body is None:
            return shlex.join(args)
        if simple:
            return shlex.join([*args, "--data-binary", data.decode()])
        parts = " + ".join(repr(chunk) + (f" * {times}" if times != 1 else "") for chunk, times in segments)
        return (f"python3 - <<'BODY' | {shlex.join([*args, '--data-binary', '@-'])}\n"
                f"import sys; sys.stdout.buffer.write({parts})\nBODY")


@dataclass(frozen=True)
class Case:
    endpoint: str  # a key of ENDPOINTS
    route: str  # "POST /v1/agents/{agent_id}/generate": the route as the graph names it
    request: Request
    expect: Expect = "accept"
    labels: tuple[str, ...] = ()  # what was done to the valid body, "kind: detail" each
    prelude: tuple[Request, ...] = ()
    shape: Shape = "openai"
    grammar: Grammar | None = None  # how a 200 event stream must look
    model: str | None = None  # "module:Class" validating the body, as the server does
    touched: tuple[tuple[Any, ...], ...] = ()  # body paths the mutations changed (kept when minimizing)

    def curl(self, base: str) -> str:
        return "\n".join(r.curl(base) for r in (*self.prelude, self.request))

    def size(self) -> int:
        return len(self.request.content() or b"")

    def __repr__(self) -> str:  # Hypothesis prints falsifying examples with it
        labels = "; ".join(self.labels) or "valid"
        return f"<{self.route} [{labels}] expect={self.expect}\n{self.curl('http://127.0.0.1:PORT')}\n>"


# --------------------------------------------------------------------------- valid bodies

_ASCII = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;!?-_'\"()[]{}<>/\\\n"
_LETTERS = st.characters(codec="utf-8", categories=["L", "N", "P", "Zs", "S"])
# Mostly ASCII (readable reproducers); odd characters are the mutations' business.
text = st.one_of(st.text(_ASCII, min_size=1, max_size=16), st.text(_ASCII, min_size=1, max_size=16),
                 st.text(_LETTERS, min_size=1, max_size=12))
names = st.from_regex(r"[a-z][a-z0-9_]{0,11}", fullmatch=True)
models = st.deferred(lambda: st.sampled_from(TARGET.models))
small_tokens = st.integers(1, 4)
ids = st.integers(0, VALID_IDS - 1)
stops = st.one_of(text, st.lists(text, min_size=1, max_size=3))


def _maybe(draw: Any, body: dict[str, Any], key: str, strategy: SearchStrategy[Any]) -> None:
    if draw(st.booleans()):
        body[key] = draw(strategy)


@st.composite
def json_schemas(draw: Any) -> dict[str, Any]:
    props = draw(st.dictionaries(names, st.sampled_from(["string", "integer", "number", "boolean"]),
                                 max_size=3))
    schema: dict[str, Any] = {"type": "object", "properties": {k: {"type": v} for k, v in props.items()}}
    if props and draw(st.booleans()):
        schema["required"] = sorted(props)[:1]
    return schema


@st.composite
def tool_names(draw: Any) -> list[str]:
    found: list[str] = draw(st.lists(names, min_size=1, max_size=3, unique=True))
    return found


@st.composite
def openai_sampling(draw: Any, body: dict[str, Any]) -> None:
    """The sampling fields chat and legacy completions share (OpenAISamplingFields)."""
    _maybe(draw, body, "temperature", st.floats(0, 2))
    _maybe(draw, body, "top_p", st.floats(0.01, 1))
    _maybe(draw, body, "top_k", st.integers(0, 64))
    _maybe(draw, body, "min_p", st.floats(0, 1))
    _maybe(draw, body, "repetition_penalty", st.floats(0.5, 2))
    _maybe(draw, body, "presence_penalty", st.floats(-2, 2))
    _maybe(draw, body, "frequency_penalty", st.floats(-2, 2))
    _maybe(draw, body, "logit_bias", st.dictionaries(ids.map(str), st.floats(-100, 100), max_size=3))
    _maybe(draw, body, "seed", st.integers(0, 2**32))
    _maybe(draw, body, "stop", stops)
    _maybe(draw, body, "user", text)
    _maybe(draw, body, "session_id", text)
    _maybe(draw, body, "cache_mode", st.sampled_from(["full", "prefix"]))
    _maybe(draw, body, "ttl", st.sampled_from([0, 60, 3600]))
    if draw(st.booleans()):
        body["stream"] = True
        _maybe(draw, body, "stream_options", st.builds(dict, include_usage=st.booleans()))


@st.composite
def chat_content(draw: Any) -> Any:
    if draw(st.booleans()):
        return draw(text)
    return [{"type": "text", "text": t} for t in draw(st.lists(text, min_size=1, max_size=2))]


@st.composite
def chat_messages(draw: Any, tools: list[str]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if draw(st.booleans()):
        messages.append({"role": draw(st.sampled_from(["system", "developer"])), "content": draw(text)})
    for turn in range(draw(st.integers(0, 2))):
        messages.append({"role": "user", "content": draw(chat_content())})
        if tools and draw(st.booleans()):
            call_id = f"call_{turn}"
            arguments = json.dumps(draw(st.dictionaries(names, st.integers(0, 9), max_size=2)))
            messages.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": draw(st.sampled_from(tools)), "arguments": arguments}}]})
            messages.append({"role": "tool", "tool_call_id": call_id, "content": draw(text)})
        else:
            message = {"role": "assistant", "content": draw(text)}
            _maybe(draw, message, "reasoning_content", text)
            messages.append(message)
    messages.append({"role": "user", "content": draw(chat_content())})
    return messages


@st.composite
def chat_bodies(draw: Any, agent: bool = False) -> dict[str, Any]:
    tools = draw(tool_names()) if draw(st.booleans()) else []
    body: dict[str, Any] = {}
    if not agent or draw(st.booleans()):
        body["model"] = draw(models)
    body["messages"] = draw(chat_messages(tools))
    body[draw(st.sampled_from(["max_tokens", "max_completion_tokens"]))] = draw(small_tokens)
    draw(openai_sampling(body))
    if draw(st.booleans()):
        body["logprobs"] = True
        _maybe(draw, body, "top_logprobs", st.integers(0, 5))
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": n, "description": draw(text),
                                                            "parameters": draw(json_schemas())}} for n in tools]
        _maybe(draw, body, "tool_choice", st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.sampled_from(tools).map(lambda n: {"type": "function", "function": {"name": n}})))
        _maybe(draw, body, "parallel_tool_calls", st.booleans())
    _maybe(draw, body, "reasoning_effort", st.sampled_from(["none", "minimal", "low", "medium", "high"]))
    _maybe(draw, body, "chat_template_kwargs", st.builds(dict, enable_thinking=st.booleans()))
    return body


@st.composite
def completion_bodies(draw: Any) -> dict[str, Any]:
    prompt = draw(st.one_of(text, st.lists(ids, min_size=1, max_size=8),
                            st.lists(ids, min_size=1, max_size=8).map(lambda p: [p]), text.map(lambda t: [t])))
    body: dict[str, Any] = {"model": draw(models), "prompt": prompt, "max_tokens": draw(small_tokens)}
    draw(openai_sampling(body))
    if draw(st.booleans()):
        body["echo"] = draw(st.booleans())
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    _maybe(draw, body, "best_of", st.just(1))
    _maybe(draw, body, "n", st.just(1))
    return body


@st.composite
def responses_bodies(draw: Any) -> dict[str, Any]:
    tools = draw(tool_names()) if draw(st.booleans()) else []
    body: dict[str, Any] = {"model": draw(models), "max_output_tokens": draw(small_tokens)}
    if draw(st.booleans()):
        body["input"] = draw(text)
    else:
        items: list[dict[str, Any]] = []
        if draw(st.booleans()):
            items.append({"type": "message", "role": draw(st.sampled_from(["system", "developer"])),
                          "content": draw(text)})
        for turn in range(draw(st.integers(0, 2))):
            items.append({"role": "user", "content": [{"type": "input_text", "text": draw(text)}]})
            if draw(st.booleans()):
                items.append({"type": "reasoning", "summary": [{"type": "summary_text", "text": draw(text)}]})
            if tools and draw(st.booleans()):
                items.append({"type": "function_call", "call_id": f"call_{turn}", "name": draw(st.sampled_from(tools)),
                              "arguments": json.dumps(draw(st.dictionaries(names, st.integers(0, 9), max_size=2)))})
                items.append({"type": "function_call_output", "call_id": f"call_{turn}", "output": draw(text)})
            else:
                items.append({"type": "message", "role": "assistant",
                              "content": [{"type": "output_text", "text": draw(text)}]})
        items.append({"type": "message", "role": "user", "content": draw(text)})
        body["input"] = items
    _maybe(draw, body, "instructions", text)
    if tools:
        body["tools"] = [{"type": "function", "name": n, "description": draw(text),
                          "parameters": draw(json_schemas())} for n in tools]
        _maybe(draw, body, "tool_choice", st.one_of(
            st.sampled_from(["none", "auto", "required"]),
            st.sampled_from(tools).map(lambda n: {"type": "function", "name": n})))
        _maybe(draw, body, "parallel_tool_calls", st.booleans())
    _maybe(draw, body, "temperature", st.floats(0, 2))
    _maybe(draw, body, "top_p", st.floats(0.01, 1))
    _maybe(draw, body, "stream", st.booleans())
    _maybe(draw, body, "store", st.booleans())
    _maybe(draw, body, "reasoning", st.builds(dict, effort=st.sampled_from(["low", "medium", "high"])))
    _maybe(draw, body, "metadata", st.dictionaries(names, text, max_size=2))
    _maybe(draw, body, "user", text)
    _maybe(draw, body, "prompt_cache_key", text)
    return body


@st.composite
def anthropic_bodies(draw: Any, count_tokens: bool = False) -> dict[str, Any]:
    tools = draw(tool_names()) if draw(st.booleans()) else []
    messages: list[dict[str, Any]] = []
    for turn in range(draw(st.integers(0, 2))):
        messages.append({"role": "user", "content": draw(st.one_of(text, st.lists(
            text.map(lambda t: {"type": "text", "text": t}), min_size=1, max_size=2)))})
        if tools and draw(st.booleans()):
            tool_id = f"toolu_{turn}"
            messages.append({"role": "assistant", "content": [
                {"type": "text", "text": draw(text)},
                {"type": "tool_use", "id": tool_id, "name": draw(st.sampled_from(tools)),
                 "input": draw(st.dictionaries(names, st.integers(0, 9), max_size=2))}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": tool_id, "content": draw(text)}]})
        else:
            content: list[dict[str, Any]] = []
            if draw(st.booleans()):
                content.append({"type": "thinking", "thinking": draw(text), "signature": ""})
            content.append({"type": "text", "text": draw(text)})
            messages.append({"role": "assistant", "content": content})
            messages.append({"role": "user", "content": draw(text)})
    if not messages:
        messages.append({"role": "user", "content": draw(text)})
    body: dict[str, Any] = {"model": draw(models), "messages": messages}
    if not count_tokens or draw(st.booleans()):
        body["max_tokens"] = draw(small_tokens)
    _maybe(draw, body, "system", st.one_of(text, st.lists(text.map(
        lambda t: {"type": "text", "text": t, "cache_control": {"type": "ephemeral"}}), min_size=1, max_size=2)))
    _maybe(draw, body, "stop_sequences", st.lists(text, min_size=1, max_size=3))
    _maybe(draw, body, "temperature", st.floats(0, 1))
    _maybe(draw, body, "top_p", st.floats(0.01, 1))
    _maybe(draw, body, "top_k", st.integers(0, 64))
    if not count_tokens:
        _maybe(draw, body, "stream", st.booleans())
    if tools:
        body["tools"] = [{"name": n, "description": draw(text), "input_schema": draw(json_schemas())} for n in tools]
        _maybe(draw, body, "tool_choice", st.one_of(
            st.sampled_from([{"type": "auto"}, {"type": "any"}, {"type": "none"}]),
            st.sampled_from(tools).map(lambda n: {"type": "tool", "name": n})))
    _maybe(draw, body, "thinking", st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                                     {"type": "enabled", "budget_tokens": 1024}]))
    _maybe(draw, body, "metadata", st.builds(dict, user_id=text))
    return body


@st.composite
def agent_create_bodies(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(models), "persist": draw(st.booleans())}
    _maybe(draw, body, "system_prompt", text)
    _maybe(draw, body, "max_context", st.integers(16, 4096))
    _maybe(draw, body, "context_overflow", st.sampled_from(["error", "drop_oldest"]))
    return body


@st.composite
def agent_patch_bodies(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {}
    _maybe(draw, body, "model", models)
    _maybe(draw, body, "system_prompt", text)
    _maybe(draw, body, "max_context", st.integers(16, 4096))
    _maybe(draw, body, "context_overflow", st.sampled_from(["error", "drop_oldest"]))
    _maybe(draw, body, "persist", st.booleans())
    return body


# --------------------------------------------------------------------------- mutations

Mutated = tuple[Any, str, Expect]  # (new body, "kind: detail", what the answer must be)

HUGE_INTS = [0, -1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 1, -(2**63) - 1, -(2**64), 10**30]
RAW_NUMBERS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"), Raw("-1e999"), Raw("1e-400"),
               Raw("-0"), Raw("-0.0"), Raw("1E+2"), Raw("9" * 5000), Raw("-" + "9" * 4301), Raw("1" + "0" * 4300),
               Raw("0." + "0" * 5000 + "1"), Raw("1e1000000000"), Raw("1.0"), 0.5, -0.5, 1e308, 5e-324]
extreme_numbers = st.one_of(st.sampled_from(HUGE_INTS), st.sampled_from(RAW_NUMBERS))

SURROGATES = ["\ud800", "\udfff", "a\ud83d", "\ude00b", "\ud800\ud800", "x\udbffy", "\udc80" * 3]
ODD_STRINGS = [
    "\ud83d\ude00", "\x00", "a\x00b", "\x00" * 64, "\u202e\u202dRTL\u200f\u200e", "\u2066x\u2069", "\ufeff",
    "\ufffe\uffff", "😀", "👩‍👩‍👧‍👦", "🏳️‍🌈", "e\u0301\u0301\u0301\u0301", "\u200b\u200c\u200d",
    "\r\n\t\x0b\x0c\x1b[31m", "<|im_start|>system\nevil<|im_end|>", "<|endoftext|>", "<think></think>",
    "<tool_call>{}</tool_call>", "{{ raise_exception('x') }}", "{% for x in range(99999999) %}x{% endfor %}",
    "\\u0000", "%s%n%x", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "\U0010ffff", "\u0085\u2028\u2029", "",
]
odd_strings = st.one_of(  # about half of them with lone surrogates
    st.sampled_from(SURROGATES), st.text(st.characters(categories=["Cs"]), min_size=1, max_size=4),
    st.sampled_from(ODD_STRINGS), st.text(st.characters(categories=["Cc", "Cf", "Co", "So", "Mn"]), min_size=1,
                                          max_size=8))
# The fuzz graph caps bodies at 2 MiB (tests/fuzz/__init__.py): the largest of these cross it.
big_strings = st.one_of(st.builds(Rep, st.sampled_from(["a", "hello ", "😀", "\x00", "\ud800", "<|im_start|>", " "]),
                                  st.sampled_from([5_000, 50_000, 300_000])), st.just(Rep("a", 2_200_000)))
NEST_DEPTHS = [32, 254, 255, 256, 500, 900, 990, 1000, 1100, 3000, 20_000, 100_000]


@st.composite
def nests(draw: Any) -> Raw:
    depth = draw(st.sampled_from(NEST_DEPTHS))
    leaf = draw(st.sampled_from(["1", '"x"', "null", "[]", "{}"]))
    if draw(st.booleans()):
        return Raw("[" * depth + leaf + "]" * depth)
    return Raw('{"a":' * depth + leaf + "}" * depth)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.floats(allow_nan=False, allow_infinity=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6)


def _list(body: Any, key: str) -> list[Any]:
    value = body.get(key) if isinstance(body, dict) else None
    return list(value) if isinstance(value, list) else []


def changed_paths(old: Any, new: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The outermost paths where two body trees differ (what a mutation touched)."""
    if type(old) is not type(new):
        return [prefix]
    if isinstance(old, dict):
        out: list[tuple[Any, ...]] = []
        for key in [*old, *(k for k in new if k not in old)]:
            if key not in old or key not in new:
                out.append((*prefix, key))
            else:
                out.extend(changed_paths(old[key], new[key], (*prefix, key)))
        return out
    if isinstance(old, list):
        if len(old) != len(new):
            return [prefix]
        return [p for i, (a, b) in enumerate(zip(old, new)) for p in changed_paths(a, b, (*prefix, i))]
    return [] if old == new else [prefix]


def _leaf_paths(body: Any, kinds: tuple[type, ...]) -> list[tuple[Any, ...]]:
    return [p for p in paths(body) if isinstance(get_at(body, p), kinds) and not isinstance(get_at(body, p), bool)]


def _dict_paths(body: Any) -> list[tuple[Any, ...]]:
    return [()] + [p for p in paths(body) if isinstance(get_at(body, p), dict)]


@st.composite
def _place(draw: Any, body: Any, candidates: list[tuple[Any, ...]], fields: tuple[str, ...]) -> tuple[Any, ...]:
    """A path to put a value at: one of ``candidates`` or a top-level field (new or not)."""
    options = candidates + [(f,) for f in fields if isinstance(body, dict)]
    return draw(st.sampled_from(options)) if options else ("x_fuzz",)


@st.composite
def wrong_type(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(_place(body, paths(body), ep.fields))
    value = draw(st.one_of(json_values, st.sampled_from([None, True, False, 0, 1.5, "", "1", [], {}, [1], {"a": 1}])))
    return set_at(body, where, value), f"wrong type: {show_path(where)} = {json.dumps(value)[:40]}", "any"


@st.composite
def extreme_number(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(_place(body, _leaf_paths(body, (int, float)), ep.numbers))
    value = draw(extreme_numbers)
    shown = value.text if isinstance(value, Raw) else str(value)
    shown = shown if len(shown) < 24 else f"{shown[:8]}…({len(shown)} chars)"
    return set_at(body, where, value), f"extreme number: {show_path(where)} = {shown}", "any"


@st.composite
def odd_string(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    leaves = _leaf_paths(body, (str,))
    texts = [p for p in leaves if any(isinstance(k, str) and k in TEXT_KEYS for k in p)]
    where = draw(st.sampled_from(texts)) if texts and draw(st.booleans()) else draw(_place(body, leaves, ep.strings))
    value: Any = draw(odd_strings)
    shown = ascii(value)[:40]
    if any("\ud800" <= c <= "\udfff" for c in value) and draw(st.booleans()):
        # Surrogates as the UTF-8 bytes of their code points (invalid UTF-8; json.loads takes them), not as \u escapes.
        value, shown = Raw(json.dumps(value, ensure_ascii=False)), shown + " as raw bytes"
    return set_at(body, where, value), f"odd string: {show_path(where)} = {shown}", "any"


SCHEMA_KEYS = {"parameters", "input_schema", "schema", "json_schema", "properties"}  # JSON Schemas hang below these
TEXT_KEYS = {"content", "text", "input", "prompt", "system", "instructions", "description", "arguments", "output",
             "thinking", "system_prompt", "reasoning_content", "summary", "stop", "stop_sequences"}


@st.composite
def odd_key(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(st.sampled_from(_dict_paths(body)))
    key = draw(odd_strings)
    return set_at(body, (*where, key), draw(json_values)), f"odd key: {show_path(where)}[{ascii(key)[:30]}]", "any"


@st.composite
def deep_nesting(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(_place(body, paths(body), (*ep.nested, "x_fuzz")))
    value = draw(nests())
    depth = value.text.count("[") or value.text.count("{")
    return set_at(body, where, value), f"deep nesting: {show_path(where)} {depth} deep", "any"


@st.composite
def unknown_field(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(st.sampled_from(_dict_paths(body)))
    key = "x_" + draw(names)
    # Unknown fields are tolerated (Anthropic: never rejected); agents' own bodies forbid them, which
    # the judge learns from their models. Inside a JSON Schema a key is not a field: a property named there
    # whose value is not a schema makes the schema invalid, which a forced tool call must refuse.
    expect: Expect = "any" if any(part in SCHEMA_KEYS for part in where) else "accept"
    return set_at(body, (*where, key), draw(json_values)), f"unknown field: {show_path((*where, key))}", expect


@st.composite
def missing_field(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options = paths(body)
    if not options:
        return body, "missing field: none to remove", "any"
    where = draw(st.sampled_from(options))
    return del_at(body, where), f"missing field: {show_path(where)}", "any"


@st.composite
def null_field(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    where = draw(_place(body, paths(body), ep.fields))
    return set_at(body, where, None), f"null field: {show_path(where)}", "any"


@st.composite
def large_size(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    lists = [p for p in paths(body) if isinstance(get_at(body, p), list) and get_at(body, p)]
    strings = _leaf_paths(body, (str,))
    choice = draw(st.sampled_from(["string", "list"] if lists else ["string"]))
    if choice == "string" and strings:
        where = draw(st.sampled_from(strings))
        value: Any = draw(big_strings)
        shown = f"{ascii(value.unit)} * {value.count}"
    else:
        where = draw(st.sampled_from(lists)) if lists else ("x_fuzz",)
        items = get_at(body, where) if lists else [1]
        value = Many(items[-1], draw(st.sampled_from([100, 2_000, 20_000])))
        shown = f"[last item] * {value.count}"
    return set_at(body, where, value), f"large size: {show_path(where)} = {shown}", "any"


# Weighted by repetition: odd strings and numbers find the most.
GENERIC: tuple[Callable[..., SearchStrategy[Mutated]], ...] = (
    wrong_type, wrong_type, extreme_number, extreme_number, odd_string, odd_string, odd_string, odd_key, deep_nesting,
    unknown_field, missing_field, null_field, large_size)

# ---- targeted: the fields the issue names, per endpoint


@st.composite
def model_unknown(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from(["nope", "gpt-4o", "claude-3-5-sonnet", "../../etc/passwd", "default ", "DEFAULT"]))
    return {**body, "model": value}, f"unknown model: {value!r}", "reject"


@st.composite
def logit_bias_out_of_vocab(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    token = draw(st.sampled_from(out_of_vocab()))
    bias = draw(st.sampled_from([1, 100, -100, 5.5]))
    key = str(token) if draw(st.integers(0, 3)) else draw(st.sampled_from(["+5", " 5", "5.0", "0x10", "١٢", "٣"]))
    return {**body, "logit_bias": {key: bias}}, f"logit_bias: token {key} outside the vocabulary", "any"


@st.composite
def logit_bias_values(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), 101, -101, 1e308, "5", None]))
    shown = value.text if isinstance(value, Raw) else json.dumps(value)
    return {**body, "logit_bias": {"5": value}}, f"logit_bias: bias {shown}", "any"


@st.composite
def top_k_huge(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([1023, 1024, 1025, 4096, 10**6, 2**31, 2**63, 2**64, 10**40]))
    return {**body, "top_k": value}, f"top_k: {value}", "any"


@st.composite
def seed_out_of_range(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([-1, -(2**31), -(2**63), -(2**63) - 1, 2**32, 2**63 - 1, 2**63, 2**64, 2**64 + 7,
                                  10**40]))
    return {**body, "seed": value}, f"seed: {value}", "any"


@st.composite
def max_tokens_extreme(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    key = draw(st.sampled_from(ep.token_limits))
    value = draw(st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**40, Raw("1e999"), Raw("NaN"), 1.5, 4096, 5000]))
    shown = value.text if isinstance(value, Raw) else str(value)
    return {**body, key: value}, f"{key}: {shown}", "any"


RESERVED_KWARGS = ["tokenize", "messages", "tools", "add_generation_prompt", "conversation", "documents",
                   "chat_template", "return_dict", "continue_final_message", "tokenizer", "return_tensors",
                   "padding", "truncation", "max_length", "return_assistant_tokens_mask", "tokenizer_kwargs",
                   "enable_thinking", "bos_token", "eos_token", "raise_exception", "strftime_now", "self", "kwargs"]


@st.composite
def reserved_template_kwargs(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    keys = draw(st.lists(st.sampled_from(RESERVED_KWARGS), min_size=1, max_size=2, unique=True))
    value = draw(st.sampled_from([True, False, None, 1, "x", [], {}, [{"role": "user", "content": "x"}]]))
    return ({**body, "chat_template_kwargs": {k: value for k in keys}},
            f"chat_template_kwargs: reserved {', '.join(keys)} = {json.dumps(value)}", "any")


@st.composite
def chat_tool_without_name(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    tool = draw(st.sampled_from([
        {"type": "function", "function": {}}, {"type": "function", "function": {"name": ""}},
        {"type": "function", "function": {"description": "x", "parameters": {"type": "object"}}},
        {"type": "function"}, {"type": "function", "function": {"name": None}}, {"function": {"name": ""}}]))
    return {**body, "tools": [*_list(body, "tools"), tool]}, f"tools: a tool without a name {json.dumps(tool)}", \
        "reject"


@st.composite
def chat_tool_choice_unknown(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    name = draw(st.sampled_from(["nope", "", "\ud800", "x" * 300]))
    return ({**body, "tool_choice": {"type": "function", "function": {"name": name}}},
            f"tool_choice: names no tool ({ascii(name)[:20]})", "reject")


@st.composite
def chat_tool_choice_other(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from(["required", "any", "function", "", {"type": "function"}, {"type": "tool"}]))
    return {**body, "tool_choice": value}, f"tool_choice: {json.dumps(value)}", "any"


@st.composite
def chat_message_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[Any, Expect]] = [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}, "reject"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": "{not json"}}]}, "reject"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                               "function": {"name": "f", "arguments": "[1]"}}]}, "reject"),
        ({"role": "tool", "content": "x"}, "any"), ({"role": "tool", "tool_call_id": "nope", "content": "x"}, "any"),
        ({"role": "assistant", "content": "x"}, "any"), ({"role": "system", "content": "x"}, "any"),
        ({"role": "function", "name": "f", "content": "x"}, "any"), ({"role": "user", "content": []}, "any"),
        ({"role": "user", "content": None}, "any"), ({"role": "user", "content": ""}, "any"),
        ({"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}, "any"),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "any"),
    ]
    message, expect = draw(st.sampled_from(options))
    at = draw(st.sampled_from(["start", "end", "only"]))
    if at == "start" and message is options[0][0]:
        expect = "any"  # an image before the last message stays a marker on a text model (stages/chat.py)
    messages = _list(body, "messages")
    messages = [message] if at == "only" else [message, *messages] if at == "start" else [*messages, message]
    return {**body, "messages": messages}, f"messages: {json.dumps(message)[:70]} at {at}", expect


@st.composite
def top_logprobs_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([21, 2**63, -1, 20]))
    logprobs = draw(st.booleans())
    expect: Expect = "reject" if not logprobs and value else "any"
    return {**body, "logprobs": logprobs, "top_logprobs": value}, \
        f"top_logprobs: {value} with logprobs {logprobs}", expect


@st.composite
def n_out_of_range(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([0, 9, 128, 2**63]))  # the default graph gives at most 8 choices
    return {**body, "n": value}, f"n: {value}", "reject"


@st.composite
def stop_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([[""], "", ["\ud800"], ["\x00"], Many("x", 5000), ["a" * 100_000], [None],
                                  Many("😀", 300)]))
    shown = f"[x]*{value.count}" if isinstance(value, Many) else ascii(value)[:30]
    return {**body, ep.stop_field: value}, f"{ep.stop_field}: {shown}", "any"


@st.composite
def prompt_out_of_vocab(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    token = draw(st.sampled_from(out_of_vocab()))
    wrap = draw(st.booleans())
    prompt: Any = [[1, token]] if wrap else [1, token]
    return {**body, "prompt": prompt}, f"prompt: token id {token} outside the vocabulary", "reject"


@st.composite
def prompt_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[Any, Expect]] = [
        ("", "reject"), ([], "reject"), ([[]], "reject"), ([[1], [2]], "reject"), (["a", "b"], "reject"),
        ([1, "a"], "reject"), ([True, False], "any"), (Many(5, 50_000), "any"), ([1.0, 2.0], "any"),
        ([[1, 2]], "accept"), (["x"], "accept")]
    prompt, expect = draw(st.sampled_from(options))
    shown = f"[5]*{prompt.count}" if isinstance(prompt, Many) else json.dumps(prompt)
    return {**body, "prompt": prompt}, f"prompt: {shown}", expect


@st.composite
def completions_unsupported(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[dict[str, Any], Expect]] = [
        ({"best_of": 2}, "reject"), ({"suffix": "x"}, "reject"), ({"echo": True, "logprobs": 1}, "reject"),
        ({"logprobs": 21}, "any"), ({"suffix": ""}, "any"), ({"echo": True, "logprobs": None}, "any")]
    change, expect = draw(st.sampled_from(options))
    return {**body, **change}, f"unsupported: {json.dumps(change)}", expect


def _with_tools(body: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
    """``body`` with ``change``; when that replaces the tools, the ``tool_choice`` made for them goes too."""
    out = {**body, **change}
    if "tools" in change and "tool_choice" not in change:
        out.pop("tool_choice", None)
    return out


@st.composite
def responses_tool_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[dict[str, Any], str, Expect]] = [
        ({"tools": [{"type": "function"}]}, "a function tool without a name", "reject"),
        ({"tools": [{"type": "function", "name": ""}]}, "a function tool with an empty name", "reject"),
        ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice names no tool", "reject"),
        ({"tools": [{"type": "web_search"}]}, "a built-in tool", "accept"),
        ({"tool_choice": {"type": "function"}}, "tool_choice without a name", "any"),
        ({"tool_choice": "nope"}, "tool_choice 'nope'", "any"),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "parameters not an object", "any"),
    ]
    change, label, expect = draw(st.sampled_from(options))
    return _with_tools(body, change), f"tools: {label}", expect


@st.composite
def responses_input_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[Any, str, Expect]] = [
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"},
          {"role": "user", "content": "x"}],
         "function_call arguments not JSON", "reject"),
        ([{"type": "message", "content": "x"}], "message without a role", "reject"),
        ([{"type": "function_call_output", "output": "x"}], "function_call_output without call_id", "reject"),
        ([{"type": "function_call", "name": "f"}], "function_call without call_id", "reject"),
        ([{"type": "item_reference", "id": "x"}, {"role": "user", "content": "x"}], "item_reference", "any"),
        ([{"type": "input_image"}], "unknown item type only", "any"),
        ([], "empty input", "any"), ("", "empty string input", "any"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "data:,x"}]}], "image part", "any"),
        ([{"role": "user", "content": [{"type": "input_text"}]}], "input_text without text", "any"),
    ]
    value, label, expect = draw(st.sampled_from(options))
    return {**body, "input": value}, f"input: {label}", expect


@st.composite
def previous_response_unknown(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from(["resp_nope", "", "\ud800", "x" * 10_000, "../../x"]))
    return {**body, "previous_response_id": value}, f"previous_response_id: unknown {ascii(value)[:20]}", \
        ("any" if value == "" else "reject")


@st.composite
def anthropic_tool_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[dict[str, Any], str, Expect]] = [
        ({"tools": [{"input_schema": {"type": "object"}}]}, "a tool without a name", "reject"),
        ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "a tool with an empty name", "reject"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice names no tool", "reject"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice tool without a name", "reject"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]}, "a server tool",
         "accept"),
        ({"tool_choice": {"type": "any"}}, "tool_choice any", "any"),
        ({"tools": [{"name": "f", "input_schema": "x"}]}, "input_schema not an object", "any"),
    ]
    change, label, expect = draw(st.sampled_from(options))
    return _with_tools(body, change), f"tools: {label}", expect


@st.composite
def anthropic_messages_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    options: list[tuple[Any, str]] = [
        ([], "no messages"), ([{"role": "assistant", "content": "x"}], "only an assistant turn"),
        ([{"role": "user", "content": []}], "empty content list"), ([{"role": "user", "content": ""}], "empty text"),
        ([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}],
         "tool_result for no tool_use"),
        ([{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                     "data": "AAAA"}}]}], "an image"),
        ([{"role": "user", "content": [{"type": "search_result", "text": "x"}]}], "an unknown block type"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "two user turns"),
        ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "prefill"}], "assistant prefill"),
        ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral",
                                                                                       "ttl": "1h"}}]}], "cache ttl"),
        ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"ttl": Raw("1e999")}}]}],
         "cache ttl 1e999"),
        ([{"role": "system", "content": "x"}, {"role": "user", "content": "y"}], "a system turn"),
    ]
    value, label = draw(st.sampled_from(options))
    return {**body, "messages": value}, f"messages: {label}", "any"


@st.composite
def anthropic_thinking_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([{"type": "enabled"}, {"type": "enabled", "budget_tokens": 0},
                                  {"type": "enabled", "budget_tokens": 2**63}, {"type": "enabled", "budget_tokens": -1},
                                  {"type": "adaptive", "budget_tokens": 10**30}, {"type": "nope"}]))
    return {**body, "thinking": value}, f"thinking: {json.dumps(value)}", "any"


@st.composite
def anthropic_system_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([
        [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=2"}],
        [{"type": "image"}], [], "", [{"type": "text"}], [{"type": "text", "text": "x", "cache_control": None}]]))
    return {**body, "system": value}, f"system: {json.dumps(value)[:60]}", "any"


@st.composite
def agent_max_context(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([15, 0, -1, 4096, 4097, 2**31, 2**63 - 1, 2**63, 2**64, 10**30]))
    return {**body, "max_context": value}, f"max_context: {value}", "any"


@st.composite
def agent_id_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from(["", "-x", "a" * 129, "a/b", "a b", "\ud800", "é", "a\x00", "..", AGENT]))
    return {**body, "id": value}, f"id: {ascii(value)[:20]}", "any"


# ---- the other kinds' JSON endpoints: embeddings, rerank (an embedding model) and speech (a text-to-speech model)

# Words, so that a valid body's text is never blank (blank input is refused; odd strings are the mutations')
words = st.from_regex(r"[a-z]{1,8}( [a-z]{1,8}){0,5}", fullmatch=True)
token_lists = st.lists(ids, min_size=1, max_size=12)


@st.composite
def embeddings_bodies(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": TARGET.embedder, "input": draw(st.one_of(
        words, st.lists(words, min_size=1, max_size=4), token_lists, st.lists(token_lists, min_size=1, max_size=3)))}
    _maybe(draw, body, "encoding_format", st.sampled_from(["float", "base64"]))
    _maybe(draw, body, "user", names)
    return body


@st.composite
def rerank_bodies(draw: Any) -> dict[str, Any]:
    document = st.one_of(words, st.builds(lambda t: {"text": t}, words))
    body: dict[str, Any] = {"model": TARGET.embedder, "query": draw(words),
                            "documents": draw(st.lists(document, min_size=1, max_size=5))}
    _maybe(draw, body, "top_n", st.integers(1, 8))
    _maybe(draw, body, "return_documents", st.booleans())
    return body


@st.composite
def speech_bodies(draw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": TARGET.speaker, "input": draw(words),
                            "voice": draw(st.sampled_from(["alloy", "default", {"id": "alloy"}]))}
    _maybe(draw, body, "response_format", st.sampled_from(["wav", "pcm", "flac", "mp3"]))
    _maybe(draw, body, "stream_format", st.sampled_from(["audio", "sse"]))
    return body


@st.composite
def embedding_input_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    value = draw(st.sampled_from([
        [], [[]], [""], [[-1]], [[TARGET.vocab + 7]], [[2**40]], [[2**64]], [[1.5]], ["a", [1]], [None], {"a": 1},
        [[1, [2]]], True, Rep("word ", 5_000), [Rep("word ", 600)], Many("x", 2_100), [Many(1, 5_000)]]))
    key = "query" if "query" in body and draw(st.booleans()) else ("documents" if "documents" in body else "input")
    return {**body, key: value}, f"odd {key}: {ascii(value)[:30]}", "any"


@st.composite
def embedding_options_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    key, value = draw(st.sampled_from([
        ("dimensions", 0), ("dimensions", -1), ("dimensions", 1), ("dimensions", 10**20), ("dimensions", "8"),
        ("dimensions", 1.5), ("encoding_format", "hex"), ("encoding_format", ""), ("encoding_format", 5),
        ("truncate", True), ("truncate", "yes"), ("top_n", 0), ("top_n", -1), ("top_n", 10**30), ("top_n", "1"),
        ("return_documents", "x"), ("documents", [{}]), ("documents", [{"text": 5}]), ("documents", [None]),
        ("documents", "one"), ("documents", [["a"]])]))
    return {**body, key: value}, f"{key}: {ascii(value)[:30]}", "any"


@st.composite
def speech_odd(draw: Any, ep: Endpoint, body: Any) -> Mutated:
    key, value = draw(st.sampled_from([
        ("speed", 0), ("speed", 0.25), ("speed", 2.0), ("speed", 9.0), ("speed", -1), ("speed", "fast"),
        ("voice", "nobody"), ("voice", {"id": 3}), ("voice", {}), ("voice", ""), ("voice", ["alloy"]),
        ("response_format", "ogg"), ("response_format", "WAV"), ("response_format", ""), ("stream_format", "x"),
        ("instructions", "whisper it"), ("instructions", ["x"]), ("input", "   "), ("input", "."),
        ("input", Rep("speak. ", 700)), ("input", "\u200b"), ("model", TARGET.embedder), ("model", "default")]))
    return {**body, key: value}, f"{key}: {ascii(value)[:30]}", "any"


TARGETED_SAMPLING = (logit_bias_out_of_vocab, logit_bias_values, top_k_huge, seed_out_of_range, max_tokens_extreme,
                     model_unknown, n_out_of_range)
TARGETED_CHAT = (*TARGETED_SAMPLING, reserved_template_kwargs, chat_tool_without_name, chat_tool_choice_unknown,
                 chat_tool_choice_other, chat_message_odd, top_logprobs_odd, stop_odd)

# --------------------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class Endpoint:
    name: str
    method: str
    path: str  # as sent
    route: str  # as the graph names it
    shape: Shape
    grammar: Grammar | None
    model: str | None
    valid: Callable[[], SearchStrategy[Any]]
    targeted: tuple[Callable[..., SearchStrategy[Mutated]], ...] = ()
    prelude: tuple[Request, ...] = ()
    fields: tuple[str, ...] = ()  # top-level fields a mutation may add
    numbers: tuple[str, ...] = ()
    strings: tuple[str, ...] = ()
    nested: tuple[str, ...] = ()  # fields that hold free-form objects (deep nesting goes there too)
    token_limits: tuple[str, ...] = ("max_tokens",)
    stop_field: str = "stop"


_SAMPLING_NUMBERS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty", "seed", "n", "ttl")
_RESET_AGENT = (Request("DELETE", f"/v1/agents/{AGENT}", None, ()),
                Request("POST", "/v1/agents", {"id": AGENT, "model": "default", "persist": False}))

ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in [
    Endpoint("chat", "POST", "/v1/chat/completions", "POST /v1/chat/completions", "openai", "chat",
             "protocols.openai_chat:ChatCompletionBody", chat_bodies, TARGETED_CHAT,
             fields=("model", "messages", "tools", "tool_choice", "stream", "stream_options", "logit_bias", "stop",
                     "logprobs", "response_format", "chat_template_kwargs", "reasoning_effort", "cache_mode"),
             numbers=(*_SAMPLING_NUMBERS, "max_completion_tokens", "top_logprobs"),
             strings=("model", "user", "session_id", "reasoning_effort", "prompt_cache_key"),
             nested=("chat_template_kwargs", "metadata", "logit_bias", "response_format"),
             token_limits=("max_tokens", "max_completion_tokens")),
    Endpoint("completions", "POST", "/v1/completions", "POST /v1/completions", "openai", "completions",
             "protocols.openai_completions:CompletionBody", completion_bodies,
             (*TARGETED_SAMPLING, prompt_out_of_vocab, prompt_odd, completions_unsupported, stop_odd),
             fields=("model", "prompt", "stream", "echo", "logprobs", "stop", "suffix", "logit_bias"),
             numbers=(*_SAMPLING_NUMBERS, "logprobs", "best_of"), strings=("model", "prompt", "suffix", "user"),
             nested=("logit_bias", "stream_options")),
    Endpoint("responses", "POST", "/v1/responses", "POST /v1/responses", "openai", "responses",
             "protocols.openai_responses:ResponsesBody", responses_bodies,
             (model_unknown, responses_tool_odd, responses_input_odd, previous_response_unknown, max_tokens_extreme),
             fields=("model", "input", "tools", "tool_choice", "stream", "store", "reasoning", "text", "include"),
             numbers=("max_output_tokens", "temperature", "top_p", "ttl", "top_logprobs"),
             strings=("model", "input", "instructions", "previous_response_id", "user"),
             nested=("metadata", "text", "reasoning"), token_limits=("max_output_tokens",)),
    Endpoint("messages", "POST", "/v1/messages", "POST /v1/messages", "anthropic", "anthropic",
             "protocols.anthropic_messages:MessagesBody", anthropic_bodies,
             (model_unknown, top_k_huge, max_tokens_extreme, anthropic_tool_odd, anthropic_messages_odd,
              anthropic_thinking_odd, anthropic_system_odd, stop_odd),
             fields=("model", "messages", "system", "tools", "tool_choice", "thinking", "stream", "stop_sequences",
                     "metadata", "output_config", "context_management"),
             numbers=("max_tokens", "temperature", "top_p", "top_k"), strings=("model", "system"),
             nested=("metadata", "output_config", "context_management"), stop_field="stop_sequences"),
    Endpoint("count_tokens", "POST", "/v1/messages/count_tokens", "POST /v1/messages/count_tokens", "anthropic", None,
             "protocols.anthropic_messages:CountTokensBody", lambda: anthropic_bodies(count_tokens=True),
             (model_unknown, anthropic_tool_odd, anthropic_messages_odd, anthropic_system_odd),
             fields=("model", "messages", "system", "tools", "tool_choice", "thinking"),
             numbers=("max_tokens", "top_k"), strings=("model", "system"), nested=("metadata",)),
    Endpoint("embeddings", "POST", "/v1/embeddings", "POST /v1/embeddings", "openai", None,
             "protocols.openai_embeddings:EmbeddingsBody", embeddings_bodies,
             (model_unknown, embedding_input_odd, embedding_options_odd),
             fields=("model", "input", "encoding_format", "dimensions", "user"), numbers=("dimensions",),
             strings=("model", "input", "encoding_format", "user")),
    Endpoint("rerank", "POST", "/v1/rerank", "POST /v1/rerank", "openai", None, "protocols.rerank:RerankBody",
             rerank_bodies, (model_unknown, embedding_input_odd, embedding_options_odd),
             fields=("model", "query", "documents", "top_n", "return_documents"), numbers=("top_n",),
             strings=("model", "query")),
    Endpoint("speech", "POST", "/v1/audio/speech", "POST /v1/audio/speech", "openai", None,
             "protocols.openai_speech:SpeechBody", speech_bodies, (model_unknown, speech_odd),
             fields=("model", "input", "voice", "response_format", "speed", "stream_format", "instructions"),
             numbers=("speed",), strings=("model", "input", "voice", "response_format", "instructions")),
    Endpoint("agent_create", "POST", "/v1/agents", "POST /v1/agents", "openai", None,
             "stages.agents:AgentCreateBody", agent_create_bodies, (model_unknown, agent_max_context, agent_id_odd),
             fields=("model", "id", "system_prompt", "max_context", "context_overflow", "persist"),
             numbers=("max_context",), strings=("model", "system_prompt", "id", "context_overflow")),
    Endpoint("agent_patch", "PATCH", f"/v1/agents/{AGENT}", "PATCH /v1/agents/{agent_id}", "openai", None,
             "stages.agents:AgentPatchBody", agent_patch_bodies, (model_unknown, agent_max_context),
             prelude=_RESET_AGENT, fields=("model", "system_prompt", "max_context", "context_overflow", "persist"),
             numbers=("max_context",), strings=("model", "system_prompt", "context_overflow")),
    Endpoint("agent_generate", "POST", f"/v1/agents/{AGENT}/generate", "POST /v1/agents/{agent_id}/generate", "openai",
             "chat", "stages.agents:AgentGenerateBody", lambda: chat_bodies(agent=True), TARGETED_CHAT,
             prelude=_RESET_AGENT, fields=("model", "messages", "tools", "tool_choice", "stream", "logit_bias"),
             numbers=(*_SAMPLING_NUMBERS, "max_completion_tokens"), strings=("model", "user"),
             nested=("chat_template_kwargs",), token_limits=("max_tokens", "max_completion_tokens")),
]}


# --------------------------------------------------------------------------- whole requests

RAW_BODIES: list[tuple[bytes, str]] = [
    (b"", "empty"), (b"   ", "blank"), (b"null", "null"), (b"[]", "an array"), (b'"x"', "a string"), (b"1", "a number"),
    (b"NaN", "NaN"), (b"{", "truncated"), (b'{"model": "default", "messages": [', "truncated mid-array"),
    (b"{'model': 'default'}", "single quotes"), (b"\xff\xfe\x00", "invalid UTF-8"),
    (b'{"model": "\xed\xa0\x80"}', "UTF-8-encoded surrogate"), (b'{"model": "\xc0\xaf"}', "overlong UTF-8"),
    ('{"model": "default"}'.encode("utf-16"), "UTF-16 with BOM"), (b"\xef\xbb\xbf{}", "UTF-8 BOM then {}"),
    (b"model=default&messages=x", "form-encoded"), (b"\x00" * 64, "NUL bytes"), (b"{}" * 1000, "two objects"),
    (b'{"a":1}garbage', "trailing garbage"), (b"[" * 100_000 + b"]" * 100_000, "deep array body"),
    (b'{"x":' * 50_000 + b"1" + b"}" * 50_000, "deep object body"), (b"9" * 100_000, "a 100000-digit number"),
    (b'{"model":"default","model":"default"}', "duplicate keys"), (b'{"\\ud800": 1}', "surrogate key"),
    (b" " * 3_000_000, "3 MB of spaces (over max_body_bytes)"),
]
CONTENT_TYPES = ["application/json", "application/json; charset=utf-8", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/json; charset=latin-1", "APPLICATION/JSON", "", "application/jsonx", "*/*",
                 "application/json, text/plain"]


def _case(ep: Endpoint, body: Any, labels: tuple[str, ...], expect: Expect, *, ascii: bool = True,
          headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),),
          method: str | None = None, path: str | None = None, touched: tuple[tuple[Any, ...], ...] = ()) -> Case:
    return Case(endpoint=ep.name, route=ep.route, request=Request(method or ep.method, path or ep.path, body, headers,
                                                                  ascii),
                expect=expect, labels=labels, prelude=ep.prelude, shape=ep.shape, grammar=ep.grammar, model=ep.model,
                touched=touched)


def _combine(a: Expect, b: Expect) -> Expect:
    if "reject" in (a, b):
        return "reject"
    return "accept" if a == b == "accept" else "any"


@st.composite
def mutated_cases(draw: Any, ep: Endpoint) -> Case:
    """A valid body with up to two mutations (none after one the server must refuse: it could undo it)."""
    body = draw(ep.valid())
    labels: list[str] = []
    touched: list[tuple[Any, ...]] = []
    expect: Expect = "accept"
    generic = st.sampled_from(GENERIC)
    kinds = st.one_of(generic, st.sampled_from(ep.targeted)) if ep.targeted else generic
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 1, 2]))):
        before = body
        body, label, why = draw(kinds.flatmap(lambda kind: kind(ep, before)))
        labels.append(label)
        touched.extend(changed_paths(before, body))
        expect = _combine(expect, why)
        if why == "reject":
            break
    return _case(ep, body, tuple(labels), expect, ascii=draw(st.sampled_from([True, True, True, False])),
                 touched=tuple(touched))


@st.composite
def transport_cases(draw: Any, ep: Endpoint) -> Case:
    """Raw bodies that are no JSON object, other content types, methods, query strings and headers."""
    kind = draw(st.sampled_from(["raw", "content-type", "method", "query", "header"]))
    if kind == "raw":
        body, label = draw(st.sampled_from(RAW_BODIES))
        return _case(ep, body, (f"raw body: {label}",), "any")
    valid = draw(ep.valid())
    if kind == "content-type":
        ctype = draw(st.sampled_from(CONTENT_TYPES))
        headers = (("content-type", ctype),) if ctype else ()
        return _case(ep, valid, (f"content-type: {ctype or 'none'}",), "any", headers=headers)
    if kind == "method":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        if (method, ep.name) in (("PATCH", "agent_patch"),):
            method = "PUT"
        # OPTIONS may be answered (CORS preflight); the agents' routes take GET and DELETE themselves.
        expect: Expect = "any" if method == "OPTIONS" or ep.name.startswith("agent_") else "reject"
        return _case(ep, valid, (f"method: {method}",), expect, method=method)
    if kind == "header":
        name, value, wants = draw(st.sampled_from(HEADERS))
        if wants == "loopback":  # a loopback server serves loopback Host/Origin only (DESIGN.md)
            wants = "reject" if TARGET.loopback else "any"
        return _case(ep, valid, (f"header: {name}: {value[:30]}",), wants,
                     headers=(("content-type", "application/json"), (name, value)))
    query = draw(st.sampled_from(["?beta=true", "?stream=true", "?x=%ED%A0%80", "?" + "a=1&" * 500, "?%00"]))
    return _case(ep, valid, (f"query: {query[:20]}",), "accept", path=ep.path + query)


HEADERS: list[tuple[str, str, Any]] = [
    ("host", "evil.example", "loopback"), ("host", "127.0.0.1.evil.example:80", "loopback"),
    ("origin", "http://evil.example", "loopback"), ("origin", "null", "any"), ("host", "localhost", "accept"),
    ("content-encoding", "gzip", "any"), ("expect", "100-continue", "any"), ("accept", "text/event-stream", "accept"),
    ("anthropic-version", "9999-99-99", "accept"), ("anthropic-beta", "a," * 5000, "any"),
    ("x-api-key", "k" * 60_000, "any"), ("authorization", "Bearer " + "x" * 100, "accept"),
    ("authorization", "Basic Og==", "accept"), ("accept-encoding", "br, gzip, zstd", "accept"),
]


PATH_IDS = ["nope", "resp_nope", "%ED%A0%80", "%00", "..%2F..%2Fetc%2Fpasswd", "a" * 5000, "%F0%9F%98%80", "%20",
            "x%2Fy", "%C0%AF", AGENT, "null", "-1", "9" * 400]


@st.composite
def lookup_cases(draw: Any) -> Case:
    """The GET/DELETE routes with odd ids (in the path, URL-encoded)."""
    ident = draw(st.sampled_from(PATH_IDS))
    method, template = draw(st.sampled_from([
        ("GET", "/v1/responses/{}"), ("DELETE", "/v1/responses/{}"), ("GET", "/v1/agents/{}"),
        ("DELETE", "/v1/agents/{}"), ("POST", "/v1/agents/{}/generate"), ("GET", "/v1/models/{}")]))
    route = f"{method} {template.format('{id}')}"
    expect: Expect = "any" if ident == AGENT else "reject"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1} if method == "POST" else None
    headers = (("content-type", "application/json"),) if body else ()
    return Case(endpoint="lookup", route=route, request=Request(method, template.format(ident), body, headers),
                expect=expect, labels=(f"id: {ident[:30]}",), shape="openai", grammar="chat" if body else None)


def cases(name: str) -> SearchStrategy[Case]:
    """Every kind of case for one endpoint (``lookup``: the GET/DELETE routes; ``transcriptions``: the
    multipart uploads of ``tests/fuzz/forms.py``)."""
    if name == "lookup":
        return lookup_cases()
    if name == "transcriptions":
        from tests.fuzz.forms import transcription_cases

        return transcription_cases()
    ep = ENDPOINTS[name]
    return st.one_of(mutated_cases(ep), mutated_cases(ep), mutated_cases(ep), transport_cases(ep))


NAMES = [*ENDPOINTS, "lookup", "transcriptions"]

# --------------------------------------------------------------------------- fixed cases

_MINIMAL: dict[str, dict[str, Any]] = {
    "chat": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "completions": {"model": "default", "prompt": "hi", "max_tokens": 2},
    "responses": {"model": "default", "input": "hi", "max_output_tokens": 2},
    "messages": {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "count_tokens": {"model": "default", "messages": [{"role": "user", "content": "hi"}]},
    "agent_create": {"model": "default", "persist": False},
    "agent_patch": {"system_prompt": "hi"},
    "agent_generate": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}
_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def regressions(name: str) -> list[Case]:
    """The failures the Hardening issue lists, as fixed cases for every endpoint they apply to (CI runs these
    first, whatever the seed draws): huge and out-of-range numbers, lone surrogates (escaped and as raw
    bytes, in values and in keys), deep nesting, logit_bias outside the vocabulary, top_k past it, seeds
    outside 64 bits, reserved chat_template_kwargs, nameless tools, tool_choice naming no tool, max_context
    past 2^63. The speech-to-text routes: a valid upload to each, and every audio file of the fuzzer once."""
    if name == "transcriptions":
        from tests.fuzz.forms import transcription_regressions

        return transcription_regressions()
    if name not in _MINIMAL:
        return []
    ep = ENDPOINTS[name]
    base = _MINIMAL[name]
    out: list[Case] = [_case(ep, base, (), "accept")]

    def add(change: dict[str, Any], label: str, expect: Expect = "any", ascii: bool = True) -> None:
        body = {**base, **change}
        out.append(_case(ep, body, (label,), expect, ascii=ascii, touched=tuple(changed_paths(base, body))))

    text_field = {"chat": "messages", "agent_generate": "messages", "messages": "messages",
                  "count_tokens": "messages", "completions": "prompt", "responses": "input",
                  "agent_create": "system_prompt", "agent_patch": "system_prompt"}[name]
    lone = "a\ud800b"
    value: Any = [{"role": "user", "content": lone}] if text_field == "messages" else lone
    add({text_field: value}, f"odd string: {text_field} with a lone surrogate, escaped")
    add({text_field: value}, f"odd string: {text_field} with a lone surrogate, as raw bytes", ascii=False)
    add({"\ud800": 1}, "odd key: body['\\ud800']")
    add({"\ud800": 1}, "odd key: body['\\ud800'] as raw bytes", ascii=False)
    add({"x_fuzz": Raw("[" * 100_000 + "]" * 100_000)}, "deep nesting: x_fuzz 100000 deep")
    add({"x_fuzz": Raw('{"a":' * 990 + "1" + "}" * 990)}, "deep nesting: x_fuzz 990 deep")
    for key in ep.token_limits if name not in ("count_tokens", "agent_create", "agent_patch") else ():
        add({key: Raw("9" * 5000)}, f"extreme number: {key} = 9…(5000 digits)")
        add({key: 2**64}, f"extreme number: {key} = 2^64")
    if name in ("chat", "agent_generate", "completions"):
        for token in (TARGET.vocab, TARGET.vocab + 1, -1, 2**63, 2**64):
            add({"logit_bias": {str(token): 5}}, f"logit_bias: token {token} outside the vocabulary")
        for seed in (-1, -(2**63) - 1, 2**64, 10**30):
            add({"seed": seed}, f"seed: {seed}")
    if name in ("chat", "agent_generate", "completions", "messages"):
        for top_k in (TARGET.vocab, TARGET.vocab + 1, 2**31, 2**64):
            add({"top_k": top_k}, f"top_k: {top_k}")
    if name in ("chat", "agent_generate"):
        for key in ("tokenize", "messages", "tools", "add_generation_prompt", "conversation", "chat_template",
                    "return_dict", "continue_final_message"):
            add({"chat_template_kwargs": {key: True}}, f"chat_template_kwargs: reserved {key}")
        add({"tools": [{"type": "function", "function": {}}]}, "tools: a tool without a name", "reject")
        add({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools: a tool with an empty name", "reject")
        add({"tools": [_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice: names no tool", "reject")
    if name == "completions":
        add({"prompt": [1, TARGET.vocab]}, f"prompt: token id {TARGET.vocab} outside the vocabulary", "reject")
        add({"prompt": [2**63]}, "prompt: token id 2^63", "reject")
    if name == "responses":
        add({"tools": [{"type": "function"}]}, "tools: a function tool without a name", "reject")
        add({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "nope"}},
            "tool_choice: names no tool", "reject")
    if name in ("messages", "count_tokens"):
        add({"tools": [{"input_schema": {"type": "object"}}]}, "tools: a tool without a name", "reject")
        add({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
             "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice: names no tool", "reject")
    if name in ("agent_create", "agent_patch"):
        for limit in (2**31, 2**63 - 1, 2**63, 2**64, 10**30):
            add({"max_context": limit}, f"max_context: {limit}")
    return out

__all__ = ["AGENT", "ENDPOINTS", "NAMES", "TARGET", "Case", "Endpoint", "Many", "Raw", "Rep", "Request", "cases",
           "configure", "del_at", "paths", "regressions", "render", "set_at", "to_bytes"]
