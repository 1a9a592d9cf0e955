"""OpenAI Responses: request schema, decoding to IR, the event chain, error shapes.

A Responses request is a list of *items* rather than messages. Decoding folds
them into chat-template messages: ``message`` items keep their role,
``function_call`` items join the preceding assistant message as
``tool_calls``, ``function_call_output`` items become ``tool`` messages, and a
``reasoning`` item becomes the next assistant message's ``reasoning_content``.
``instructions`` become a leading system message that, as in the real API, is
*not* carried into the next turn; ``previous_response_id`` prepends the stored
conversation of an earlier response (resolved by the caller, so this module
stays free of I/O).

Encoding is :class:`ResponsesStreamEncoder`: it numbers every event
(``sequence_number``), opens an output item when the kind of event changes
(reasoning → message → function calls), closes it with its ``…done`` events,
and ends with ``response.completed`` (``response.incomplete`` after a length
stop) carrying the whole response, whose ``output`` is exactly the items the
stream announced. Codex reads conversation items only from
``response.output_item.done``, so every item is complete there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from protocols.codec import SSE_COMMENT_KEEPALIVE
from protocols import documents, images
from protocols.adapter_spec import decode_adapter
from protocols.cache_fields import SessionFields
from protocols.errors import ApiError
from protocols.ir import (
    IMAGE_SLOT,
    ChatRequest,
    FinalResult,
    ImageSource,
    Message,
    ProtocolContext,
    ReasoningRun,
    ReasoningDelta,
    ResponseFinished,
    ResponseStarted,
    SamplingParams,
    StreamEvent,
    TextRun,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    without_slots,
)
from protocols.openai_chat import error_body, error_json, error_status
from protocols.output_format import decode_response_format, encode_text_format
from protocols.sse import FrameTemplate, event_frame
from protocols.validation import json_object_argument, parse_json_body



@dataclass(frozen=True)
class ResponsesContext(ProtocolContext):
    """What ``openai.responses.format`` reads back: the request fields a response object echoes (``store``
    among them), and the index of the first message that belongs to the stored conversation (after the
    instructions)."""

    echo: dict[str, Any] = field(default_factory=dict)
    history_start: int = 0

    @property
    def stored(self) -> bool:
        return bool(self.echo.get("store", True))

# --------------------------------------------------------------------------- request


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class InputItem(_Lenient):
    type: str = "message"  # message items may omit it
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    input: str | None = None  # custom tool calls carry free-form input
    output: str | list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class ToolIn(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ReasoningIn(_Lenient):
    effort: str | None = None


class TextIn(_Lenient):
    format: dict[str, Any] | None = None


class ResponsesBody(SessionFields):
    model: str = Field(min_length=1)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ToolIn] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningIn | None = None
    text: TextIn | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None


def _parts(content: str | list[ContentPart] | None, where: str = "input") -> tuple[str, tuple[ImageSource, ...]]:
    """Content parts as text, with an image slot where each ``input_image`` was, and the images."""
    if content is None or isinstance(content, str):
        return without_slots(content or ""), ()
    texts: list[str] = []
    found: list[ImageSource] = []
    for i, part in enumerate(content):
        extra = part.model_extra or {}
        if part.text is not None:
            texts.append(without_slots(part.text))
        elif part.type == "input_file":
            texts.append(without_slots(documents.attached_file(
                extra.get("file_data"), extra.get("filename"), f"{where}[{i}]",
                has_reference=bool(extra.get("file_id") or extra.get("file_url")))))
        elif part.type == "input_image":
            found.append(_image(extra, f"{where}[{i}]"))
            texts.append(IMAGE_SLOT)
        elif part.type == "input_audio":
            texts.append(documents.media_marker("audio"))
    return "".join(texts), tuple(found)


def _parts_text(content: str | list[ContentPart] | None, where: str = "input") -> str:
    """Content parts as text alone (reasoning), an image as the text models' marker."""
    text, found = _parts(content, where)
    return text.replace(IMAGE_SLOT, documents.media_marker("image")) if found else text


def _image(part: dict[str, Any], where: str) -> ImageSource:
    """An ``input_image`` part's source: ``image_url`` (a data: or http(s) URL) with its ``detail``."""
    detail = part.get("detail")
    url = part.get("image_url")
    if isinstance(url, dict):  # the Chat Completions shape, sent here by some clients
        detail, url = url.get("detail", detail), url.get("url")
    if isinstance(url, str) and url:
        return images.source_from_url(url, f"{where}.image_url", detail if isinstance(detail, str) else None)
    if part.get("file_id"):
        raise ApiError("invalid_request", f"'{where}.file_id': file ids are not supported (this server has no "
                       f"file store); send 'image_url' as {images.ACCEPTED_SOURCES}.", param=f"{where}.file_id")
    raise ApiError("invalid_request", f"'{where}.image_url' is required: {images.ACCEPTED_SOURCES}.",
                   param=f"{where}.image_url")


class _Conversation:
    """Builds template messages from Responses items, in order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self._reasoning: list[str] = []
        self._names: dict[str, str] = {}

    def message(self, role: str, content: str, attached: tuple[ImageSource, ...] = ()) -> None:
        extra: tuple[tuple[str, Any], ...] = ()
        if role == "assistant" and self._reasoning:
            extra = (("reasoning_content", "\n".join(self._reasoning)),)
            self._reasoning = []
        self.messages.append(Message(role, content, extra=extra, images=attached))  # type: ignore[arg-type]

    def call(self, call_id: str, name: str, arguments: dict[str, Any]) -> None:
        self._names[call_id] = name
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant":
            self.message("assistant", "")
            last = self.messages[-1]
        extra = dict(last.extra)
        extra["tool_calls"] = [*extra.get("tool_calls", []), call]
        self.messages[-1] = replace(last, extra=tuple(extra.items()))

    def output(self, call_id: str, text: str, attached: tuple[ImageSource, ...] = ()) -> None:
        self.messages.append(Message("tool", text, name=self._names.get(call_id),
                                     extra=(("tool_call_id", call_id),), images=attached))

    def reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)


def _convert_input(body: ResponsesBody, conv: _Conversation) -> None:
    if body.input is None:
        return
    if isinstance(body.input, str):
        # "" too: the hosted API answers it (Codex's LM Studio provider warms up so)
        conv.message("user", without_slots(body.input))
        return
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise ApiError("invalid_request", f"'{where}.role' is required for a message item.",
                               param=f"{where}.role")
            conv.message(item.role, *_parts(item.content, f"{where}.content"))
        elif item.type in ("function_call", "custom_tool_call"):
            if not item.call_id or not item.name:
                raise ApiError("invalid_request", f"'{where}' needs 'call_id' and 'name'.", param=where)
            arguments = (json_object_argument(item.arguments, f"{where}.arguments") if item.type == "function_call"
                         else {"input": item.input or ""})
            conv.call(item.call_id, item.name, arguments)
        elif item.type in ("function_call_output", "custom_tool_call_output"):
            if not item.call_id:
                raise ApiError("invalid_request", f"'{where}.call_id' is required.", param=f"{where}.call_id")
            conv.output(item.call_id, *_parts(item.output, f"{where}.output"))
        elif item.type == "reasoning":
            conv.reasoning(_parts_text(item.content) or _parts_text(item.summary))
        # Other item types (item_reference, web_search_call, …) describe work of built-in
        # tools that this server does not run; they carry nothing a template can use.


def _tools(body: ResponsesBody) -> tuple[dict[str, Any], ...]:
    out = []
    for i, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            continue  # built-in tools (web_search, file_search, local_shell, …) are not served here
        if not tool.name:
            raise ApiError("invalid_request", f"'tools[{i}].name' is required for a function tool.",
                           param=f"tools[{i}].name")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters or {"type": "object"}}
        if tool.description:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return tuple(out)


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise ApiError("invalid_request", f"'tool_choice' must be 'auto', 'none', 'required' or "
                           f"{{'type': 'function', 'name': …}}, not {choice!r}.", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}
    return "auto"  # a built-in tool choice: nothing here to force


PreviousLookup = Callable[[str], tuple[Message, ...] | None]


def decode_responses_request(body: bytes, request_id: str, created: int, previous: PreviousLookup) -> ChatRequest:
    """Validate a Responses body and map it to the IR; ``previous`` resolves a stored conversation."""
    parsed = parse_json_body(ResponsesBody, body)
    conv = _Conversation()
    if parsed.instructions:
        conv.messages.append(Message("system", without_slots(parsed.instructions)))
    start = len(conv.messages)
    if parsed.previous_response_id is not None:
        history = previous(parsed.previous_response_id)
        if history is None:
            raise ApiError("not_found", f"Previous response with id '{parsed.previous_response_id}' not found "
                           "(unknown, expired, or stored with store=false).", param="previous_response_id")
        conv.messages.extend(history)
    _convert_input(parsed, conv)
    if len(conv.messages) == start and not parsed.previous_response_id:
        raise ApiError("invalid_request", "'input' must contain at least one item.", param="input")
    effort = parsed.reasoning.effort if parsed.reasoning else None
    sampling = SamplingParams(
        temperature=1.0 if parsed.temperature is None else parsed.temperature,
        top_p=1.0 if parsed.top_p is None else parsed.top_p,
    )
    echo = {
        "instructions": parsed.instructions, "max_output_tokens": parsed.max_output_tokens,
        "parallel_tool_calls": parsed.parallel_tool_calls, "previous_response_id": parsed.previous_response_id,
        "reasoning": {"effort": effort, "summary": None}, "store": parsed.store,
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "tool_choice": parsed.tool_choice if parsed.tool_choice is not None else "auto",
        "tools": [t.model_dump(exclude_none=True) for t in parsed.tools or () if t.type == "function"],
        "metadata": parsed.metadata or {}, "user": parsed.user,
    }
    response_format = decode_response_format(parsed.text.format if parsed.text else None, "text.format")
    echo["text"] = {"format": encode_text_format(response_format)}
    return ChatRequest(
        model=parsed.model,
        messages=tuple(conv.messages),
        max_tokens=parsed.max_output_tokens,
        sampling=sampling,
        stream=parsed.stream,
        include_usage=True,
        tools=_tools(parsed),
        tool_choice=_tool_choice(parsed.tool_choice),
        parallel_tool_calls=parsed.parallel_tool_calls,
        response_format=response_format,
        thinking=None if effort is None else effort not in ("none", "minimal"),
        reasoning_effort=effort,
        request_id=request_id,
        created=created,
        user=parsed.user,
        cache=parsed.cache_policy(),
        adapter=decode_adapter(parsed.adapter),
        context=ResponsesContext(echo=echo, history_start=start),
    )


def conversation_after(result: FinalResult) -> tuple[Message, ...]:
    """The conversation a later ``previous_response_id`` continues: this request's messages
    (without its instructions) and the assistant turn it produced."""
    request = result.request
    history = request.messages[request.context_as(ResponsesContext).history_start:]
    extra: list[tuple[str, Any]] = []
    if result.reasoning:
        extra.append(("reasoning_content", result.reasoning))
    if result.tool_calls:
        extra.append(("tool_calls", [
            {"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json_object_argument(c.arguments, "tool_calls")}}
            for c in result.tool_calls]))
    return (*history, Message("assistant", result.text, extra=tuple(extra)))


# --------------------------------------------------------------------------- response


def response_id(request: ChatRequest) -> str:
    return f"resp_{request.request_id}"


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def response_json(request: ChatRequest, output: list[dict[str, Any]], *, status: str,
                  usage: Usage | None = None, completed_at: int | None = None) -> dict[str, Any]:
    echo = request.context_as(ResponsesContext).echo
    return {
        "id": response_id(request),
        "object": "response",
        "created_at": request.created,
        "status": status,
        "completed_at": completed_at,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "model": request.model,
        "output": output,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage_json(usage) if usage is not None else None,
        **echo,
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text or status == "completed" else []
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id, "name": call.name,
            "arguments": call.arguments}


def _final_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def encode_response(result: FinalResult) -> dict[str, Any]:
    """The non-streaming response object."""
    rid = result.request.request_id
    output: list[dict[str, Any]] = []
    for block in result.blocks:  # in the model's order, as the stream's output items
        if isinstance(block, ReasoningRun):
            output.append(_reasoning_item(f"rs_{rid}_{len(output)}", block.text, "completed"))
        elif isinstance(block, TextRun):
            output.append(_message_item(f"msg_{rid}_{len(output)}", block.text, "completed"))
        else:
            output.append(_call_item(f"fc_{rid}_{len(output)}", block, "completed"))
    if not output:  # an empty answer is still one (empty) message, as streamed
        output.append(_message_item(f"msg_{rid}_0", "", "completed"))
    status = _final_status(result.finish_reason)
    return response_json(result.request, output, status=status, usage=result.usage,
                         completed_at=result.request.created)


class ResponsesStreamEncoder:
    """Encodes stream events as the Responses event chain, numbering every event."""

    def __init__(self, started: ResponseStarted) -> None:
        self.request = started.request
        self._seq = 0
        self._output: list[dict[str, Any]] = []  # finished items, in order
        self._open: str | None = None  # "reasoning" | "message" | "function_call"
        self._text: list[str] = []
        self._call: ToolCall | None = None
        # The open reasoning or message item's delta event, its number and text left to fill (per token the same
        # event but those two: built once per item).
        self._delta: FrameTemplate | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        frame = event_frame(kind, {"type": kind, "sequence_number": self._seq, **fields})
        self._seq += 1
        return frame

    def start(self) -> list[bytes]:
        body = response_json(self.request, [], status="in_progress")
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def keepalive(self) -> list[bytes]:
        return [SSE_COMMENT_KEEPALIVE]

    @property
    def _index(self) -> int:
        return len(self._output)

    def _item_id(self, prefix: str) -> str:
        return f"{prefix}_{self.request.request_id}_{self._index}"

    def _begin(self, kind: str, item: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._open, self._text = kind, []
        frames.append(self._event("response.output_item.added", output_index=self._index, item=item))
        return frames

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        text, index = "".join(self._text), self._index
        frames = []
        if self._open == "reasoning":
            item_id = self._item_id("rs")
            frames.append(self._event("response.reasoning_text.done", item_id=item_id, output_index=index,
                                      content_index=0, text=text))
            frames.append(self._event("response.content_part.done", item_id=item_id, output_index=index,
                                      content_index=0, part={"type": "reasoning_text", "text": text}))
            item = _reasoning_item(item_id, text, "completed")
        elif self._open == "message":
            item_id = self._item_id("msg")
            frames.append(self._event("response.output_text.done", item_id=item_id, output_index=index,
                                      content_index=0, text=text, logprobs=[]))
            frames.append(self._event("response.content_part.done", item_id=item_id, output_index=index,
                                      content_index=0, part=_output_text(text)))
            item = _message_item(item_id, text, "completed")
        else:
            assert self._call is not None
            item_id = self._item_id("fc")
            call = ToolCall(self._call.id, self._call.name, text or "{}")
            frames.append(self._event("response.function_call_arguments.done", item_id=item_id,
                                      output_index=index, name=call.name, arguments=call.arguments))
            item = _call_item(item_id, call, "completed")
        frames.append(self._event("response.output_item.done", output_index=index, item=item))
        self._output.append(item)
        self._open = self._delta = None
        return frames

    def _open_text(self, kind: str) -> list[bytes]:
        """Open a reasoning or message item with its one content part."""
        frames = self._close()  # first: the new item's index depends on it
        if kind == "reasoning":
            item_id = self._item_id("rs")
            frames += self._begin(kind, _reasoning_item(item_id, "", "in_progress"))
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item_id = self._item_id("msg")
            frames += self._begin(kind, _message_item(item_id, None, "in_progress"))
            part = _output_text("")
        frames.append(self._event("response.content_part.added", item_id=item_id, output_index=self._index,
                                  content_index=0, part=part))
        return frames

    def _text_delta(self, kind: str, text: str) -> list[bytes]:
        template = self._delta
        if self._open == kind and template is not None:
            frames = []
        else:
            frames = self._open_text(kind)
            template = self._delta = FrameTemplate(self._delta_frame(kind), 2)
        self._text.append(text)
        frames.append(template(self._seq, text))
        self._seq += 1
        return frames

    def _delta_frame(self, kind: str) -> Callable[[Any, Any], bytes]:
        """The open item's delta event, from its number and its text."""
        index = self._index
        if kind == "reasoning":
            item_id = self._item_id("rs")
            return lambda seq, text: event_frame("response.reasoning_text.delta", {
                "type": "response.reasoning_text.delta", "sequence_number": seq, "item_id": item_id,
                "output_index": index, "content_index": 0, "delta": text})
        item_id = self._item_id("msg")
        return lambda seq, text: event_frame("response.output_text.delta", {
            "type": "response.output_text.delta", "sequence_number": seq, "item_id": item_id,
            "output_index": index, "content_index": 0, "delta": text, "logprobs": []})

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            return self._text_delta("message", event.text) if event.text else []
        if isinstance(event, ReasoningDelta):
            return self._text_delta("reasoning", event.text) if event.text else []
        if isinstance(event, ToolCallDelta):
            frames: list[bytes] = []
            if event.id is not None:
                frames = self._close()  # first: closing an earlier call reads its own id from self._call
                self._call = ToolCall(event.id, event.name or "", "")
                frames += self._begin("function_call", _call_item(self._item_id("fc"), self._call, "in_progress"))
            if event.arguments and self._open == "function_call":
                self._text.append(event.arguments)
                frames.append(self._event("response.function_call_arguments.delta", item_id=self._item_id("fc"),
                                          output_index=self._index, delta=event.arguments))
            return frames
        if isinstance(event, ResponseFinished):
            frames = self._close()
            if not self._output:  # an empty answer is still one (empty) message
                frames += self._open_text("message") + self._close()
            status = _final_status(event.finish_reason)
            body = response_json(self.request, self._output, status=status, usage=event.usage,
                                 completed_at=self.request.created)
            kind = "response.incomplete" if status == "incomplete" else "response.completed"
            frames.append(self._event(kind, response=body))
            return frames
        return []


# --------------------------------------------------------------------------- errors

def error_frames(error: ApiError) -> list[bytes]:
    # An ``error`` event (the stream's state is unknown here, so it carries no sequence of its own).
    inner = error_json(error)["error"]
    return [event_frame("error", {"type": "error", "sequence_number": 0, "code": inner["code"] or inner["type"],
                                  "message": inner["message"], "param": inner["param"]})]


class ResponsesCodec:
    stream_encoder = staticmethod(ResponsesStreamEncoder)
    encode_final = staticmethod(encode_response)
    error_body = staticmethod(error_body)
    error_frames = staticmethod(error_frames)
    error_status = staticmethod(error_status)
