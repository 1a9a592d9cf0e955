"""The closed set of items that travel on graph edges.

Theory of operation
-------------------
A request enters as an :class:`HttpRequest`, an entry stage decodes it into a
protocol-neutral :class:`ChatRequest`, ``chat.prepare`` turns that into a
:class:`PreparedPrompt` (token ids), ``generate`` streams :class:`TokenChunk`
items (several tokens each: one per engine step), ``chat.process`` turns tokens
into :class:`StreamEvent` items, and an exit stage encodes those as
:class:`WireFrame` items that the HTTP shell writes out.

Streams that need context carry it in a *header* item that comes first:
``generate`` sends :class:`GenerationStarted` before its chunks, and
``chat.process`` sends :class:`ResponseStarted` before its deltas. Every later
stage therefore sees everything it needs on its one input, and nothing hides in
shared per-request state.

All items are frozen dataclasses: cheap to build on the per-token path and safe
to hand between tasks.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, Union

import numpy as np

from protocols.documents import media_marker

FinishReason = Literal["stop", "length", "tool_calls", "error", "cancelled"]
Role = Literal["system", "developer", "user", "assistant", "tool"]
# What ``chat.prepare`` does with a conversation longer than the context: refuse it (a
# ``context_length_exceeded`` error), or leave out its oldest turns after the system prompt.
ContextOverflow = Literal["error", "drop_oldest"]


def new_request_id() -> str:
    """A request's id (24 hex digits): in logs, error messages and the ids of what it stores, so unguessable."""
    return secrets.token_hex(12)


@dataclass(frozen=True)
class HttpRequest:
    """What the HTTP shell hands an entry stage."""

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    request_id: str
    # Values of the route's path parameters (``/v1/responses/{id}``), by name.
    params: tuple[tuple[str, str], ...] = ()

    def param(self, name: str) -> str:
        return dict(self.params)[name]

    def header(self, name: str) -> str | None:
        lowered = name.lower()
        for key, value in self.headers:
            if key.lower() == lowered:
                return value
        return None


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling; the defaults are greedy decoding."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    repetition_context_size: int = 20
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Report each sampled token's log-probability and this many top alternatives (None: off).
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class ResponseFormat:
    """Output the request constrains generation to: any JSON object, or JSON matching ``schema`` (``strict``:
    keywords the grammar compiler does not implement are errors, not ignored). Protocol-neutral: OpenAI's
    ``response_format`` and ``text.format``, Anthropic's ``output_config.format``."""

    type: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    name: str = ""
    strict: bool = False


CacheMode = Literal["full", "prefix"]


@dataclass(frozen=True)
class CachePolicy:
    """How a request's KV cache is kept for later requests (the prefix cache).

    ``mode``: ``full`` keeps the prompt and the answer (the next turn of the
    conversation reuses both), ``prefix`` only the prompt. ``ttl_seconds``: how
    long its blocks live after their last use (None: the cache's default; 0: in
    memory only, never written to disk). ``session_id`` names a conversation
    (OpenAI extension field, the agents API) so its cache state can be reported. ``audit`` asks for this
    request's prefix hit to be recomputed cold on idle device time and compared (``cache_audit``; runtime's
    prefix audit), whatever the cache's ``audit_rate``.
    """

    mode: CacheMode = "full"
    ttl_seconds: float | None = None
    session_id: str | None = None
    audit: bool = False  # recompute a prefix hit cold and compare its first logits (``flow cache verify``)


# Where an image sits in ``Message.content``: one per entry of ``Message.images``, in order. Decoders remove the
# character from client text, so slots and images always pair up.
IMAGE_SLOT = "\ufffc"  # OBJECT REPLACEMENT CHARACTER


def without_slots(text: str) -> str:
    """Client text with any :data:`IMAGE_SLOT` characters of its own removed (they would pose as images)."""
    return text.replace(IMAGE_SLOT, "") if IMAGE_SLOT in text else text


def content_parts(content: str) -> list[dict[str, str]]:
    """Content with image slots as multimodal template parts: the text between the slots and an image at each,
    in order (no empty text parts)."""
    out: list[dict[str, str]] = []
    for i, text in enumerate(content.split(IMAGE_SLOT)):
        if i:
            out.append({"type": "image"})
        if text:
            out.append({"type": "text", "text": text})
    return out


@dataclass(frozen=True)
class ImageSource:
    """An image as the client sent it, not yet read: inline bytes or a URL (``stages.images`` loads it)."""

    data: bytes | None = None  # inline bytes (base64 / data: URL, already decoded)
    url: str | None = None  # an http(s) URL the server may fetch (policy decides); never a file path
    media_type: str | None = None  # as the client declared it, if it did
    detail: str | None = None  # OpenAI 'detail' (accepted, recorded)

    def __repr__(self) -> str:  # the bytes would flood logs and tracebacks
        data = None if self.data is None else f"<{len(self.data)} bytes>"
        return (f"ImageSource(data={data}, url={self.url!r}, media_type={self.media_type!r}, "
                f"detail={self.detail!r})")


@dataclass(frozen=True)
class Message:
    """One chat message, already in the shape chat templates expect.

    ``images`` are the images the client attached, each at an :data:`IMAGE_SLOT` in ``content`` (in order).
    """

    role: Role
    content: str
    name: str | None = None
    extra: tuple[tuple[str, Any], ...] = ()
    images: tuple[ImageSource, ...] = ()

    def __post_init__(self) -> None:
        if self.images and self.content.count(IMAGE_SLOT) != len(self.images):
            raise ValueError(f"a message with {len(self.images)} images has {self.content.count(IMAGE_SLOT)} "
                             "image slots in its content")

    def template_content(self, vision: bool = False) -> str:
        """The content as a template reads it: for a model that reads images (``vision``), with a slot where each
        image sits (:func:`content_parts` makes the parts) and no stray slot (one a model wrote itself is no
        image); for a text model, a marker for each image."""
        if not self.images:
            return without_slots(self.content) if vision else self.content
        return self.content if vision else self.content.replace(IMAGE_SLOT, media_marker("image"))

    def to_template(self) -> dict[str, Any]:
        """The message as a text model's chat template takes it (each image a marker)."""
        out: dict[str, Any] = {"role": self.role, "content": self.template_content()}
        if self.name is not None:
            out["name"] = self.name
        out.update(dict(self.extra))
        return out

    @classmethod
    def from_template(cls, message: dict[str, Any]) -> Message:
        """The inverse of :meth:`to_template` (stored conversations are kept in template shape, images as
        markers)."""
        rest = {k: v for k, v in message.items() if k not in ("role", "content", "name")}
        content = message.get("content") or ""
        if isinstance(content, list):  # parts: their text, an image as the text models' marker
            content = "".join(str(p.get("text", "")) if p.get("type") == "text" else media_marker("image")
                              for p in content if isinstance(p, dict))
        return cls(role=message["role"], content=without_slots(content), name=message.get("name"),
                   extra=tuple(rest.items()))


@dataclass(frozen=True)
class ProtocolContext:
    """What a protocol's entry stage hands its exit stage beside the chat request: echoed request fields,
    ids, where a stored conversation starts. This base carries nothing. Entry stage classes declare the
    context they hand on (``context_type``), exit stage classes the one they read (``reads_context``);
    the compiler rejects a route whose exit cannot read its entry's context."""


NO_CONTEXT = ProtocolContext()
C = TypeVar("C", bound=ProtocolContext)


@dataclass(frozen=True)
class ChatRequest:
    """A protocol-neutral chat request."""

    model: str
    messages: tuple[Message, ...]
    max_tokens: int | None = None
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function-tool shape: {"type": "function", "function": {...}}
    tool_choice: str | dict[str, Any] | None = None  # "auto" | "none" | "required" | {"name": ...}
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None  # None: free text
    thinking: bool | None = None  # None: the model's default
    reasoning_effort: str | None = None  # low / medium / high as the client asked; None: not graded
    reasoning_budget: int | None = None  # thinking tokens the client allows (Anthropic's budget_tokens)
    chat_template_kwargs: tuple[tuple[str, Any], ...] = ()
    # A raw prompt (legacy completions): used as is, no chat template. Text or token ids.
    prompt: str | tuple[int, ...] | None = None
    request_id: str = ""
    created: int = 0
    user: str | None = None
    cache: CachePolicy = CachePolicy()
    adapter: tuple[str, ...] | None = None  # LoRA adapter ids, stacked in order (None: the model id's default)
    n: int = 1  # choices (OpenAI's n): rows of the batch sharing the prompt's prefill, events tagged by choice
    # A context limit below the model's (tokens of prompt + max_tokens; None: the model's own),
    # and what to do when the messages do not fit (None: the ``chat.prepare`` stage's setting).
    max_context: int | None = None
    context_overflow: ContextOverflow | None = None
    # How long the model should stay loaded once idle after this request, in seconds (Ollama's keep_alive):
    # negative, as long as the server keeps it; 0, unload it once idle; None, as the graph's pool decides.
    keep_alive: float | None = None
    # A control request with nothing to generate (Ollama's empty-prompt call): the model loads (or, with a
    # keep_alive of 0, is let go), and the answer is an empty, finished response.
    load_only: bool = False
    # What the protocol's entry stage hands its exit stage (echoed fields, ids); other stages ignore it.
    context: ProtocolContext = field(default_factory=lambda: NO_CONTEXT)

    def context_as(self, kind: type[C]) -> C:
        """The context, as the type the route's exit stage declared (the compiler checked the route)."""
        if not isinstance(self.context, kind):
            raise TypeError(f"this request carries {type(self.context).__name__}, not {kind.__name__}")
        return self.context


@dataclass(frozen=True)
class ImageSpan:
    """A run of image tokens in a prompt: positions ``[start, end)``, the digest of the image's decoded pixels, and
    where the run starts within that image's tokens (a tiling processor writes several runs per image)."""

    start: int
    end: int
    digest: bytes
    offset: int = 0


@dataclass(frozen=True, eq=False)
class PromptImages:
    """A prompt's images as the model's processor made them: its arrays besides the token ids (pixel values,
    masks, grid sizes: numpy arrays, by the processor's names) and where each image's tokens sit."""

    arrays: tuple[tuple[str, Any], ...]
    spans: tuple[ImageSpan, ...]


@dataclass(frozen=True)
class MessageEnds:
    """Where a rendered chat prompt's messages end, in its tokens (None: the template does not say, or nobody
    asked): ``system`` after the leading system (and developer) messages, ``last`` after the last message, where
    the template's generation prompt begins (the prompt's length when the next turn repeats that too). A hybrid
    model keeps its recurrent state at both: another conversation under the same system prompt repeats the prompt
    up to the first, this conversation's next turn up to the second."""

    system: int | None = None
    last: int | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """A templated, tokenized prompt ready for the engine."""

    request: ChatRequest
    model: str  # the served model's canonical id (the request may have named an alias)
    token_ids: tuple[int, ...]
    stop_token_ids: frozenset[int]
    max_tokens: int
    text: str = ""
    images: PromptImages | None = None  # a vision model's prompt with images: what its tokens leave out
    message_ends: MessageEnds = MessageEnds()


@dataclass(frozen=True)
class GenerationStarted:
    """Header of a generation stream: the engine accepted the prompt."""

    prompt: PreparedPrompt
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens read from the prefix cache
    cache_write_tokens: int = 0  # prompt tokens this request adds to the prefix cache


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's log-probability and the top alternatives (ids at the engine,
    strings after ``chat.process``)."""

    token: int | str
    logprob: float
    top: tuple[tuple[int | str, float], ...] = ()


_Frozen = TypeVar("_Frozen")


def made_per_token(cls: type[_Frozen]) -> type[_Frozen]:
    """A frozen dataclass made for every streamed token gets an ``__init__`` that fills the instance's
    ``__dict__`` directly: the generated one sets each field through ``object.__setattr__`` (to get past the
    frozen check), at about twice the cost. Fields, defaults, equality, hashing and the frozen check are the
    dataclass's own."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if hasattr(cls, "__post_init__") or any(f.default_factory is not dataclasses.MISSING or not f.init
                                             for f in fields):
        raise TypeError(f"{cls.__name__}: only plain fields with plain defaults")
    defaults = {f"_default_{f.name}": f.default for f in fields if f.default is not dataclasses.MISSING}
    params = ", ".join(f.name if f.default is dataclasses.MISSING else f"{f.name}=_default_{f.name}" for f in fields)
    body = "".join(f"    d[{f.name!r}] = {f.name}\n" for f in fields)
    namespace: dict[str, Any] = {}
    exec(f"def __init__(self, {params}):\n    d = self.__dict__\n{body}", defaults, namespace)  # noqa: S102
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


@made_per_token
@dataclass(frozen=True)
class TokenChunk:
    """The tokens one engine step produced for one sequence.

    ``finish_reason`` is set on the last chunk of a sequence: ``"stop"`` when a
    stop token was sampled (that token is *not* in ``token_ids``), ``"length"``
    when ``max_tokens`` was reached.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the request asked for them
    choice: int = 0  # which of the request's choices (``n``) the tokens belong to


Generation = Union[GenerationStarted, TokenChunk]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, read from the prefix cache
    cache_write_tokens: int = 0  # of prompt_tokens, written to the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(frozen=True)
class ResponseStarted:
    """Header of an event stream: everything a format stage needs up front."""

    request: ChatRequest
    prompt_tokens: int
    cached_tokens: int = 0
    prompt_text: str = ""  # the prompt as text (legacy completions echo it)
    cache_write_tokens: int = 0


# Every event of a response's choices carries its ``choice`` (0 unless the request asked for several, ``n``).


@made_per_token
@dataclass(frozen=True)
class TextDelta:
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens behind this text, when asked for
    choice: int = 0


@made_per_token
@dataclass(frozen=True)
class ReasoningDelta:
    text: str
    choice: int = 0


@dataclass(frozen=True)
class ToolCall:
    """One complete tool call, arguments as a JSON object string."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A fragment of tool call ``index``; ``id``/``name`` come on its first fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    choice: int = 0


@dataclass(frozen=True)
class ResponseFinished:
    finish_reason: FinishReason
    usage: Usage
    # Which stop string ended the text, if any (Anthropic reports it).
    stop_sequence: str | None = None
    choice: int = 0  # the choice that finished; its usage counts its own completion tokens


StreamEvent = Union[ResponseStarted, TextDelta, ReasoningDelta, ToolCallDelta, ResponseFinished]

# Names for the union item types, for error messages and drawings.
UNION_NAMES: dict[Any, str] = {Generation: "Generation", StreamEvent: "StreamEvent"}


@dataclass(frozen=True)
class TextRun:
    """A run of an answer's text, unbroken by reasoning or a call."""

    text: str


@dataclass(frozen=True)
class ReasoningRun:
    """A run of an answer's reasoning: a model that thinks between its calls writes several."""

    text: str


# An answer's blocks in the order the model wrote them, as a stream's events open and close them.
AnswerBlock = Union[ReasoningRun, TextRun, ToolCall]


@dataclass(frozen=True)
class FinalResult:
    """A whole response, folded from a stream of events."""

    request: ChatRequest
    text: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_text: str = ""
    # The other choices (``n`` > 1), in order from choice 1; this result is choice 0 and its usage the total.
    others: tuple[FinalResult, ...] = ()
    # ``text``, ``reasoning`` and ``tool_calls`` in their order, for protocols that carry each block apart
    # (Anthropic's content blocks, the Responses output items); ``text`` and ``reasoning`` are these joined.
    blocks: tuple[AnswerBlock, ...] = ()


@dataclass(frozen=True)
class EmbeddingRequest:
    """A protocol-neutral embeddings request: texts or token-id lists, in order."""

    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    request_id: str = ""


@dataclass(frozen=True)
class Embeddings:
    """An embeddings request's answer: one float32 little-endian vector per input, in input order."""

    request: EmbeddingRequest
    model: str  # the served model's canonical id
    vectors: tuple[bytes, ...]
    dims: int
    prompt_tokens: int

    def float_vectors(self) -> list[np.ndarray]:
        """The vectors as float32 arrays (views of the bytes, no copy): :func:`protocols.sse.dumps` writes
        them as JSON numbers, each the shortest decimal that reads back as the same float32."""
        return [np.frombuffer(v, dtype="<f4") for v in self.vectors]


@dataclass(frozen=True)
class RerankRequest:
    """A query and the documents to order by relevance to it."""

    model: str
    query: str
    documents: tuple[str, ...]
    top_n: int | None = None
    return_documents: bool = True
    request_id: str = ""


@dataclass(frozen=True)
class Ranking:
    """A rerank request's answer: one relevance score per document (input order), and how they were scored."""

    request: RerankRequest
    model: str
    scores: tuple[float, ...]
    scoring: str
    prompt_tokens: int


TranscriptFormat = Literal["json", "text", "srt", "vtt", "verbose_json"]


@dataclass(frozen=True)
class TranscriptionRequest:
    """Speech to text (``task = "transcribe"``) or to English text (``"translate"``): the uploaded file's bytes
    and the options, as the protocol's decode read them."""

    model: str
    audio: bytes
    filename: str = ""
    task: Literal["transcribe", "translate"] = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None  # None: the model's own fallback schedule
    response_format: TranscriptFormat = "json"
    word_timestamps: bool = False
    segment_timestamps: bool = False
    stream: bool = False
    request_id: str = ""


@dataclass(frozen=True)
class TranscriptWord:
    word: str
    start: float
    end: float


@dataclass(frozen=True)
class TranscriptSegment:
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[TranscriptWord, ...] = ()


@dataclass(frozen=True)
class TranscriptDelta:
    """Text transcribed so far, streamed before the whole transcript is known."""

    text: str


@dataclass(frozen=True)
class Transcript:
    """A transcription's answer: the last item of its stream (deltas come before it)."""

    request: TranscriptionRequest
    model: str
    text: str
    language: str
    duration: float  # seconds of audio
    segments: tuple[TranscriptSegment, ...]


TranscriptEvent = Union[TranscriptDelta, Transcript]


SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]


@dataclass(frozen=True)
class SpeechRequest:
    """Text to speech: the text, the voice and how the audio should come back."""

    model: str
    input: str
    voice: str
    instructions: str | None = None
    speed: float = 1.0
    response_format: SpeechFormat = "mp3"
    stream_format: Literal["audio", "sse"] = "audio"
    request_id: str = ""


@dataclass(frozen=True)
class SpeechChunk:
    """Speech for one piece of the input (a sentence, as soon as it is synthesized): mono float32
    little-endian samples at ``sample_rate``."""

    request: SpeechRequest
    model: str
    sample_rate: int
    samples: bytes


@dataclass(frozen=True)
class SpeechDone:
    """The end of a speech stream."""

    request: SpeechRequest
    model: str
    sample_rate: int
    samples: int  # in all chunks
    input_characters: int


SpeechEvent = Union[SpeechChunk, SpeechDone]


@made_per_token
@dataclass(frozen=True)
class WireFrame:
    """Bytes for the client. The first frame of a response carries its head; a stream's first frame also
    says how the stream is kept open while it is quiet (a long prefill): ``keepalive`` (bytes clients ignore)
    after every ``keepalive_seconds`` without a frame (none: no keepalive)."""

    data: bytes
    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    streaming: bool = False
    keepalive: bytes = b""
    keepalive_seconds: float = 0.0


@dataclass
class _ChoiceBuilder:
    """One choice's events folded."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: dict[int, list[str]] = field(default_factory=dict)
    call_heads: dict[int, tuple[str, str]] = field(default_factory=dict)
    # The answer's blocks in order: (kind, the pieces of a text or reasoning run | a call's index).
    order: list[tuple[type[TextRun] | type[ReasoningRun], list[str]] | int] = field(default_factory=list)
    finished: ResponseFinished | None = None

    def _run(self, kind: type[TextRun] | type[ReasoningRun], text: str) -> None:
        """Text and reasoning continue the open run of their kind; an empty piece opens none (as when streamed)."""
        if not text:
            return
        last = self.order[-1] if self.order else None
        if isinstance(last, tuple) and last[0] is kind:
            last[1].append(text)
        else:
            self.order.append((kind, [text]))

    def add(self, event: StreamEvent) -> None:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            if event.logprobs:
                self.logprobs.extend(event.logprobs)
            self._run(TextRun, event.text)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
            self._run(ReasoningRun, event.text)
        elif isinstance(event, ToolCallDelta):
            if event.id is not None and event.name is not None:
                self.call_heads[event.index] = (event.id, event.name)
                self.order.append(event.index)
            self.calls.setdefault(event.index, []).append(event.arguments)
        elif isinstance(event, ResponseFinished):
            self.finished = event

    def result(self, started: ResponseStarted, usage: Usage, others: tuple[FinalResult, ...] = ()) -> FinalResult:
        assert self.finished is not None
        by_index = {i: ToolCall(id=self.call_heads[i][0], name=self.call_heads[i][1], arguments="".join(parts))
                    for i, parts in self.calls.items() if i in self.call_heads}
        calls = tuple(by_index[i] for i in sorted(by_index))
        blocks = tuple(by_index[entry] if isinstance(entry, int) else entry[0]("".join(entry[1]))
                       for entry in self.order)
        return FinalResult(
            request=started.request,
            text="".join(self.text),
            reasoning="".join(self.reasoning),
            tool_calls=calls,
            finish_reason=self.finished.finish_reason,
            usage=usage,
            stop_sequence=self.finished.stop_sequence,
            logprobs=tuple(self.logprobs),
            prompt_text=started.prompt_text,
            others=others,
            blocks=blocks,
        )


@dataclass
class ResultBuilder:
    """Folds a stream of events into a :class:`FinalResult` (non-streaming responses), choice by choice."""

    started: ResponseStarted | None = None
    choices: dict[int, _ChoiceBuilder] = field(default_factory=dict)

    def add(self, event: StreamEvent) -> None:
        if isinstance(event, ResponseStarted):
            self.started = event
        else:
            choice = self.choices.get(event.choice)
            if choice is None:  # (not setdefault: that would build a builder per event)
                choice = self.choices[event.choice] = _ChoiceBuilder()
            choice.add(event)

    @property
    def finished(self) -> ResponseFinished | None:
        """The last finish event, once every choice has finished (None before)."""
        n = self.started.request.n if self.started is not None else 1
        done = [c.finished for c in self.choices.values() if c.finished is not None]
        return done[-1] if len(done) >= n else None

    def result(self) -> FinalResult:
        if self.started is None or self.finished is None:
            raise ValueError("event stream ended without its header or its finish event")
        started = self.started
        ordered = [self.choices[i] for i in sorted(self.choices)]
        finishes = [c.finished for c in ordered if c.finished is not None]
        first = finishes[0].usage
        usage = Usage(first.prompt_tokens, sum(f.usage.completion_tokens for f in finishes), first.cached_tokens,
                      first.cache_write_tokens)
        others = tuple(c.result(started, f.usage) for c, f in zip(ordered[1:], finishes[1:]))
        return ordered[0].result(started, usage, others)
