"""Ollama's native API on the shared inference path: ``/api/chat``, ``/api/generate`` and ``/api/embed``.

Bodies follow Ollama's API documentation (and the ``ollama`` Python client's models): ``stream`` defaults to
**true** and streams are newline-delimited JSON objects (``application/x-ndjson``), the last with ``done: true``,
``done_reason`` and the counts (``prompt_eval_count``, ``eval_count``) and durations in nanoseconds. ``options``
maps to sampling (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``, ``num_predict``,
``repeat_penalty``/``repeat_last_n``, ``presence_penalty``, ``frequency_penalty``, ``num_ctx``); unset options
take Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9). ``format`` is ``"json"`` or a JSON schema
(structured output); ``think`` switches a reasoning model's thinking (``thinking`` fields carry it back);
``tools`` are OpenAI-shaped, and tool calls come back as ``message.tool_calls`` with arguments as objects.
Errors are ``{"error": "..."}`` with the status code (a stream that fails after it began ends with such a line).
"""

from __future__ import annotations

import re

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols.errors import STATUS, ApiError
from protocols.ir import (
    IMAGE_SLOT,
    ChatRequest,
    EmbeddingRequest,
    Embeddings,
    FinalResult,
    ImageSource,
    Message,
    ProtocolContext,
    ReasoningDelta,
    ResponseFinished,
    ResponseFormat,
    ResponseStarted,
    SamplingParams,
    StreamEvent,
    TextDelta,
    ToolCallDelta,
    Usage,
    without_slots,
)
from protocols.images import source_from_base64
from protocols.sse import FrameTemplate, dumps
from protocols.validation import json_object_argument, parse_json_body

NDJSON_HEADERS = (("content-type", "application/x-ndjson"),)
DEFAULTS = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "repeat_last_n": 64}  # Ollama's own defaults


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")  # clients send fields of newer Ollama versions


class Options(_Lenient):
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = None
    stop: list[str] | str | None = None
    num_predict: int | None = None
    num_ctx: int | None = Field(default=None, ge=1)
    repeat_penalty: float | None = Field(default=None, gt=0)
    repeat_last_n: int | None = Field(default=None, ge=-1)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: dict[str, Any] | str | None = None


class ToolCallIn(_Lenient):
    function: FunctionCall


class MessageIn(_Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_name: str | None = None


class _GenerateFields(_Lenient):
    model: str = Field(min_length=1)
    stream: bool = True
    format: Literal["", "json"] | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: float | str | None = None  # seconds or a duration ("5m"): how long the model stays loaded once idle
    think: bool | Literal["low", "medium", "high"] | None = None


class ChatBody(_GenerateFields):
    messages: list[MessageIn] = Field(default_factory=list)  # none: load the model (or unload, keep_alive 0)
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_GenerateFields):
    prompt: str = ""  # empty, with no images: load the model (or unload, keep_alive 0)
    system: str | None = None
    suffix: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None


class EmbedBody(_Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    dimensions: int | None = Field(default=None, ge=1)
    truncate: bool | None = None


@dataclass(frozen=True)
class OllamaContext(ProtocolContext):
    """What the exit needs besides the events: which response shape (chat or generate), when it began."""

    endpoint: Literal["chat", "generate"] = "chat"
    started_ns: int = field(default_factory=time.monotonic_ns)


def _sampling(options: Options) -> SamplingParams:
    window = options.repeat_last_n if options.repeat_last_n not in (None, -1, 0) else DEFAULTS["repeat_last_n"]
    return SamplingParams(
        temperature=DEFAULTS["temperature"] if options.temperature is None else options.temperature,
        top_p=DEFAULTS["top_p"] if options.top_p is None else options.top_p,
        top_k=int(DEFAULTS["top_k"]) if options.top_k is None else options.top_k,
        min_p=options.min_p or 0.0,
        repetition_penalty=options.repeat_penalty if options.repeat_penalty not in (None, 1.0) else None,
        repetition_context_size=int(window),
        presence_penalty=options.presence_penalty or None,
        frequency_penalty=options.frequency_penalty or None,
        seed=options.seed,
    )


def _response_format(value: str | dict[str, Any] | None) -> ResponseFormat | None:
    if not value:
        return None
    if value == "json":
        return ResponseFormat("json_object")
    assert isinstance(value, dict)
    return ResponseFormat("json_schema", schema=value, name="format")


_DURATION = re.compile(r"(-?\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number of seconds, or a Go duration (``"5m"``, ``"1h30m"``, ``"-1"``
    ); negative keeps the model loaded, 0 unloads it once idle. Anything else is a 400 saying what is accepted."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.replace(" ", ""):
        raise ApiError("invalid_request", f"'keep_alive' {value!r} is not a duration; give seconds (300) or a "
                       "duration such as \"5m\", \"1h\", \"30s\" (negative: keep loaded; 0: unload now).",
                       param="keep_alive")
    return sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)


def _request(body: _GenerateFields, messages: tuple[Message, ...], request_id: str, created: int,
             endpoint: Literal["chat", "generate"], **extra: Any) -> ChatRequest:
    options = body.options or Options()
    stops = [options.stop] if isinstance(options.stop, str) else list(options.stop or ())
    if any(not s for s in stops):
        raise ApiError("invalid_request", "'options.stop' must not hold empty strings.", param="options.stop")
    return ChatRequest(
        model=body.model,
        messages=messages,
        max_tokens=options.num_predict if options.num_predict is not None and options.num_predict > 0 else None,
        sampling=_sampling(options),
        stop=tuple(stops),
        stream=body.stream,
        include_usage=True,
        response_format=_response_format(body.format),
        thinking=None if body.think is None else body.think is not False,
        reasoning_effort=body.think if isinstance(body.think, str) else None,  # gpt-oss grades its reasoning
        max_context=options.num_ctx,
        keep_alive=keep_alive_seconds(body.keep_alive),
        request_id=request_id,
        created=created,
        context=OllamaContext(endpoint),
        **extra,
    )


def _message(msg: MessageIn, index: int) -> Message:
    where = f"messages[{index}]"
    extra: list[tuple[str, Any]] = []
    if msg.tool_calls:
        extra.append(("tool_calls", [
            {"id": f"call_{index}_{j}", "type": "function", "function": {
                "name": call.function.name,
                "arguments": json_object_argument(call.function.arguments, f"{where}.tool_calls[{j}].function.arguments"),
            }} for j, call in enumerate(msg.tool_calls)]))
    if msg.thinking:
        extra.append(("reasoning_content", msg.thinking))
    attached = _images(msg.images, f"{where}.images")
    content = without_slots(msg.content or "") + IMAGE_SLOT * len(attached)  # Ollama's images follow the text
    return Message(role=msg.role, content=content, name=msg.tool_name, extra=tuple(extra), images=attached)


def _images(images: list[str] | None, where: str) -> tuple[ImageSource, ...]:
    return tuple(source_from_base64(data, f"{where}[{i}]") for i, data in enumerate(images or ()))


def decode_chat_request(body: bytes, request_id: str, created: int) -> ChatRequest:
    parsed = parse_json_body(ChatBody, body)
    if not parsed.messages:
        return _request(parsed, (), request_id, created, "chat", load_only=True)
    return _request(parsed, tuple(_message(m, i) for i, m in enumerate(parsed.messages)), request_id, created,
                    "chat", tools=tuple(parsed.tools or ()))


def decode_generate_request(body: bytes, request_id: str, created: int) -> ChatRequest:
    parsed = parse_json_body(GenerateBody, body)
    if not parsed.prompt and not parsed.images:
        return _request(parsed, (), request_id, created, "generate", load_only=True)
    if parsed.suffix:
        raise ApiError("invalid_request", "'suffix' (fill-in-the-middle) is not supported; send the prompt only.",
                       param="suffix")
    if parsed.template:
        raise ApiError("invalid_request", "'template' (a Go prompt template) is not supported: prompts use the "
                       "model's own chat template, or none with \"raw\": true.", param="template")
    if parsed.raw:
        if parsed.images:
            raise ApiError("invalid_request", "'images' need the model's chat template; a raw prompt has none.",
                           param="images")
        return _request(parsed, (), request_id, created, "generate", prompt=parsed.prompt)
    system = (Message("system", without_slots(parsed.system)),) if parsed.system else ()
    attached = _images(parsed.images, "images")
    user = Message("user", without_slots(parsed.prompt) + IMAGE_SLOT * len(attached), images=attached)
    return _request(parsed, (*system, user), request_id, created, "generate")


def decode_embed_request(body: bytes, request_id: str) -> EmbeddingRequest:
    parsed = parse_json_body(EmbedBody, body)
    inputs = [parsed.input] if isinstance(parsed.input, str) else list(parsed.input)
    if not inputs or any(not text for text in inputs):
        raise ApiError("invalid_request", "'input' must be a non-empty string or a list of them.", param="input")
    return EmbeddingRequest(model=parsed.model, inputs=tuple(inputs), dimensions=parsed.dimensions,
                            request_id=request_id)


# --------------------------------------------------------------------------- responses


_second: tuple[int, str] = (-1, "")  # the last whole second stamped, and its text


def created_at() -> str:
    """Now in UTC, as Ollama stamps each line (``2026-11-28T07:50:01.123456Z``). Streams stamp every token: the
    date and time are formatted once a second, only the microseconds each time."""
    global _second
    second, fraction = divmod(time.time_ns() // 1000, 1_000_000)
    if _second[0] != second:
        _second = (second, datetime.fromtimestamp(second, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second[1]}.{fraction:06d}Z"


def _line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


def _call_json(name: str, arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        parsed = {}
    return {"function": {"name": name, "arguments": parsed if isinstance(parsed, dict) else {}}}


def _stats(usage: Usage, started_ns: int, first_ns: int | None, done_ns: int) -> dict[str, Any]:
    out: dict[str, Any] = {"total_duration": done_ns - started_ns, "load_duration": 0,
                           "prompt_eval_count": usage.prompt_tokens, "eval_count": usage.completion_tokens}
    if first_ns is not None:
        out["prompt_eval_duration"] = first_ns - started_ns
        out["eval_duration"] = done_ns - first_ns
    return out


def _done_reason(request: ChatRequest, finish_reason: str) -> str:
    if request.load_only:
        return "unload" if request.keep_alive == 0 else "load"
    return "length" if finish_reason == "length" else "stop"


def _piece(request: ChatRequest, text: str = "", thinking: str = "",
           tool_calls: list[dict[str, Any]] | None = None, stamp: str | None = None) -> dict[str, Any]:
    """One response object's content, in the endpoint's shape; ``stamp``: its ``created_at`` (default: now)."""
    base: dict[str, Any] = {"model": request.model, "created_at": created_at() if stamp is None else stamp}
    if request.context_as(OllamaContext).endpoint == "generate":
        base["response"] = text
        if thinking:
            base["thinking"] = thinking
        return base
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        message["thinking"] = thinking
    if tool_calls:
        message["tool_calls"] = tool_calls
    base["message"] = message
    return base


def encode_final(result: FinalResult) -> dict[str, Any]:
    request = result.request
    context = request.context_as(OllamaContext)
    calls = [_call_json(c.name, c.arguments) for c in result.tool_calls]
    body = _piece(request, result.text, result.reasoning, calls)
    body.update(done=True, done_reason=_done_reason(result.request, result.finish_reason),
                **_stats(result.usage, context.started_ns, None, time.monotonic_ns()))
    return body


class StreamEncoder:
    """NDJSON lines: one per piece of content or thinking, tool calls when the output ends, then ``done``."""

    def __init__(self, started: ResponseStarted) -> None:
        self.request = started.request
        self.context = self.request.context_as(OllamaContext)
        self.first_ns: int | None = None
        self.calls: dict[int, list[str]] = {}  # index → [name, arguments so far]
        self._pieces: dict[bool, FrameTemplate] = {}  # thinking or not → a piece's line, from its stamp and text

    def start(self) -> list[bytes]:
        return []

    def keepalive(self) -> list[bytes]:
        return []  # NDJSON has no comment line; clients wait

    def _piece_line(self, thinking: bool) -> Callable[[Any, Any], bytes]:
        request = self.request
        if thinking:
            return lambda stamp, text: _line({**_piece(request, "", text, stamp=stamp), "done": False})
        return lambda stamp, text: _line({**_piece(request, text, "", stamp=stamp), "done": False})

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            if not event.text:
                return []
            if self.first_ns is None:
                self.first_ns = time.monotonic_ns()
            thinking = isinstance(event, ReasoningDelta)
            template = self._pieces.get(thinking)
            if template is None:  # per token the same line but its time and text: built once
                template = self._pieces[thinking] = FrameTemplate(self._piece_line(thinking), 2)
            return [template(created_at(), event.text)]
        if isinstance(event, ToolCallDelta):
            call = self.calls.setdefault(event.index, ["", ""])
            call[0] = event.name or call[0]
            call[1] += event.arguments
            return []
        if isinstance(event, ResponseFinished):
            lines = []
            if self.calls:
                calls = [_call_json(name, args) for _, (name, args) in sorted(self.calls.items())]
                lines.append(_line({**_piece(self.request, tool_calls=calls), "done": False}))
            done = {**_piece(self.request), "done": True, "done_reason": _done_reason(self.request, event.finish_reason),
                    **_stats(event.usage, self.context.started_ns, self.first_ns, time.monotonic_ns())}
            lines.append(_line(done))
            return lines
        return []


def error_status(error: ApiError) -> int:
    return STATUS[error.kind]


def error_body(error: ApiError) -> bytes:
    return _line({"error": error.message})


def error_frames(error: ApiError) -> list[bytes]:
    return [error_body(error)]


class OllamaCodec:
    stream_encoder = staticmethod(StreamEncoder)
    encode_final = staticmethod(encode_final)
    error_body = staticmethod(error_body)
    error_frames = staticmethod(error_frames)
    error_status = staticmethod(error_status)
    stream_headers = NDJSON_HEADERS


def encode_embed(result: Embeddings) -> dict[str, Any]:
    return {"model": result.model, "embeddings": result.float_vectors(),
            "prompt_eval_count": result.prompt_tokens}
