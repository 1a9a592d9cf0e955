"""The parser interface and what every parser shares.

A parser is a small state machine over detokenized text. :meth:`StreamParser.feed`
takes a chunk of any size and returns the events that are already certain;
:meth:`StreamParser.finish` ends the output and returns the rest. Events are
the stream IR types themselves (:class:`~protocols.ir.TextDelta`,
:class:`~protocols.ir.ReasoningDelta`, :class:`~protocols.ir.ToolCallDelta`),
so format stages consume them directly.

Chunking never changes the result: a parser decides only what the text seen so
far decides, and holds back whatever could still turn out differently.
:func:`coalesce` merges adjacent fragments, so ``coalesce(events of any
chunking) == parser.parse(whole text)``.
"""

from __future__ import annotations

import json
import math
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

from protocols.ir import ReasoningDelta, TextDelta, ToolCallDelta

Event = Union[TextDelta, ReasoningDelta, ToolCallDelta]
"""What parsers return: content, reasoning, and tool-call fragments."""

IdFactory = Callable[[], str]
"""Makes one tool-call id per call, in call order."""

_ALNUM = string.ascii_letters + string.digits


def id_factory(prefix: str = "call_", length: int = 24) -> IdFactory:
    """Ids of ``prefix`` and ``length`` random letters and digits (OpenAI: ``call_``,
    Anthropic: ``toolu_``; Mistral templates want 9 characters and no prefix)."""

    def make() -> str:
        return prefix + "".join(secrets.choice(_ALNUM) for _ in range(length))

    return make


new_call_id: IdFactory = id_factory("call_", 24)
"""The default id factory: ``call_`` and 24 random letters and digits."""


class StreamParser(ABC):
    """Text in, events out; the one interface of tool parsers, reasoning parsers and
    their composition :class:`~protocols.parsers.ResponseParser`."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """Add the next chunk of output; return the events it makes certain."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The output ended: return everything still held back."""

    def parse(self, text: str) -> list[Event]:
        """Parse a whole output at once (on a fresh parser). Gives what feeding the same
        text in any chunking gives, after :func:`coalesce`."""
        return coalesce([*self.feed(text), *self.finish()])


class BufferedParser(StreamParser):
    """A state machine that keeps the text it has not decided on in ``_buf``: ``feed`` appends and runs it,
    ``finish`` runs it a last time (``final``: nothing more will come)."""

    _buf: str

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    @abstractmethod
    def _run(self, final: bool) -> list[Event]:
        """Decide what the buffer makes certain (everything, when ``final``)."""


def coalesce(events: Iterable[Event]) -> list[Event]:
    """Merge adjacent text, adjacent reasoning, and consecutive argument fragments of
    one call; drop empty text. The canonical form for comparing event streams."""
    out: list[Event] = []
    for event in events:
        if isinstance(event, (TextDelta, ReasoningDelta)) and not event.text:
            continue
        last = out[-1] if out else None
        if isinstance(event, TextDelta) and isinstance(last, TextDelta):
            out[-1] = TextDelta(last.text + event.text, last.logprobs + event.logprobs)
        elif isinstance(event, ReasoningDelta) and isinstance(last, ReasoningDelta):
            out[-1] = ReasoningDelta(last.text + event.text)
        elif (
            isinstance(event, ToolCallDelta)
            and isinstance(last, ToolCallDelta)
            and event.index == last.index
            and event.id is None
            and event.name is None
        ):
            out[-1] = ToolCallDelta(last.index, last.id, last.name, last.arguments + event.arguments)
        else:
            out.append(event)
    return out


# ---------------------------------------------------------------------------------------
# Tool calls


@dataclass(frozen=True)
class Call:
    """A parsed call: its name, its arguments as a JSON object string, and the id the model
    wrote for it, in formats where the model numbers its own calls (Kimi K2)."""

    name: str
    arguments: str
    id: str | None = None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


JSON = json.JSONDecoder(strict=False, parse_constant=_reject_constant)
"""Lenient about raw control characters in strings (models write real newlines in
code), strict about NaN/Infinity (they would make invalid JSON on the wire)."""


def decode_arguments(value: Any) -> dict[str, Any] | None:
    """Arguments as a dict: an object as is, a JSON string holding an object decoded
    once, absent/empty as ``{}``; anything else is not a call."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = JSON.decode(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def make_call(name: Any, arguments: Any) -> Call | None:
    """A :class:`Call`, or ``None`` when the name or arguments do not make one."""
    if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name.strip()):
        return None
    args = decode_arguments(arguments)
    if args is None or not _finite(args):
        return None
    try:
        text = json.dumps(args, ensure_ascii=False)
    except (TypeError, ValueError):
        return None
    return Call(name.strip(), text)


def call_from_json(obj: Any) -> Call | None:
    """``{"name", "arguments"|"parameters"}`` (or OpenAI's ``{"function": {...}}``)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict) and "name" not in obj:
        obj = obj["function"]
    arguments = obj.get("arguments", obj.get("parameters"))
    return make_call(obj.get("name"), arguments)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_finite(v) for v in value)
    return True


def tool_schemas(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Function name → its ``parameters`` JSON schema, from OpenAI function-tool dicts
    (a bare ``{"name", "parameters"}`` function is accepted too)."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools:
        function = tool.get("function", tool)
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            out[function["name"]] = parameters if isinstance(parameters, Mapping) else {}
    return out


# JSON as models write it (answers and calls), with no free whitespace: a grammar must not let a weak model loop
# on spaces.
JSON_ITEM_SEPARATOR, JSON_KEY_SEPARATOR = ", ", ": "
CALL_JSON_STYLE = {"whitespace_flexible": False, "item_separator": JSON_ITEM_SEPARATOR,
                   "key_separator": JSON_KEY_SEPARATOR}


def forced_call_schema(tools: Mapping[str, Mapping[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call object ``{"name": ..., arguments_key: {...}}`` to one of ``tools``
    (name → parameters schema), for a grammar that forces a tool call."""
    options = [{"type": "object", "additionalProperties": False, "required": ["name", arguments_key],
                "properties": {"name": {"const": name}, arguments_key: dict(parameters) or {"type": "object"}}}
               for name, parameters in tools.items()]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": CALL_JSON_STYLE}


class ToolParser(StreamParser):
    """Base of tool-call parsers: the request's tools, the id factory, call numbering.

    Calls to names that are not among the request's tools are still reported (the
    client decides what to do with them, as with any hallucinated call); their
    values are converted without a schema.

    A format that can be written as a grammar says so in :meth:`forced_call_grammars`: a
    request that forces a call (``tool_choice`` naming a tool, or ``required``) is then
    constrained to one well-formed call whose arguments match the tool's schema.
    """

    reads_reasoning: ClassVar[bool] = False
    """True for a format whose one markup holds reasoning too (harmony): then it reads the whole output."""

    @classmethod
    def forced_call_grammars(cls, tools: Mapping[str, Mapping[str, Any]], **options: Any) -> tuple[str, ...]:
        """Lark grammars (llguidance dialect) for exactly one call to one of ``tools`` (name → parameters
        schema) in the format its ``options`` (a family's ``tools.options``) describe, most faithful first (the next is tried when the model's vocabulary cannot compile one);
        none: the format has no grammar, the choice is only asked for in the prompt."""
        return ()

    def __init__(
        self, tools: Sequence[Mapping[str, Any]] = (), *, id_factory: IdFactory = new_call_id
    ) -> None:
        self.schemas = tool_schemas(tools)
        self._id_factory = id_factory
        self._calls = 0

    def property_schema(self, tool: str, key: str) -> Mapping[str, Any] | None:
        """The JSON schema of parameter ``key`` of ``tool``, if the request declared one."""
        properties = self.schemas.get(tool, {}).get("properties")
        if isinstance(properties, Mapping):
            schema = properties.get(key)
            if isinstance(schema, Mapping):
                return schema
        return None

    def emit_calls(self, calls: Iterable[Call]) -> list[Event]:
        """One :class:`ToolCallDelta` per call, whole: index, id (the model's own, else a fresh
        one), name, arguments."""
        out: list[Event] = []
        for call in calls:
            out.append(ToolCallDelta(self._calls, call.id or self._id_factory(), call.name, call.arguments))
            self._calls += 1
        return out


class NullToolParser(ToolParser):
    """Everything is content."""

    def feed(self, text: str) -> list[Event]:
        return [TextDelta(text)] if text else []

    def finish(self) -> list[Event]:
        return []


def held_suffix(buffer: str, markers: Iterable[str]) -> int:
    """How many trailing characters to hold back: the longest tail that is a proper
    prefix of a marker, with the whitespace before it (whitespace next to markup is
    layout, dropped when the markup turns out to be real)."""
    keep = 0
    for marker in markers:
        tail = buffer[len(buffer) - min(len(marker) - 1, len(buffer)) :]
        at = tail.find(marker[0]) if marker else -1
        while at != -1:  # the leftmost candidate that fits is the longest
            if marker.startswith(tail[at:]):
                keep = max(keep, len(tail) - at)
                break
            at = tail.find(marker[0], at + 1)
    cut = len(buffer) - keep
    while cut > 0 and buffer[cut - 1].isspace():
        cut -= 1
    return len(buffer) - cut
