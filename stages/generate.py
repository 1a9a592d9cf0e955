"""``generate``: hands a prepared prompt to the model's engine and streams its token chunks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import trio

from flow.resources import MODEL_REFERENCES, ModelResource, ModelSet
from flow.stage import Outbox, Stage
from protocols.errors import ApiError
from protocols.ir import ChatRequest, Generation, GenerationStarted, PreparedPrompt, TokenChunk
from protocols.parsers import TOOL_PARSERS
from protocols.parsers.base import tool_schemas
from runtime.constrained import ANY_JSON_OBJECT, Grammar, GrammarError, Reasoning
from runtime.engine_config import EngineOverloaded
from stages.chat import ModelStageConfig

if TYPE_CHECKING:
    from flow.families import Family
    from runtime.constrained import Constraint
    from runtime.models import LoadedModel

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the think_tag reasoning parser's markers


def merge_pending(chunk: TokenChunk, chunks: trio.MemoryReceiveChannel[TokenChunk]) -> TokenChunk:
    """Fold chunks that are already waiting into one item.

    When the stages downstream fall behind the engine (many streams, a slow
    client), tokens pile up here; passing them on as one item keeps the
    per-item work (detokenizing, encoding, writing) per step, not per token.
    """
    if chunk.finish_reason is not None:
        return chunk
    tokens = list(chunk.token_ids)
    logprobs = list(chunk.logprobs)
    finish = None
    merged = False
    while finish is None:
        try:
            more = chunks.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            break
        merged = True
        tokens.extend(more.token_ids)
        logprobs.extend(more.logprobs)
        finish = more.finish_reason
    return TokenChunk(tuple(tokens), finish, tuple(logprobs)) if merged else chunk


async def output_constraint(prompt: PreparedPrompt, loaded: LoadedModel, family: Family) -> Constraint | None:
    """The grammar a request asks for — a forced tool call in the family's call format (``tool_choice`` naming
    a tool, or ``required``), else its ``response_format`` — compiled for the model on a worker thread (the
    model's vocabulary data is built at its first constrained request); a 400 naming what cannot be compiled.
    A reasoning model may think first: the grammar starts after its thinking block."""
    request = prompt.request
    grammars = forced_call_grammars(request, family)
    if not grammars and request.response_format is not None:
        fmt = request.response_format
        grammars = (Grammar.json_schema(fmt.schema if fmt.schema is not None else ANY_JSON_OBJECT, fmt.strict),)
    if not grammars:
        return None
    reasoning = None
    if family.reasoning.parser == "think_tag" and request.thinking is not False:
        encode = loaded.tokenizer.encode
        reasoning = Reasoning(tuple(encode(THINK_OPEN, add_special_tokens=False)),
                              tuple(encode(THINK_CLOSE, add_special_tokens=False)),
                              inside=prompt.text.rstrip().endswith(family.reasoning.open_tag))
    for i, grammar in enumerate(grammars):
        try:
            return await trio.to_thread.run_sync(loaded.grammars.constraint, grammar, reasoning)
        except GrammarError as exc:
            if i + 1 < len(grammars):
                continue  # the next way of writing the same format
            param = "tool_choice" if grammar.kind == "lark" else "response_format"
            raise ApiError("invalid_request", f"The {param} cannot be enforced: {exc}.", param=param) from None
    return None


def forced_call_grammars(request: ChatRequest, family: Family) -> tuple[Grammar, ...]:
    """Grammars for the one tool call a request forces, in the family's call format (none when the request
    forces no call, or the format has no grammar: then the choice is only asked for in the prompt)."""
    choice = request.tool_choice
    if not request.tools or choice in (None, "auto", "none"):
        return ()
    schemas = tool_schemas(request.tools)
    if isinstance(choice, dict):
        name = choice.get("name")
        schemas = {name: schemas[name]} if isinstance(name, str) and name in schemas else {}
    if not schemas:
        return ()
    parser = TOOL_PARSERS.get(family.tools.parser)
    if parser is None:
        return ()
    return tuple(Grammar.lark(text) for text in parser.forced_call_grammars(schemas, **family.tools.options))


class Generate(Stage[PreparedPrompt, Generation]):
    type_name: ClassVar[str] = "generate"
    input_type: ClassVar[Any] = PreparedPrompt
    output_type: ClassVar[Any] = Generation
    Config = ModelStageConfig
    references = MODEL_REFERENCES
    description = "runs the prompt on the device thread's engine; one chunk per engine step"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = ModelSet(self.links.many("models", ModelResource))

    async def run(self, inbox: trio.MemoryReceiveChannel[PreparedPrompt], outbox: Outbox[Generation]) -> None:
        async for prompt in inbox:
            resource = self.models.lookup(prompt.model)
            loaded = resource.require()
            engine = loaded.engine
            constraint = await output_constraint(prompt, loaded, resource.family)
            tokens = list(prompt.token_ids)
            policy = prompt.request.cache
            hit = await engine.match_prefix(tokens, policy)
            try:
                handle = engine.submit(tokens, max_tokens=prompt.max_tokens, stop_ids=prompt.stop_token_ids,
                                       sampling=prompt.request.sampling, prefix=hit, policy=policy,
                                       constraint=constraint)
            except EngineOverloaded as exc:
                raise ApiError("overloaded", f"The model {prompt.model!r} is busy: {exc}. Retry after "
                               f"{exc.retry_after:g} s.", retry_after=exc.retry_after) from None
            # Leaving this block for any reason (done, downstream finished early,
            # client gone) cancels the sequence; the engine drops it next step.
            async with handle:
                try:
                    await outbox.send(GenerationStarted(prompt, len(tokens), handle.cached_tokens,
                                                        handle.cache_write_tokens))
                    async for chunk in handle.chunks:
                        await outbox.send(merge_pending(chunk, handle.chunks))
                except trio.BrokenResourceError:
                    return  # downstream has all it wants (e.g. a stop string matched)
            if handle.error is not None:
                raise ApiError("internal", f"generation failed: {handle.error}") from handle.error
