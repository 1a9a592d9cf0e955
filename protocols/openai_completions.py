"""OpenAI legacy completions (``POST /v1/completions``): raw prompts, no chat template.

The prompt is a string or a list of token ids (also accepted wrapped in a
one-element list, as clients built for batch prompts send it); it reaches the
engine untemplated through :attr:`ChatRequest.prompt`. ``echo`` prepends the
prompt's text, which ``chat.prepare`` recovers for token-id prompts. Logprobs
use the legacy shape (``tokens``, ``token_logprobs``, ``top_logprobs`` as
``{token: logprob}`` maps, ``text_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from protocols.adapter_spec import decode_adapter
from protocols.errors import ApiError
from protocols.ir import (
    ChatRequest,
    FinalResult,
    ProtocolContext,
    ResponseFinished,
    ResponseStarted,
    StreamEvent,
    TextDelta,
    TokenLogprob,
)
from protocols.codec import SSE_COMMENT_KEEPALIVE
from protocols.openai_chat import (
    ChoiceCounter,
    OpenAISamplingFields,
    error_body,
    error_frames,
    error_status,
    usage_json,
)
from protocols.sse import DONE, data_frame
from protocols.validation import parse_json_body



@dataclass(frozen=True)
class CompletionsContext(ProtocolContext):
    """What ``openai.completions.format`` reads back: whether to echo the prompt."""

    echo: bool = False
DEFAULT_MAX_TOKENS = 16  # the API's own default for this endpoint


class CompletionBody(OpenAISamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


def _prompt(prompt: str | list[str] | list[int] | list[list[int]]) -> str | tuple[int, ...]:
    if isinstance(prompt, str):
        value: Any = prompt
    elif prompt and all(isinstance(p, int) for p in prompt):
        value = tuple(prompt)
    elif len(prompt) == 1:
        value = prompt[0] if isinstance(prompt[0], str) else tuple(prompt[0])  # type: ignore[arg-type]
    else:
        raise ApiError("invalid_request", f"'prompt' must be one string or one list of token ids (got a list of "
                       f"{len(prompt)}); send several prompts as separate requests.", param="prompt")
    if not value:
        raise ApiError("invalid_request", "'prompt' must not be empty.", param="prompt")
    return value  # type: ignore[no-any-return]


def decode_completion_request(body: bytes, request_id: str, created: int) -> ChatRequest:
    parsed = parse_json_body(CompletionBody, body)
    if (parsed.best_of or 1) != 1:
        raise ApiError("invalid_request", f"'best_of' must be 1 (got {parsed.best_of}).", param="best_of")
    if parsed.suffix:
        raise ApiError("invalid_request", "'suffix' (fill-in-the-middle) is not supported by this server.",
                       param="suffix")
    if parsed.echo and parsed.logprobs is not None:
        raise ApiError("invalid_request", "'echo' with 'logprobs' would need prompt logprobs, which this server "
                       "does not compute; use one or the other.", param="logprobs")
    return ChatRequest(
        model=parsed.model,
        messages=(),
        prompt=_prompt(parsed.prompt),
        max_tokens=parsed.max_tokens,
        sampling=parsed.sampling(parsed.logprobs),
        stop=parsed.stops(),
        stream=parsed.stream,
        include_usage=parsed.include_usage,
        request_id=request_id,
        created=created,
        user=parsed.user,
        cache=parsed.cache_policy(),
        adapter=decode_adapter(parsed.adapter),
        n=parsed.n,
        context=CompletionsContext(echo=parsed.echo),
    )


# --------------------------------------------------------------------------- response


class _Logprobs:
    """Accumulates the legacy logprobs object, with character offsets into the text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict[str, float]] = []
        self.offsets: list[int] = []

    def add(self, logprobs: tuple[TokenLogprob, ...]) -> dict[str, Any]:
        start = len(self.tokens)
        for lp in logprobs:
            token = str(lp.token)
            self.tokens.append(token)
            self.token_logprobs.append(lp.logprob)
            self.top.append({str(t): v for t, v in lp.top})
            self.offsets.append(self.offset)
            self.offset += len(token)
        return self.json(start)

    def json(self, start: int = 0) -> dict[str, Any]:
        return {"tokens": self.tokens[start:], "token_logprobs": self.token_logprobs[start:],
                "top_logprobs": self.top[start:], "text_offset": self.offsets[start:]}


def _echo(request: ChatRequest, prompt_text: str) -> str:
    return prompt_text if request.context_as(CompletionsContext).echo else ""


def _body(request: ChatRequest, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": f"cmpl-{request.request_id}", "object": "text_completion", "created": request.created,
            "model": request.model, "system_fingerprint": None, "choices": choices, **extra}


def _choice(text: str, logprobs: dict[str, Any] | None, finish_reason: str | None, index: int = 0) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def _final_choice(result: FinalResult, index: int) -> dict[str, Any]:
    prefix = _echo(result.request, result.prompt_text)
    logprobs = None
    if result.request.sampling.logprobs is not None:
        acc = _Logprobs(len(prefix))
        acc.add(result.logprobs)
        logprobs = acc.json()
    finish = "stop" if result.finish_reason == "tool_calls" else result.finish_reason
    return _choice(prefix + result.text, logprobs, finish, index)


def encode_completion(result: FinalResult) -> dict[str, Any]:
    choices = [_final_choice(r, i) for i, r in enumerate([result, *result.others])]
    return _body(result.request, choices, usage=usage_json(result.usage))


class CompletionStreamEncoder:
    def __init__(self, started: ResponseStarted) -> None:
        self.request = started.request
        self.prefix = _echo(self.request, started.prompt_text)
        wants = self.request.sampling.logprobs is not None
        self.logprobs = [_Logprobs(len(self.prefix)) if wants else None for _ in range(self.request.n)]
        self._usage_field = {"usage": None} if self.request.include_usage else {}
        self._choices = ChoiceCounter(self.request)

    def _chunk(self, text: str, logprobs: dict[str, Any] | None = None, finish: str | None = None,
               choice: int = 0) -> bytes:
        return data_frame(_body(self.request, [_choice(text, logprobs, finish, choice)], **self._usage_field))

    def start(self) -> list[bytes]:
        return [self._chunk(self.prefix, choice=i) for i in range(self.request.n)] if self.prefix else []

    def keepalive(self) -> list[bytes]:
        return [SSE_COMMENT_KEEPALIVE]

    def encode(self, event: StreamEvent) -> list[bytes]:
        if isinstance(event, TextDelta):
            if not event.text and not event.logprobs:
                return []
            acc = self.logprobs[event.choice]
            logprobs = acc.add(event.logprobs) if acc is not None else None
            return [self._chunk(event.text, logprobs, choice=event.choice)]
        if isinstance(event, ResponseFinished):
            finish = "stop" if event.finish_reason == "tool_calls" else event.finish_reason
            frames = [self._chunk("", None, finish, event.choice)]
            usage = self._choices.finish(event)
            if usage is None:
                return frames  # other choices are still running
            if self.request.include_usage:
                frames.append(data_frame(_body(self.request, [], usage=usage_json(usage))))
            frames.append(DONE)
            return frames
        return []


class CompletionsCodec:
    stream_encoder = staticmethod(CompletionStreamEncoder)
    encode_final = staticmethod(encode_completion)
    error_body = staticmethod(error_body)
    error_frames = staticmethod(error_frames)
    error_status = staticmethod(error_status)
