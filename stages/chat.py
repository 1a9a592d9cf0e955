"""``chat.prepare`` (template + tokenize) and ``chat.process`` (tokens → text events)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, ClassVar, cast

import trio
from jinja2 import TemplateError
from pydantic import Field

from flow.catalog.families import Family, template_text
from flow.graph.stage import EachItem, NotNow, Outbox, StageConfig, Step
from flow.resources.model import ModelResource
from protocols.errors import ApiError
from protocols.images import DecodedImage
from protocols.ir import (
    ChatRequest,
    ContextOverflow,
    Generation,
    GenerationStarted,
    Message,
    MessageEnds,
    PreparedPrompt,
    PromptImages,
    ReasoningDelta,
    ResponseFinished,
    ResponseStarted,
    StreamEvent,
    TextDelta,
    TokenChunk,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)
from protocols.limits import ModelLimits, message_chars, validate_request
from protocols.parsers import REASONING_PARSERS, ResponseParser, make_response_parser
from protocols.stops import StopMatcher
from stages.images import DecodedImages, ImagePolicy, PixelBudget, load_images
from stages.loop_share import LoopShare
from stages.model_stage import ModelStage
from stages.prompt_tokens import PROMPT_TOKENS
from stages.templating import template_inputs

if TYPE_CHECKING:
    from runtime.models import LoadedModel

log = logging.getLogger("flow.stages.chat")


class ModelStageConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="model resources served (default: all)")


def render_prompt(tokenizer: Any, request: ChatRequest, family: Family, vision: bool = False,
                  generation_prompt: bool = True) -> str:
    """Apply the model's chat template, adapted to its family (or a plain fallback without one); ``vision``: the
    model reads the images, which go to the template as image parts; ``generation_prompt``: end with the
    template's opening of the model's answer."""
    template = getattr(tokenizer, "chat_template", None)
    messages, tools, kwargs = template_inputs(request, family, template_text(template), vision)
    if template is None:
        turns = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return turns + ("assistant: " if generation_prompt else "")
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                             tokenize=False, **kwargs)
    except TemplateError as exc:
        raise ApiError("invalid_request", f"The model's chat template rejected these messages: {exc}",
                       param="messages") from None
    except (TypeError, ValueError, LookupError, AttributeError, RecursionError) as exc:
        # The template is the model's and fixed: what makes it fail is the request's content (a value of a
        # type the template does not expect, nesting it recurses into).
        log.info("chat template failed on request %s: %s: %s", request.request_id, type(exc).__name__, exc)
        raise ApiError("invalid_request", "The model's chat template could not render these messages "
                       f"({type(exc).__name__}); check the types of message contents, tool calls and "
                       "chat_template_kwargs.", param="messages") from None
    return str(text)


def turn_point(tokenizer: Any, request: ChatRequest, family: Family, text: str, ids: tuple[int, ...],
               vision: bool = False) -> int | None:
    """Where ``ids`` (``text`` tokenized, or a vision model's processor's expansion of it: image tokens come before
    the generation prompt, so its tail is the same) end their messages and begin the template's generation prompt
    — ``len(ids)`` when the conversation's next turn repeats the generation prompt too (the prompt's end is then
    where it goes on) — or None; ``vision``: rendered as for a model that reads images.

    The generation prompt (with this request's template switches, such as thinking) is read off a one-message
    conversation rendered with and without it, and the next turn's rendering off that message answered and asked
    again: small renders, not a second one of the whole conversation."""
    asked = Message(role="user", content="?")
    probe = replace(request, messages=(asked,))
    opened = render_prompt(tokenizer, probe, family, vision=vision)
    answered = render_prompt(tokenizer, replace(request, messages=(asked, Message(role="assistant", content="Sure."),
                                                                   asked)),
                             family, vision=vision, generation_prompt=False)
    if answered.startswith(opened):  # the same probes each request (tools and all): tokenized once
        head = PROMPT_TOKENS.encode(tokenizer, opened)
        if PROMPT_TOKENS.encode(tokenizer, answered)[: len(head)] == head:
            return len(ids)
    plain = render_prompt(tokenizer, probe, family, vision=vision, generation_prompt=False)
    suffix = opened[len(plain):] if opened.startswith(plain) else ""
    if not suffix or not text.endswith(suffix):
        return None
    tail = tuple(tokenizer.encode(suffix, add_special_tokens=False))
    return len(ids) - len(tail) if tail and len(tail) < len(ids) and ids[-len(tail):] == tail else None


# A prompt this short (messages' characters, no tools, no images) is templated and tokenized on the event loop (within a
# share of its time: stages/loop_share.py): well under a millisecond, where a worker thread's round trip costs ~0.2 ms
# of CPU and as much of its time to first token.
INLINE_PROMPT_CHARS = 1024

PROBE = "\u2063probe\u2063"  # a user message no real one begins with (invisible separators around a word)


def system_end(tokenizer: Any, request: ChatRequest, family: Family, text: str, ids: tuple[int, ...],
               vision: bool = False) -> int | None:
    """Where ``ids`` (``text`` tokenized) leave the leading system and developer messages behind — as deep as any
    conversation under them agrees, the next message's opening included — or None: when there are none, or the
    template renders them otherwise (the token ids tell).

    Read off the leading messages rendered with a probe user message after them (templates that want a user
    message, or fold the system prompt into the first user turn, render it all the same): the text before the
    probe, less its last token (which the real message may merge with); its ids mostly the prompt's own, reused
    (:mod:`stages.prompt_tokens`)."""
    leading, turns = turn_groups(request.messages)
    if not leading or not turns:
        return None
    try:
        probed = render_prompt(tokenizer, replace(request, messages=(*leading, Message(role="user", content=PROBE))),
                               family, vision=vision, generation_prompt=False)
    except ApiError:
        return None
    head_text = probed[: probed.find(PROBE)] if PROBE in probed else ""
    if not head_text or not text.startswith(head_text):
        return None
    head = PROMPT_TOKENS.encode(tokenizer, head_text)[:-1]
    return len(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else None


def turn_groups(messages: tuple[Message, ...]) -> tuple[tuple[Message, ...], list[tuple[Message, ...]]]:
    """The leading system (and developer) messages, and the turns after them: each turn a user
    message with the assistant and tool messages that follow it (messages before the first user
    message form a turn of their own). Dropping whole turns keeps tool calls with their results."""
    start = 0
    while start < len(messages) and messages[start].role in ("system", "developer"):
        start += 1
    turns: list[list[Message]] = []
    for message in messages[start:]:
        if message.role == "user" or not turns:
            turns.append([])
        turns[-1].append(message)
    return messages[:start], [tuple(t) for t in turns]


class PrepareConfig(ModelStageConfig):
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="max_tokens for requests that give none (default: the model resource's "
                                        "default_max_tokens); changing it in a live reload keeps the model loaded")
    stop_tokens: list[str] = Field(
        default_factory=list,
        description="extra tokens that end generation (e.g. end-of-turn tokens the tokenizer config omits)")
    context_overflow: ContextOverflow = Field(
        default="error",
        description="messages + max_tokens longer than the context: error (context_length_exceeded), or "
                    "drop_oldest (leave out the oldest turns after the system prompt, never the last user "
                    "message); a request may say otherwise (the agents API does)")
    images: ImagePolicy = Field(
        default_factory=ImagePolicy,
        description="images for vision models: max_bytes, max_pixels, max_images per request, and URL fetching "
                    "(fetch_urls, off by default; allow_hosts, fetch_timeout_seconds, fetch_max_bytes)")


class ChatPrepare(ModelStage[ChatRequest, PreparedPrompt]):
    type_name: ClassVar[str] = "chat.prepare"
    Config = PrepareConfig
    description = "applies the model's chat template, tokenizes, sets stop tokens and the token budget"

    def setup(self) -> None:
        super().setup()
        self._stop_ids: dict[str, frozenset[int]] = {}
        self._decoded = DecodedImages()  # the screenshot a conversation resends each turn is decoded once
        self._pixels = PixelBudget(self.config.images.max_inflight_pixels)  # type: ignore[attr-defined]
        self._on_loop = LoopShare()  # short prompts prepared on the event loop, within a share of its time

    def stop_ids(self, model: str, tokenizer: Any) -> frozenset[int]:
        """The tokenizer's end tokens plus the configured extra ones (resolved once per model)."""
        found = self._stop_ids.get(model)
        if found is None:
            extra: set[int] = set()
            configured: list[str] = self.config.stop_tokens  # type: ignore[attr-defined]
            for token in [*configured, *self.models.lookup(model).family.stop_tokens]:
                token_id = tokenizer.convert_tokens_to_ids(token)
                if token_id is None or token_id == getattr(tokenizer, "unk_token_id", None):
                    log.warning("stage %s: stop token %r is not in model %s's vocabulary", self.id, token, model)
                    continue
                extra.add(int(token_id))
            found = self._stop_ids[model] = frozenset(tokenizer.eos_token_ids) | extra
        return found

    @staticmethod
    def _check_kv_budget(resource: Any, loaded: Any, prompt_tokens: int, max_tokens: int) -> None:
        """Refuse up front what could only end in running out of memory."""
        tokens = prompt_tokens + max_tokens
        need = loaded.engine.kv_bytes_for(tokens)  # quantized past its start, with the model's kv_bits
        budget = resource.kv_budget_bytes
        if need > budget:
            raise ApiError(
                "context_length_exceeded",
                f"This request needs about {need / 2**20:.0f} MiB of KV cache ({prompt_tokens} prompt tokens + "
                f"{max_tokens} max_tokens, about {need // tokens} bytes each), more than this model's budget of "
                f"{budget / 2**20:.0f} MiB; shorten the messages or lower max_tokens.", param="max_tokens")

    def _refuse_images(self, request: ChatRequest, resource: ModelResource) -> None:
        """Images in the message a request asks about now need a model that reads them; earlier ones stay
        markers (an agent whose history holds a screenshot goes on)."""
        last = request.messages[-1] if request.messages else None
        if last is None or last.role != "user" or not last.images or resource.kind == "vision":
            return
        readers = self.models.able("vision", known=True)
        raise ApiError("invalid_request", f"The model {request.model!r} reads text only, and the last message "
                       f"holds {len(last.images)} image{'s' if len(last.images) > 1 else ''}. Models on this server "
                       f"that read images: {', '.join(readers) or '(none)'}.", param="messages",
                       code="images_not_supported")

    def prepare(self, request: ChatRequest, images: Sequence[DecodedImage] = ()) -> PreparedPrompt:
        """The request's prompt; ``images``: every image of the request, decoded, in prompt order, when the model
        reads them (a vision model)."""
        resource = self.models.lookup(request.model)
        self._refuse_images(request, resource)
        loaded = resource.require()
        tokenizer = loaded.tokenizer
        # Checked against the model before any templating or tokenizing (which cost many times the text).
        request = validate_request(replace(request, context_overflow=self._overflow(request)),
                                   ModelLimits(loaded.vocab_size, self._limit(loaded, request)))
        prompt_images: PromptImages | None = None
        if isinstance(request.prompt, tuple):
            ids = request.prompt
            text = tokenizer.decode(list(ids))
        elif isinstance(request.prompt, str):
            # A raw prompt gets the tokenizer's own special tokens (BOS), as in mlx-lm's server.
            text = request.prompt
            ids = tuple(tokenizer.encode(text))
        else:
            text, ids, prompt_images = self._render_within(loaded, request, resource.family,
                                                           self._limit(loaded, request), images)
        if not ids:
            raise ApiError("invalid_request", "The prompt is empty after applying the chat template.", param="messages")
        self._check_kv_budget(resource, loaded, len(ids), request.max_tokens or 1)
        limit = self._limit(loaded, request)
        room = limit - len(ids)
        what = (f"This model's maximum context length is {limit} tokens" if limit == loaded.context_length
                else f"This conversation's max_context is {limit} tokens")
        dropping = self._overflow(request) == "drop_oldest" and request.prompt is None
        dropped = ", even with its earlier turns left out" if dropping else ""
        if request.max_tokens is not None:
            if request.max_tokens > room:
                raise ApiError(
                    "context_length_exceeded",
                    f"{what}. The messages use {len(ids)} tokens and max_tokens asks for {request.max_tokens}, "
                    f"{len(ids) + request.max_tokens} in all{dropped}; "
                    f"{'shorten the last message' if dropping else 'reduce the messages'} or max_tokens.",
                    param="max_tokens",
                )
            max_tokens = request.max_tokens
        else:
            if room < 1:
                raise ApiError(
                    "context_length_exceeded",
                    f"{what} and the messages already use {len(ids)}{dropped}; "
                    f"{'shorten the last message' if dropping else 'shorten them'}.",
                    param="messages",
                )
            default = self.config.default_max_tokens or resource.config.default_max_tokens  # type: ignore[attr-defined]
            max_tokens = min(default, room)
        engine = getattr(loaded, "engine", None)
        # A hybrid model's recurrent state is kept where the messages end, for the conversation's next turn (an image
        # row's too: Qwen3.5's vision models are hybrids, and the next turn repeats its images' span before there).
        ends = MessageEnds()
        if request.prompt is None and engine is not None and engine.keeps_snapshots:
            vision = loaded.processor is not None
            ends = MessageEnds(system=system_end(tokenizer, request, resource.family, text, ids, vision=vision),
                               last=turn_point(tokenizer, request, resource.family, text, ids, vision=vision))
        return PreparedPrompt(request=request, model=resource.name, token_ids=ids,
                              stop_token_ids=self.stop_ids(resource.name, tokenizer), max_tokens=max_tokens, text=text,
                              images=prompt_images, message_ends=ends)

    def _overflow(self, request: ChatRequest) -> ContextOverflow:
        return request.context_overflow or self.config.context_overflow  # type: ignore[attr-defined]

    @staticmethod
    def _limit(loaded: Any, request: ChatRequest) -> int:
        """Tokens of prompt + max_tokens allowed: the model's context, or the request's lower cap."""
        limit: int = loaded.context_length
        return min(limit, request.max_context) if request.max_context else limit

    def _render_within(self, loaded: LoadedModel, request: ChatRequest, family: Family, limit: int,
                       images: Sequence[DecodedImage]) -> tuple[str, tuple[int, ...], PromptImages | None]:
        """The prompt's text, ids and images; under ``drop_oldest``, with as few of the oldest turns left out as
        makes prompt + max_tokens fit in ``limit`` (when nothing does, the shortest: the caller refuses it)."""
        tokenizer = loaded.tokenizer

        def render(messages: tuple[Message, ...]) -> tuple[str, tuple[int, ...], PromptImages | None]:
            text = render_prompt(tokenizer, replace(request, messages=messages), family,
                                 vision=loaded.processor is not None)
            kept = images[len(images) - sum(len(m.images) for m in messages):]  # left-out turns take theirs
            if not kept:
                return text, PROMPT_TOKENS.encode(tokenizer, text), None
            from runtime.vision import prompt_inputs  # mlx-vlm: once a vision model serves

            ids, prompt_images = prompt_inputs(loaded.processor, loaded.config.get("model_type", ""), text,
                                               [i.image for i in kept], [i.digest for i in kept],
                                               loaded.model.image_token_id)
            return text, ids, prompt_images

        def fits(ids: tuple[int, ...]) -> bool:
            return len(ids) + (request.max_tokens or 1) <= limit

        full = render(request.messages)
        if fits(full[1]) or self._overflow(request) != "drop_oldest":
            return full
        head, turns = turn_groups(request.messages)
        # Fewest turns to drop (never the last, which holds the newest user message): binary search,
        # as prompts only shrink with more turns left out.
        low, high, best = 1, len(turns) - 1, None
        while low <= high:
            middle = (low + high) // 2
            attempt = render(head + tuple(m for turn in turns[middle:] for m in turn))
            if fits(attempt[1]):
                best, high = (middle, attempt), middle - 1
            else:
                low = middle + 1
        if best is None:  # not even the last turn fits: the caller's error counts what is left of the prompt
            return render(head + turns[-1]) if len(turns) > 1 else full
        dropped, prompt = best
        log.info("stage %s: %d-token prompt + max_tokens over the %d-token limit; left out the oldest %d of %d "
                 "turns (%d tokens now)", self.id, len(full[1]), limit, dropped, len(turns), len(prompt[1]))
        return prompt

    def open_step(self) -> Step[ChatRequest, PreparedPrompt]:
        return EachItem(self._prepared)

    async def _prepared(self, request: ChatRequest) -> PreparedPrompt:
        resource = self.models.lookup(request.model)
        if request.load_only and request.keep_alive == 0:  # "let it go": nothing to load
            if resource.ready:
                resource.keep_for(0)
            return PreparedPrompt(request, resource.name, (), frozenset(), 0)
        await resource.ensure_loaded()  # a lazy or evicted model loads now
        resource.keep_for(request.keep_alive)
        if request.load_only:  # loading was all it asked for: nothing to template
            return PreparedPrompt(request, resource.name, (), frozenset(), 0)
        async with self._pixels.reserve() as pixels:  # held while the images are decoded and preprocessed
            images: list[DecodedImage] = []
            if resource.kind == "vision" and any(m.images for m in request.messages):
                images = await load_images(request.messages, self.config.images,  # type: ignore[attr-defined]
                                           self._decoded, pixels)
            if not images and short_prompt(request) and self._on_loop.available():
                with self._on_loop.spending():
                    return self.prepare(request, images)
            # Templating and tokenizing an agent-sized prompt (and an image's pixels) takes milliseconds: keep
            # it off the event loop.
            return await trio.to_thread.run_sync(self.prepare, request, images)


def short_prompt(request: ChatRequest) -> bool:
    """Whether the request's prompt is short enough to template and tokenize on the event loop
    (:data:`INLINE_PROMPT_CHARS`): text messages without tools, or a short raw prompt."""
    if request.tools:
        return False
    if isinstance(request.prompt, tuple):  # token ids: decoded to text (a few characters each)
        return len(request.prompt) <= INLINE_PROMPT_CHARS // 4
    if isinstance(request.prompt, str):
        return len(request.prompt) <= INLINE_PROMPT_CHARS
    total = 0
    for message in request.messages:
        if message.images:
            return False
        total += message_chars(message)
        if total > INLINE_PROMPT_CHARS:
            return False
    return True


def response_parser(request: ChatRequest, family: Family, prompt_text: str) -> ResponseParser | None:
    """The family's parsers for one chat response; raw completions are returned as written."""
    if request.prompt is not None:
        return None
    with_tools = bool(request.tools) and request.tool_choice != "none"
    reasoning_id = family.reasoning.parser
    options: dict[str, Any] = dict(family.reasoning.options)
    if _takes_starts_inside(reasoning_id):
        # Templates that open the thinking block themselves make the output start inside it.
        options["starts_inside"] = prompt_text.rstrip().endswith(family.reasoning.open_tag)
    return make_response_parser(tool_parser=family.tools.parser if with_tools else None,
                                reasoning_parser=reasoning_id, tools=request.tools, reasoning_options=options,
                                loose_tool_calls=with_tools and family.tools.loose_calls,
                                tool_options=family.tools.options)


@functools.cache  # asked for every response: a signature is tens of microseconds
def _takes_starts_inside(reasoning_id: str) -> bool:
    return "starts_inside" in inspect.signature(REASONING_PARSERS[reasoning_id]).parameters


def _token_strings(tokenizer: Any, logprob: TokenLogprob) -> TokenLogprob:
    """Engine logprobs carry token ids; clients want the tokens' text."""
    return TokenLogprob(
        tokenizer.decode([logprob.token]), logprob.logprob,
        tuple((tokenizer.decode([t]), value) for t, value in logprob.top),
    )


class ChatProcess(ModelStage[Generation, StreamEvent]):
    type_name: ClassVar[str] = "chat.process"
    Config = ModelStageConfig
    description = "detokenizes (multi-byte safe), matches stop strings with hold-back, reports finish and usage"

    def open_step(self) -> Step[Generation, StreamEvent]:
        return _Processing(self)


class _Processing(Step[Generation, StreamEvent]):
    """One response: its header, then each chunk turned into events, choice by choice; it wants no more once
    every choice has finished (then generate drops the sequences)."""

    def __init__(self, stage: ChatProcess) -> None:
        self.stage = stage
        self.request: ChatRequest | None = None
        self.choices: list[_ChoiceStream] = []
        self.running = 0
        self.answered_empty = False  # a load-only request's empty answer went out

    async def feed(self, item: Generation, out: Outbox[StreamEvent]) -> bool:
        request = self.request
        if request is None:
            return await self._start(item, out)
        assert isinstance(item, TokenChunk)
        if request.load_only:  # nothing was generated (the model may not even be loaded): empty and finished
            if item.finish_reason is None:
                return True
            await self._empty(request, out)
            return False
        events = self._chunk_events(item)
        for event in events:
            await out.send(event)
        return self.running > 0

    def feed_now(self, item: Generation, out: Outbox[StreamEvent]) -> bool:
        request = self.request
        if request is None or request.load_only or not isinstance(item, TokenChunk):
            raise NotNow  # the header, or a load-only answer: fed by the task
        for event in self._chunk_events(item):
            out.send_now(event)
        return self.running > 0

    def _chunk_events(self, chunk: TokenChunk) -> list[StreamEvent]:
        choice = self.choices[chunk.choice]
        events = choice.feed(chunk)
        if choice.done:
            self.running -= 1
        return events

    async def _start(self, header: Generation, out: Outbox[StreamEvent]) -> bool:
        if not isinstance(header, GenerationStarted):
            raise TypeError(f"chat.process expects GenerationStarted first, got {type(header).__name__}")
        prompt = header.prompt
        request = self.request = prompt.request
        if request.load_only:
            return True
        resource = self.stage.models.lookup(prompt.model)
        tokenizer = resource.require().tokenizer
        self.choices = [_ChoiceStream(header, tokenizer, response_parser(request, resource.family, prompt.text), i)
                        for i in range(request.n)]
        self.running = request.n
        await out.send(ResponseStarted(request, header.prompt_tokens, header.cached_tokens, prompt.text,
                                       header.cache_write_tokens))
        return True

    async def _empty(self, request: ChatRequest, out: Outbox[StreamEvent]) -> None:
        self.answered_empty = True
        await out.send(ResponseStarted(request, 0))
        await out.send(ResponseFinished("stop", Usage()))

    async def end(self, out: Outbox[StreamEvent]) -> None:
        if self.request is not None and self.request.load_only:
            if not self.answered_empty:
                await self._empty(self.request, out)
        elif self.running or self.request is None:
            raise ApiError("internal", "generation ended without a finish reason")


class _ChoiceStream:
    """One choice's output: detokenized (multi-byte safe), stop strings matched with hold-back, parsed into
    content, reasoning and tool calls, finished with its usage."""

    def __init__(self, header: GenerationStarted, tokenizer: Any, parser: ResponseParser | None, choice: int) -> None:
        self.header = header
        self.request = header.prompt.request
        self.tokenizer = tokenizer
        self.detokenizer = tokenizer.detokenizer
        self.stops = StopMatcher(self.request.stop)
        self.parser = parser
        self.choice = choice
        # The parser's events go out as they are: the first choice's (no index to set) and never a call (none
        # to count or hold back).
        self.as_parsed = choice == 0 and (parser is None or parser.no_calls)
        self.calls = 0
        self.completion_tokens = 0
        self.done = False

    def feed(self, chunk: TokenChunk) -> list[StreamEvent]:
        request, stops, detokenizer = self.request, self.stops, self.detokenizer
        self.completion_tokens += len(chunk.token_ids)
        for token in chunk.token_ids:
            detokenizer.add_token(token)
        if chunk.finish_reason is not None:
            detokenizer.finalize()
        text = stops.feed(detokenizer.last_segment)
        finish = chunk.finish_reason
        if stops.matched is not None:
            finish = "stop"
        elif finish is not None:
            text += stops.flush()
        logprobs = tuple(_token_strings(self.tokenizer, lp) for lp in chunk.logprobs) if chunk.logprobs else ()
        events: list[TextDelta | ReasoningDelta | ToolCallDelta]
        if self.parser is None:
            events = [TextDelta(text, logprobs)] if text or logprobs else []
        else:
            events = self.parser.feed(text)
            if finish is not None:
                events = [*events, *self.parser.finish()]
            if logprobs:
                events = [*events, TextDelta("", logprobs)]
        out: list[StreamEvent]
        if self.as_parsed:  # per token: the list itself (built afresh for this chunk: ours to append to)
            out = cast(list[StreamEvent], events)
        else:
            out = []
            for event in events:
                if isinstance(event, ToolCallDelta):
                    if event.index > 0 and not request.parallel_tool_calls:
                        continue  # the client asked for one call at a time
                    self.calls = max(self.calls, event.index + 1)
                out.append(replace(event, choice=self.choice) if self.choice else event)
        if finish is not None:
            if self.calls and finish == "stop":
                finish = "tool_calls"
            h = self.header
            usage = Usage(h.prompt_tokens, self.completion_tokens, h.cached_tokens, h.cache_write_tokens)
            out.append(ResponseFinished(finish, usage, stop_sequence=stops.matched, choice=self.choice))
            self.done = True
        return out
