"""Anthropic Messages: request schema, decoding to IR, wire encoding, error shapes.

Decoding is lenient where Claude Code and the SDKs send things a local model
has no use for (``cache_control``, ``metadata``, ``output_config`` but its ``format``,
``context_management``, server tools, beta headers): they are accepted and
ignored, never rejected. Content blocks map onto the chat-template message
shape every family template understands:

* ``text`` blocks concatenate into the message content;
* ``thinking`` blocks become the assistant message's ``reasoning_content``;
* ``tool_use`` blocks become OpenAI-style ``tool_calls`` (arguments as dicts);
* ``tool_result`` blocks become ``tool`` messages, in order, before the text
  of the same user turn;
* ``document`` blocks become their text (:mod:`protocols.documents`: text, base64 PDF and content
  sources);
* ``image`` blocks (``base64`` and ``url`` sources) become images at slots of the
  message text (:class:`~protocols.ir.ImageSource`), those inside ``tool_result``
  blocks (Claude Code's screenshots) in the tool message; a text model reads each
  as a short marker, so an agent whose history holds a screenshot keeps working.

The first system block Claude Code sends (``x-anthropic-billing-header: …``)
changes on every request; it is dropped before templating so that it cannot
defeat prefix reuse.

Encoding is :class:`MessagesStreamEncoder`, a state machine that opens and
closes content blocks as the kind of event changes, so that indices run
0..n-1 in start order and every delta targets the open block.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from protocols import documents, images
from protocols.adapter_spec import decode_adapter
from protocols.cache_fields import cache_control_ttl
from protocols.errors import STATUS, ApiError
from protocols.limits import check_stop_strings
from protocols.output_format import decode_response_format
from protocols.ir import (
    IMAGE_SLOT,
    CachePolicy,
    ChatRequest,
    FinalResult,
    ImageSource,
    Message,
    ReasoningRun,
    ReasoningDelta,
    ResponseFinished,
    ResponseStarted,
    SamplingParams,
    StreamEvent,
    TextDelta,
    TextRun,
    ToolCallDelta,
    Usage,
    without_slots,
)
from protocols.sse import FrameTemplate, dumps, event_frame
from protocols.validation import parse_json_body

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# --------------------------------------------------------------------------- request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class MediaBlock(_Lenient):
    type: Literal["image"]


class DocumentBlock(_Lenient):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any] = Field(default_factory=dict)


class OtherBlock(_Lenient):
    """A block type this server does not model (server-tool results, search results, …).

    Its ``text``, if it has one, is kept; anything else is skipped, so that new
    block types in a client's history never break a conversation."""

    type: str


_TAGS = {"text": "text", "image": "media", "document": "document", "thinking": "thinking",
         "redacted_thinking": "redacted_thinking", "tool_use": "tool_use", "tool_result": "tool_result"}


def _block_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _TAGS.get(kind, "other") if isinstance(kind, str) else "other"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[MediaBlock, Tag("media")] | Annotated[DocumentBlock, Tag("document")]
    | Annotated[ThinkingBlock, Tag("thinking")] | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")] | Annotated["ToolResultBlock", Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_tag),
]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ContentBlock] | None = None
    is_error: bool | None = None


class MessageIn(_Lenient):
    # "system" turns inside ``messages``: Claude Code's mid-conversation system beta.
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class ToolIn(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # absent on server tools (web_search_…), which are ignored


class ToolChoiceIn(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingIn(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class MessagesBody(_Lenient):
    model: str = Field(min_length=1)
    messages: list[MessageIn]
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool = False
    tools: list[ToolIn] | None = None
    tool_choice: ToolChoiceIn | None = None
    thinking: ThinkingIn | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    adapter: str | None = Field(default=None, max_length=512)  # flow: LoRA adapters (protocols.adapter_spec)
    cache_audit: bool = False  # flow: audit this request's prefix-cache hit (protocols.cache_fields)

    @field_validator("stop_sequences")
    @classmethod
    def _stops_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and any(s == "" for s in value):
            raise ValueError("stop sequences must not be empty strings")
        check_stop_strings(value or ())  # here, so the 400 names 'stop_sequences'
        return value


class CountTokensBody(MessagesBody):
    """``/v1/messages/count_tokens``: the same body, without ``max_tokens``."""

    max_tokens: int = Field(default=1, ge=1)


def _document(block: DocumentBlock, where: str) -> str:
    """A document block's text: ``text`` and ``content`` sources as they are, ``base64`` decoded (PDFs to text)."""
    source = block.source
    kind = source.get("type")
    if kind == "text" and isinstance(source.get("data"), str):
        text = source["data"]
    elif kind == "base64" and isinstance(source.get("data"), str):
        data = documents.decode_base64(source["data"], f"{where}.source.data")
        text = documents.file_text(str(source.get("media_type") or "application/pdf"), data, f"{where}.source")
    elif kind == "content":
        content = source.get("content")
        text = content if isinstance(content, str) else "\n".join(
            str(b.get("text")) for b in content or () if isinstance(b, dict) and isinstance(b.get("text"), str))
    else:
        raise ApiError("invalid_request", f"'{where}.source' is a {kind!r} source; this server reads documents "
                       f"sent inline (text, base64, content sources), never by URL or file id.",
                       param=f"{where}.source")
    return documents.render(text, block.title, block.context)


def _image(block: MediaBlock, where: str) -> ImageSource:
    """An image block's source: ``base64`` (with its ``media_type``) or ``url``; a ``file`` source names a file
    this server does not store."""
    source = (block.model_extra or {}).get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    media_type = source.get("media_type") if isinstance(source, dict) else None
    media_type = media_type if isinstance(media_type, str) else None
    if isinstance(source, dict) and kind == "base64" and isinstance(source.get("data"), str):
        return images.source_from_base64(source["data"], f"{where}.source.data", media_type)
    if isinstance(source, dict) and kind == "url" and isinstance(source.get("url"), str):
        return images.source_from_url(source["url"], f"{where}.source.url")
    what = f"a {kind!r} source" if isinstance(kind, str) else "no usable source"
    raise ApiError("invalid_request", f"'{where}.source' is {what}; images may be sent as a 'base64' source "
                   "(with media_type) or a 'url' source (http or https); file ids are not supported.",
                   param=f"{where}.source")


def _text_of(blocks: str | list[Any] | None, where: str = "content") -> tuple[str, tuple[ImageSource, ...]]:
    """A tool result's content as text, with an image slot where each image block was, and the images."""
    if blocks is None or isinstance(blocks, str):
        return without_slots(blocks or ""), ()
    parts: list[str] = []
    found: list[ImageSource] = []
    for i, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(without_slots(block.text))
        elif isinstance(block, DocumentBlock):
            parts.append(without_slots(_document(block, f"{where}[{i}]")))
        elif isinstance(block, MediaBlock):
            found.append(_image(block, f"{where}[{i}]"))
            parts.append(IMAGE_SLOT)
        elif isinstance(block, OtherBlock) and isinstance((block.model_extra or {}).get("text"), str):
            parts.append(without_slots((block.model_extra or {})["text"]))
    return "\n".join(parts), tuple(found)


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return without_slots(system or "")
    kept = [without_slots(b.text) for b in system if not b.text.lstrip().startswith(BILLING_HEADER_PREFIX)]
    return "\n\n".join(t for t in kept if t)


def _convert_messages(body: MessagesBody) -> list[Message]:
    out: list[Message] = []
    system = _system_text(body.system)
    if system:
        out.append(Message("system", system))
    tool_names: dict[str, str] = {}
    for m, msg in enumerate(body.messages):
        if isinstance(msg.content, str):
            out.append(Message(msg.role, without_slots(msg.content)))
            continue
        texts: list[str] = []
        attached: list[ImageSource] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for b, block in enumerate(msg.content):
            if isinstance(block, TextBlock):
                texts.append(without_slots(block.text))
            elif isinstance(block, DocumentBlock):
                texts.append(without_slots(_document(block, f"messages[{m}].content[{b}]")))
            elif isinstance(block, MediaBlock):
                attached.append(_image(block, f"messages[{m}].content[{b}]"))
                texts.append(IMAGE_SLOT)
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                tool_names[block.id] = block.name
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": block.input}})
            elif isinstance(block, ToolResultBlock):
                # A screenshot a tool returned (Claude Code's) sits in the tool message.
                content, shots = _text_of(block.content, f"messages[{m}].content[{b}].content")
                if block.is_error:
                    content = f"Error: {content}"
                out.append(Message("tool", content, name=tool_names.get(block.tool_use_id),
                                   extra=(("tool_call_id", block.tool_use_id),), images=shots))
            elif isinstance(block, OtherBlock):
                text = (block.model_extra or {}).get("text")
                if isinstance(text, str):
                    texts.append(without_slots(text))
        extra: list[tuple[str, Any]] = []
        if calls:
            extra.append(("tool_calls", calls))
        if reasoning:
            extra.append(("reasoning_content", "\n".join(reasoning)))
        if texts or extra or msg.role == "assistant":
            out.append(Message(msg.role, "".join(texts), extra=tuple(extra), images=tuple(attached)))
    return out


def _tools(body: MessagesBody) -> tuple[dict[str, Any], ...]:
    tools = []
    for tool in body.tools or ():
        if tool.input_schema is None:
            continue  # a server tool (web search, code execution…): only Anthropic runs those
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tuple(tools)


def _tool_choice(choice: ToolChoiceIn | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise ApiError("invalid_request", "'tool_choice.name' is required when tool_choice.type is 'tool'.",
                           param="tool_choice.name")
        return {"name": choice.name}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _effort(output_config: dict[str, Any] | None) -> str | None:
    """``output_config.effort`` (low / medium / high), Anthropic's grading of how hard the model thinks."""
    effort = (output_config or {}).get("effort")
    return effort if isinstance(effort, str) else None


def decode_messages_request(body: bytes, request_id: str, created: int, *, count_only: bool = False) -> ChatRequest:
    """Validate an Anthropic Messages body (or a count_tokens body) and map it to the IR."""
    parsed = parse_json_body(CountTokensBody if count_only else MessagesBody, body)
    if not parsed.messages:
        raise ApiError("invalid_request", "'messages' must contain at least one message.", param="messages")
    thinking = None if parsed.thinking is None or parsed.thinking.type == "adaptive" else (
        parsed.thinking.type == "enabled")
    sampling = SamplingParams(
        temperature=1.0 if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
        top_k=parsed.top_k or 0,
    )
    user = (parsed.metadata or {}).get("user_id")
    return ChatRequest(
        model=parsed.model,
        messages=tuple(_convert_messages(parsed)),
        max_tokens=None if count_only else parsed.max_tokens,
        sampling=sampling,
        stop=tuple(parsed.stop_sequences or ()),
        stream=parsed.stream and not count_only,
        include_usage=True,
        tools=_tools(parsed),
        tool_choice=_tool_choice(parsed.tool_choice),
        parallel_tool_calls=not (parsed.tool_choice and parsed.tool_choice.disable_parallel_tool_use),
        response_format=decode_response_format((parsed.output_config or {}).get("format"), "output_config.format"),
        thinking=thinking,
        reasoning_effort=_effort(parsed.output_config),
        reasoning_budget=parsed.thinking.budget_tokens if parsed.thinking and parsed.thinking.type == "enabled" else None,
        request_id=request_id,
        created=created,
        user=user if isinstance(user, str) else None,
        cache=CachePolicy(ttl_seconds=cache_control_ttl(parsed.model_dump(exclude_none=True)),
                          audit=parsed.cache_audit),
        adapter=decode_adapter(parsed.adapter),
    )


# --------------------------------------------------------------------------- response


def message_id(request: ChatRequest) -> str:
    return f"msg_{request.request_id}"


def tool_use_id(call_id: str) -> str:
    """Anthropic-style id for a call id minted by a parser (``call_X`` → ``toolu_X``); an id the model wrote
    itself (Kimi K2's ``functions.NAME:0``) is the one its template expects back, so it stays as it is."""
    return "toolu_" + call_id.removeprefix("call_") if call_id.startswith("call_") else call_id


def thinking_signature(text: str) -> str:
    # Clients hand the signature back with the thinking block; nothing checks it here,
    # but it must be present and stable for the same text.
    return "flow-" + hashlib.sha256(text.encode()).hexdigest()[:32]


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "error": "end_turn", "cancelled": "end_turn"}


def stop_reason(finish_reason: str, stop_sequence: str | None) -> str:
    return "stop_sequence" if stop_sequence is not None else STOP_REASONS[finish_reason]


def usage_json(usage: Usage) -> dict[str, Any]:
    # Anthropic counts cache reads and cache writes apart from input_tokens (the three add up to the prompt).
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens - usage.cache_write_tokens,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.cache_write_tokens,
    }


def _arguments_object(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments or "{}")
    except (ValueError, RecursionError):  # a model's malformed arguments: the block gets an empty input
        return {}
    return parsed if isinstance(parsed, dict) else {}


def encode_message(result: FinalResult) -> dict[str, Any]:
    """The non-streaming ``message`` object."""
    content: list[dict[str, Any]] = []
    for block in result.blocks:  # in the model's order, as the stream's content blocks
        if isinstance(block, ReasoningRun):
            content.append({"type": "thinking", "thinking": block.text, "signature": thinking_signature(block.text)})
        elif isinstance(block, TextRun):
            content.append({"type": "text", "text": block.text})
        else:
            content.append({"type": "tool_use", "id": tool_use_id(block.id), "name": block.name,
                            "input": _arguments_object(block.arguments)})
    return {
        "id": message_id(result.request),
        "type": "message",
        "role": "assistant",
        "model": result.request.model,
        "content": content,
        "stop_reason": stop_reason(result.finish_reason, result.stop_sequence),
        "stop_sequence": result.stop_sequence,
        "usage": usage_json(result.usage),
    }


class MessagesStreamEncoder:
    """Encodes stream events as Anthropic SSE events (``event:`` + ``data:``)."""

    def __init__(self, started: ResponseStarted) -> None:
        self.started = started
        self.request = started.request
        self._index = -1
        self._open: str | None = None  # "text" | "thinking" | "tool_use"
        self._thinking: list[str] = []
        self._deltas: dict[tuple[str, int], FrameTemplate] = {}  # (delta type, block index) → its frame

    def start(self) -> list[bytes]:
        usage = usage_json(Usage(self.started.prompt_tokens, 0, self.started.cached_tokens,
                                 self.started.cache_write_tokens))
        message: dict[str, Any] = {
            "id": message_id(self.request), "type": "message", "role": "assistant", "content": [],
            "model": self.request.model, "stop_reason": None, "stop_sequence": None, "usage": usage,
        }
        return [event_frame("message_start", {"type": "message_start", "message": message}), self.keepalive()[0]]

    def keepalive(self) -> list[bytes]:
        return [event_frame("ping", {"type": "ping"})]

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
            self._thinking = []
        frames.append(event_frame("content_block_stop", {"type": "content_block_stop", "index": self._index}))
        self._open = None
        return frames

    def _begin(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._index += 1
        self._open = kind
        frames.append(event_frame("content_block_start",
                                  {"type": "content_block_start", "index": self._index, "content_block": block}))
        return frames

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return event_frame("content_block_delta", {"type": "content_block_delta", "index": self._index,
                                                   "delta": delta})

    def _text_delta(self, kind: str, field: str, text: str) -> bytes:
        """A text or thinking delta of the open block, from a template (per token: no object built)."""
        template = self._deltas.get((kind, self._index))
        if template is None:
            template = self._deltas[(kind, self._index)] = FrameTemplate(
                lambda value: self._delta({"type": kind, field: value}))
        return template(text)

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            if not event.text:
                return []
            frames = [] if self._open == "text" else self._begin("text", {"type": "text", "text": ""})
            frames.append(self._text_delta("text_delta", "text", event.text))
            return frames
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return []
            frames = [] if self._open == "thinking" else self._begin(
                "thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(event.text)
            frames.append(self._text_delta("thinking_delta", "thinking", event.text))
            return frames
        if isinstance(event, ToolCallDelta):
            frames = []
            if event.id is not None:
                frames = self._begin("tool_use", {"type": "tool_use", "id": tool_use_id(event.id),
                                                  "name": event.name or "", "input": {}})
            if event.arguments and self._open == "tool_use":
                frames.append(self._delta({"type": "input_json_delta", "partial_json": event.arguments}))
            return frames
        if isinstance(event, ResponseFinished):
            frames = self._close()
            frames.append(event_frame("message_delta", {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason(event.finish_reason, event.stop_sequence),
                          "stop_sequence": event.stop_sequence},
                "usage": usage_json(event.usage),
            }))
            frames.append(event_frame("message_stop", {"type": "message_stop"}))
            return frames
        return []


# --------------------------------------------------------------------------- errors

ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length_exceeded": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "conflict": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "request_too_large": "request_too_large",
    "unsupported_media_type": "invalid_request_error",
    "rate_limit": "rate_limit_error",
    "overloaded": "overloaded_error",
    "unavailable": "api_error",
    "internal": "api_error",
}


def error_status(error: ApiError) -> int:
    # Anthropic's own status for "overloaded": clients back off and retry on it.
    return 529 if error.kind == "overloaded" else STATUS[error.kind]


def error_json(error: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES[error.kind], "message": error.message}}


def error_body(error: ApiError) -> bytes:
    return dumps(error_json(error))


def error_frames(error: ApiError) -> list[bytes]:
    return [event_frame("error", error_json(error))]


class MessagesCodec:
    stream_encoder = staticmethod(MessagesStreamEncoder)
    encode_final = staticmethod(encode_message)
    error_status = staticmethod(error_status)
    error_body = staticmethod(error_body)
    error_frames = staticmethod(error_frames)
