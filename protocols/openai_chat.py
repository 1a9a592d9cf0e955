"""OpenAI Chat Completions: request schema, decoding to IR, and wire encoding.

Decoding validates the body with pydantic (unknown fields are tolerated, as the
real API's clients send many) and produces a :class:`ChatRequest`. Encoding is a
small state machine, :class:`ChatStreamEncoder`, fed the protocol-neutral
stream events; it guarantees the facts clients depend on: one ``id`` for the
whole stream, ``role`` only in the first delta, tool-call indices contiguous,
the usage chunk with empty ``choices`` before ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from protocols.codec import SSE_COMMENT_KEEPALIVE
from protocols import documents, images
from protocols.adapter_spec import decode_adapter
from protocols.cache_fields import SessionFields
from protocols.errors import STATUS, ApiError
from protocols.limits import check_stop_strings
from protocols.output_format import decode_response_format
from protocols.ir import (
    IMAGE_SLOT,
    ChatRequest,
    FinalResult,
    ImageSource,
    Message,
    ReasoningDelta,
    ResponseFinished,
    ResponseStarted,
    SamplingParams,
    StreamEvent,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    Usage,
    without_slots,
)
from protocols.sse import DONE, FrameTemplate, data_frame, dumps
from protocols.validation import json_object_argument, parse_json_body

# --------------------------------------------------------------------------- request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ImagePart(_Lenient):
    type: Literal["image_url", "input_image", "image"]


class FileIn(_Lenient):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Lenient):
    type: Literal["file"]
    file: FileIn


ContentPart = Annotated[TextPart | ImagePart | FilePart, Field(discriminator="type")]


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessageIn(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class NamedFunction(_Lenient):
    name: str = Field(min_length=1)


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class OpenAISamplingFields(SessionFields):
    """The sampling and streaming fields chat completions and legacy completions share."""

    model: str = Field(min_length=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=128)
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stops_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else (value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        check_stop_strings(stops)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys_are_token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias for token {key} must be between -100 and 100")
        return value

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            logprobs=logprobs,
        )


class ChatCompletionBody(OpenAISamplingFields):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None


def _content(content: str | list[Any] | None, where: str) -> tuple[str, tuple[ImageSource, ...]]:
    """A message's text, with an image slot where each image part was, and the images."""
    if content is None or isinstance(content, str):
        return without_slots(content or ""), ()
    texts: list[str] = []
    found: list[ImageSource] = []
    for i, part in enumerate(content):
        if isinstance(part, ImagePart):
            found.append(_image(part, f"{where}.content[{i}]"))
            texts.append(IMAGE_SLOT)
        elif isinstance(part, FilePart):
            texts.append(without_slots(documents.attached_file(
                part.file.file_data, part.file.filename, f"{where}.content[{i}].file",
                has_reference=part.file.file_id is not None)))
        else:
            texts.append(without_slots(part.text))
    return "".join(texts), tuple(found)


def _image(part: ImagePart, where: str) -> ImageSource:
    """An image part's source: ``image_url`` as ``{"url", "detail"}`` (or, as some clients send it, a bare
    string with ``detail`` beside it: the Responses shape)."""
    extra = part.model_extra or {}
    value = extra.get("image_url", extra.get("image"))
    detail = extra.get("detail")
    if isinstance(value, dict):
        detail = value.get("detail", detail)
        value = value.get("url")
        where = f"{where}.image_url.url"
    else:
        where = f"{where}.image_url"
    if not isinstance(value, str) or not value:
        raise ApiError("invalid_request", f"'{where}' is required: {images.ACCEPTED_SOURCES}.", param=where)
    return images.source_from_url(value, where, detail if isinstance(detail, str) else None)


def _message(msg: ChatMessageIn, index: int) -> Message:
    where = f"messages[{index}]"
    role = "tool" if msg.role == "function" else msg.role
    extra: list[tuple[str, Any]] = []
    if msg.tool_calls:
        calls = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": json_object_argument(
                        call.function.arguments, f"{where}.tool_calls[{j}].function.arguments"
                    ),
                },
            }
            for j, call in enumerate(msg.tool_calls)
        ]
        extra.append(("tool_calls", calls))
    if msg.tool_call_id is not None:
        extra.append(("tool_call_id", msg.tool_call_id))
    if msg.reasoning_content:
        extra.append(("reasoning_content", msg.reasoning_content))
    content, attached = _content(msg.content, where)
    return Message(role=role, content=content, name=msg.name, extra=tuple(extra), images=attached)


def decode_chat_request(body: bytes, request_id: str, created: int) -> ChatRequest:
    """Validate an OpenAI chat body and map it to the protocol-neutral request."""
    return decode_chat_body(parse_json_body(ChatCompletionBody, body), request_id, created)


def decode_chat_body(parsed: ChatCompletionBody, request_id: str, created: int) -> ChatRequest:
    """Map an already validated chat body (or a subclass's: the agents API) to the protocol-neutral request."""
    if parsed.top_logprobs and not parsed.logprobs:
        raise ApiError("invalid_request", "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    return ChatRequest(
        model=parsed.model,
        messages=tuple(_message(m, i) for i, m in enumerate(parsed.messages)),
        max_tokens=parsed.max_completion_tokens or parsed.max_tokens,
        sampling=parsed.sampling((parsed.top_logprobs or 0) if parsed.logprobs else None),
        stop=parsed.stops(),
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        tools=tuple(parsed.tools or ()),
        tool_choice=({"name": parsed.tool_choice.function.name} if isinstance(parsed.tool_choice, NamedToolChoice)
                     else parsed.tool_choice),
        parallel_tool_calls=parsed.parallel_tool_calls,
        response_format=decode_response_format(parsed.response_format, "response_format"),
        # reasoning_effort "none" switches thinking off; any other effort switches it on.
        thinking=None if parsed.reasoning_effort is None else parsed.reasoning_effort not in ("none", "minimal"),
        reasoning_effort=parsed.reasoning_effort,
        chat_template_kwargs=tuple((parsed.chat_template_kwargs or {}).items()),
        request_id=request_id,
        created=created,
        user=parsed.user,
        cache=parsed.cache_policy(),
        adapter=decode_adapter(parsed.adapter),
        n=parsed.n,
    )


# --------------------------------------------------------------------------- response


def completion_id(request: ChatRequest) -> str:
    return f"chatcmpl-{request.request_id}"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _token_json(token: str | int, logprob: float) -> dict[str, Any]:
    text = str(token)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def logprobs_json(logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
    """``choices[].logprobs`` of chat completions: one entry per generated token."""
    return {
        "content": [
            {**_token_json(lp.token, lp.logprob), "top_logprobs": [_token_json(t, v) for t, v in lp.top]}
            for lp in logprobs
        ],
        "refusal": None,
    }


def _tool_calls_json(result: FinalResult) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in result.tool_calls
    ]


def assistant_message(result: FinalResult) -> Message:
    """The assistant turn of a result as a client sends it back in ``messages`` (template shape:
    tool-call arguments as objects where they parse), for servers that keep the conversation."""
    extra: list[tuple[str, Any]] = []
    if result.reasoning:
        extra.append(("reasoning_content", result.reasoning))
    if result.tool_calls:
        calls = []
        for call in result.tool_calls:
            try:
                arguments: Any = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                arguments = call.arguments  # templates render a string as it is
            calls.append({"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}})
        extra.append(("tool_calls", calls))
    return Message("assistant", result.text, extra=tuple(extra))


def _choice_json(result: FinalResult, index: int) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.text or None}
    if not result.tool_calls and message["content"] is None:
        message["content"] = ""
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
        message["reasoning"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = _tool_calls_json(result)
    return {"index": index, "message": message, "finish_reason": result.finish_reason,
            "logprobs": logprobs_json(result.logprobs) if result.request.sampling.logprobs is not None else None}


def encode_completion(result: FinalResult) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object, one entry of ``choices`` per choice (``n``)."""
    request = result.request
    return {
        "id": completion_id(request),
        "object": "chat.completion",
        "created": request.created,
        "model": request.model,
        "choices": [_choice_json(r, i) for i, r in enumerate([result, *result.others])],
        "usage": usage_json(result.usage),
        "system_fingerprint": None,
    }


class ChoiceCounter:
    """Counts a stream's finished choices and their tokens: the stream ends, with the total usage, after the
    last one."""

    def __init__(self, request: ChatRequest) -> None:
        self.left = request.n
        self.completion_tokens = 0

    def finish(self, event: ResponseFinished) -> Usage | None:
        """The response's usage once this was the last choice to finish, else None."""
        self.left -= 1
        self.completion_tokens += event.usage.completion_tokens
        if self.left > 0:
            return None
        return replace(event.usage, completion_tokens=self.completion_tokens)


class ChatStreamEncoder:
    """Encodes stream events as ``chat.completion.chunk`` SSE frames."""

    def __init__(self, started: ResponseStarted) -> None:
        self.request = started.request
        self._sent_role: set[int] = set()
        self._usage_field = {"usage": None} if self.request.include_usage else {}
        self._choices = ChoiceCounter(self.request)
        self._deltas: dict[tuple[tuple[str, ...], int], FrameTemplate] = {}  # (delta's fields, choice) → template

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: tuple[TokenLogprob, ...] = (), choice: int = 0) -> bytes:
        if choice not in self._sent_role:
            delta = {"role": "assistant", **delta}
            self._sent_role.add(choice)
        return self._frame(delta, finish_reason, logprobs, choice)

    def _text(self, fields: tuple[str, ...], text: str, choice: int) -> bytes:
        """A chunk whose delta is ``text`` in each of ``fields``: after the role went out, from a template (per
        token, the same bytes without building and encoding the chunk's object)."""
        if choice not in self._sent_role:
            return self._chunk(dict.fromkeys(fields, text), choice=choice)
        template = self._deltas.get((fields, choice))
        if template is None:
            template = self._deltas[(fields, choice)] = FrameTemplate(
                lambda *values: self._frame(dict(zip(fields, values)), None, (), choice), len(fields))
        return template(*(text,) * len(fields))

    def _frame(self, delta: dict[str, Any], finish_reason: str | None, logprobs: tuple[TokenLogprob, ...],
               choice: int) -> bytes:
        return data_frame(
            {
                "id": completion_id(self.request),
                "object": "chat.completion.chunk",
                "created": self.request.created,
                "model": self.request.model,
                "system_fingerprint": None,
                "choices": [
                    {"index": choice, "delta": delta, "finish_reason": finish_reason,
                     "logprobs": logprobs_json(logprobs) if logprobs else None}
                ],
                **self._usage_field,
            }
        )

    def start(self) -> list[bytes]:
        return [self._chunk({"content": ""}, choice=i) for i in range(self.request.n)]

    def keepalive(self) -> list[bytes]:
        return [SSE_COMMENT_KEEPALIVE]

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            if event.logprobs:
                return [self._chunk({"content": event.text}, logprobs=event.logprobs, choice=event.choice)]
            return [self._text(("content",), event.text, event.choice)] if event.text else []
        if isinstance(event, ReasoningDelta):
            return [self._text(("reasoning_content", "reasoning"), event.text, event.choice)] if event.text else []
        if isinstance(event, ToolCallDelta):
            call: dict[str, Any] = {"index": event.index}
            function: dict[str, Any] = {"arguments": event.arguments}
            if event.id is not None:
                call.update(id=event.id, type="function")
            if event.name is not None:
                function = {"name": event.name, **function}
            call["function"] = function
            return [self._chunk({"tool_calls": [call]}, choice=event.choice)]
        if isinstance(event, ResponseFinished):
            frames = [self._chunk({}, finish_reason=event.finish_reason, choice=event.choice)]
            usage = self._choices.finish(event)
            if usage is None:
                return frames  # other choices are still running
            if self.request.include_usage:
                frames.append(
                    data_frame(
                        {
                            "id": completion_id(self.request),
                            "object": "chat.completion.chunk",
                            "created": self.request.created,
                            "model": self.request.model,
                            "system_fingerprint": None,
                            "choices": [],
                            "usage": usage_json(usage),
                        }
                    )
                )
            frames.append(DONE)
            return frames
        return []


# --------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "conflict": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "request_too_large": "invalid_request_error",
    "unsupported_media_type": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "server_overloaded",
    "unavailable": "service_unavailable_error",
    "internal": "server_error",
}


def error_json(error: ApiError) -> dict[str, Any]:
    code = error.code
    if code is None and error.kind == "context_length_exceeded":
        code = "context_length_exceeded"
    return {
        "error": {
            "message": error.message,
            "type": _ERROR_TYPES[error.kind],
            "param": error.param,
            "code": code,
        }
    }


def error_body(error: ApiError) -> bytes:
    return dumps(error_json(error))


def error_frames(error: ApiError) -> list[bytes]:
    """An error after streaming began: an ``error`` chunk (the SDK raises on it), then ``[DONE]``."""
    return [data_frame(error_json(error)), DONE]


def error_status(error: ApiError) -> int:
    # A full queue or a loading model: 429 makes OpenAI clients back off and retry (with retry-after).
    return 429 if error.kind == "overloaded" else STATUS[error.kind]


class ChatCodec:
    stream_encoder = staticmethod(ChatStreamEncoder)
    encode_final = staticmethod(encode_completion)
    error_body = staticmethod(error_body)
    error_frames = staticmethod(error_frames)
    error_status = staticmethod(error_status)
