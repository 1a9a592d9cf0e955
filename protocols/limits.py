"""What a request may ask of a model: one check for every protocol, before any large work.

Theory of operation
-------------------
Every protocol decodes into a :class:`ChatRequest`, and every request then
passes ``chat.prepare`` (the agents API and token counting too). That stage
calls :func:`validate_request` with the served model's :class:`ModelLimits`
*before* it templates or tokenizes anything, so nothing from a request reaches
MLX unchecked and no request can make the server do work out of proportion to
what the model can accept:

* **token ids** — logit-bias keys and raw prompt ids must lie in
  ``[0, vocab)``: MLX indexes without bounds checks, and an id past the
  vocabulary writes outside the logits (a crash, or silently another token);
* **sampling values** — ``top_k`` past the vocabulary means "no top-k" and
  is normalised to it; seeds must fit 64 bits (OpenAI documents signed 64-bit
  seeds: negative ones are mapped onto the unsigned range);
* **sizes before templating** — a conversation whose text could not fit the
  context even at :data:`CHARS_PER_TOKEN` characters per token, or with more
  messages than the context has tokens, is refused (or, under ``drop_oldest``,
  its oldest turns are left out) without templating or tokenizing a byte of it:
  templating and tokenizing cost memory many times the text's size;
* **template kwargs** — names that ``apply_chat_template`` itself takes
  (``tokenize``, ``messages``, ``tools``…) cannot be overridden by a client;
* **tools** — every function tool has a valid, unique name, and a
  ``tool_choice`` that names a tool names one that was given.

Pure functions, no MLX: the limits come from the loaded model's config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from protocols.errors import ApiError
from protocols.ir import ChatRequest, Message, SamplingParams

# A generous upper bound on characters per token: real text averages 3-5 (code and CJK fewer), so
# a prompt past context × this cannot fit, whatever the tokenizer. Pathological inputs (long runs
# of one character that a vocabulary merges) are the only texts that could, and they are refused.
CHARS_PER_TOKEN = 32
SEED_RANGE = (-(2**63), 2**64)  # signed or unsigned 64-bit
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096
MAX_TOOLS = 1024
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# apply_chat_template's own parameters: a client's chat_template_kwargs must not replace them.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


@dataclass(frozen=True)
class ModelLimits:
    """What the served model can take: from its config, once loaded."""

    vocab_size: int
    context_length: int

    @property
    def max_chars(self) -> int:
        """Characters of conversation text beyond which no prompt can fit the context."""
        return self.context_length * CHARS_PER_TOKEN


def message_chars(message: Message) -> int:
    """A message's size for the budget: its text plus its structured extras (tool calls) as JSON."""
    size = len(message.content) + len(message.name or "")
    if message.extra:
        size += len(json.dumps(message.extra, default=str))
    return size


def validate_request(request: ChatRequest, limits: ModelLimits) -> ChatRequest:
    """The request, checked against ``limits`` (values normalised where the meaning is unchanged);
    raises :class:`ApiError` naming the first offending field and what is accepted."""
    request = replace(request, sampling=_sampling(request, limits))
    _check_prompt_ids(request, limits)
    _check_stops(request)
    _check_template_kwargs(request)
    _check_tools(request)
    return _within_budget(request, limits)


def _sampling(request: ChatRequest, limits: ModelLimits) -> SamplingParams:
    sampling = request.sampling
    for token, _ in sampling.logit_bias:
        if not 0 <= token < limits.vocab_size:
            raise ApiError("invalid_request", f"'logit_bias' names token id {token}; this model's token ids are "
                           f"0 to {limits.vocab_size - 1}.", param="logit_bias")
    changes: dict[str, Any] = {}
    if sampling.top_k >= limits.vocab_size:
        changes["top_k"] = 0  # every token is in the top k: the same as no top-k filtering
    if sampling.seed is not None:
        low, high = SEED_RANGE
        if not low <= sampling.seed < high:
            raise ApiError("invalid_request", f"'seed' must be a 64-bit integer (from {low} to {high - 1}); "
                           f"got {sampling.seed}.", param="seed")
        if sampling.seed < 0:
            changes["seed"] = sampling.seed % 2**64
    return replace(sampling, **changes) if changes else sampling


def _check_prompt_ids(request: ChatRequest, limits: ModelLimits) -> None:
    prompt = request.prompt
    if isinstance(prompt, tuple):
        if len(prompt) > limits.context_length:
            raise ApiError("context_length_exceeded", f"'prompt' has {len(prompt)} token ids; this model's "
                           f"context is {limits.context_length} tokens.", param="prompt")
        bad = next((t for t in prompt if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise ApiError("invalid_request", f"Token ids in 'prompt' must be between 0 and "
                           f"{limits.vocab_size - 1} (got {bad}).", param="prompt")


def check_stop_strings(stops: Sequence[str]) -> None:
    """A ``ValueError`` if ``stops`` are too many or one is empty or too long. Protocol bodies call it from their
    own field's validator, so the 400 names the field as the client wrote it (``stop``, ``stop_sequences``)."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"{len(stops)} stop sequences given; at most {MAX_STOP_STRINGS} are accepted")
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters long (got one of "
                             f"{len(stop)})")


def _check_stops(request: ChatRequest) -> None:
    """Every request's stops, whatever decoded it (the protocols that check them in their own field already
    answered; this holds for the others: Ollama's ``options.stop``, the agents API)."""
    try:
        check_stop_strings(request.stop)
    except ValueError as exc:
        raise ApiError("invalid_request", f"'stop': {exc}.", param="stop") from None


def _check_template_kwargs(request: ChatRequest) -> None:
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(k for k, _ in request.chat_template_kwargs))
    if reserved:
        raise ApiError("invalid_request", f"'chat_template_kwargs' cannot set {', '.join(reserved)}: the server "
                       "sets those itself; use the request's own fields (messages, tools) instead.",
                       param="chat_template_kwargs")


def _check_tools(request: ChatRequest) -> None:
    if len(request.tools) > MAX_TOOLS:
        raise ApiError("invalid_request", f"{len(request.tools)} tools given; at most {MAX_TOOLS} are accepted.",
                       param="tools")
    names: set[str] = set()
    for i, tool in enumerate(request.tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function,
                                                                                                      dict):
            raise ApiError("invalid_request", f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ..., \"parameters\": {...}}}.", param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ApiError("invalid_request", f"'tools[{i}].function.name' must be 1 to 128 letters, digits, "
                           f"'_', '-', '.' or ':' (got {json.dumps(name)[:80]}).", param=f"tools[{i}].function.name")
        if name in names:
            raise ApiError("invalid_request", f"Two tools are named {name!r}; tool names must be unique.",
                           param=f"tools[{i}].function.name")
        names.add(name)
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ApiError("invalid_request", f"'tools[{i}].function.parameters' must be a JSON Schema object.",
                           param=f"tools[{i}].function.parameters")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ApiError("invalid_request", f"'tools[{i}].function.description' must be a string.",
                           param=f"tools[{i}].function.description")
    choice = request.tool_choice
    if isinstance(choice, dict):
        wanted = choice.get("name")
        if wanted not in names:
            given = ", ".join(sorted(names)) or "none"
            raise ApiError("invalid_request", f"'tool_choice' names the tool {wanted!r}, which is not among the "
                           f"request's tools ({given}).", param="tool_choice")
    elif choice == "required" and not names:
        raise ApiError("invalid_request", "'tool_choice' is 'required' but the request has no tools.",
                       param="tool_choice")


def _within_budget(request: ChatRequest, limits: ModelLimits) -> ChatRequest:
    """Refuse (or, under ``drop_oldest``, trim) a conversation that cannot fit the context, by size alone."""
    if request.prompt is not None:
        if isinstance(request.prompt, str) and len(request.prompt) > limits.max_chars:
            raise _too_large("'prompt' is too long", len(request.prompt), limits, "prompt")
        return request
    tools_size = len(json.dumps(request.tools)) if request.tools else 0
    sizes = [message_chars(m) for m in request.messages]
    total = tools_size + sum(sizes)
    if total <= limits.max_chars and len(sizes) <= limits.context_length:
        return request
    if request.context_overflow == "drop_oldest":
        kept = _drop_oldest(request.messages, sizes, limits, tools_size)
        if kept is not None:
            return replace(request, messages=kept)
    if len(sizes) > limits.context_length:
        raise ApiError("context_length_exceeded", f"The request has {len(sizes)} messages; this model's context "
                       f"of {limits.context_length} tokens cannot hold that many.", param="messages")
    raise _too_large("The messages and tools are too long", total, limits, "messages")


def _drop_oldest(messages: tuple[Message, ...], sizes: list[int], limits: ModelLimits,
                 fixed: int) -> tuple[Message, ...] | None:
    """The conversation with its oldest whole turns (after the system prompt) left out until it is within the
    budget; None if even the last turn alone is not. ``chat.prepare`` then fits it to the context in tokens."""
    start = 0
    while start < len(messages) and messages[start].role in ("system", "developer"):
        start += 1
    head = fixed + sum(sizes[:start])
    # Turn boundaries: each user message after the head starts a turn; the last one is always kept.
    boundaries = [i for i in range(start, len(messages)) if messages[i].role == "user"] or [start]
    tail = sum(sizes[start:])
    cut = start
    for boundary in boundaries:
        tail -= sum(sizes[cut:boundary])
        cut = boundary
        if head + tail <= limits.max_chars and start + len(messages) - cut <= limits.context_length:
            return messages[:start] + messages[cut:]
    return None


def _too_large(what: str, size: int, limits: ModelLimits, param: str) -> ApiError:
    return ApiError("context_length_exceeded", f"{what}: {size:,} characters; this model's context of "
                    f"{limits.context_length:,} tokens cannot hold more than about {limits.max_chars:,} "
                    f"characters ({CHARS_PER_TOKEN} a token at most). Shorten it.", param=param)
