"""``generate``: hands a prepared prompt to the model's engine and streams its token chunks."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, ClassVar

import trio
from pydantic import Field

from flow.graph.stage import Outbox, Step, note_request
from flow.resources.model import ModelResource
from protocols.errors import ApiError
from protocols.ir import (
    ChatRequest,
    Generation,
    GenerationStarted,
    PreparedPrompt,
    TokenChunk,
)
from protocols.parsers import TOOL_PARSERS
from protocols.parsers.base import tool_schemas
from runtime.constrained import ANY_JSON_OBJECT, Grammar, GrammarError, Reasoning
from runtime.engine_config import EngineOverloaded
from runtime.image_spans import key_tokens
from stages.chat import ModelStageConfig
from stages.model_stage import ModelStage
from stages.rows import EachPrompt, forward_rows

if TYPE_CHECKING:
    from flow.catalog.families import Family
    from runtime.constrained import Constraint
    from runtime.models import LoadedModel

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the think_tag reasoning parser's markers


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
            if grammar.kind == "lark":  # flow writes the call grammar: what fails in it is a tool's schema
                raise ApiError("invalid_request", f"The tool_choice cannot be enforced: the forced tool's "
                               f"'parameters' is not a JSON Schema that can be compiled ({exc}).",
                               param="tool_choice") from None
            raise ApiError("invalid_request", f"The response_format cannot be enforced: {exc}.",
                           param="response_format") from None
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


class GenerateConfig(ModelStageConfig):
    max_choices: int = Field(default=8, ge=1, description="the most choices (OpenAI's n) one request may ask for; "
                                                          "they decode as rows of the batch")


class Generate(ModelStage[PreparedPrompt, Generation]):
    type_name: ClassVar[str] = "generate"
    Config = GenerateConfig
    description = "runs the prompt on the device thread's engine; one chunk per engine step (per choice)"
    config: GenerateConfig

    def open_step(self) -> Step[PreparedPrompt, Generation]:
        return EachPrompt(self.generate)

    async def generate(self, prompt: PreparedPrompt, outbox: Outbox[Generation]) -> bool:
        """Run one prompt on the engine, its chunks sent on as they come; ``False`` when downstream stopped
        reading first."""
        request = prompt.request
        if request.n > self.config.max_choices:
            raise ApiError("invalid_request", f"'n' is {request.n}; this server gives at most "
                           f"{self.config.max_choices} choices per request.", param="n")
        if request.load_only:  # the model is loaded (chat.prepare saw to it): an empty, finished answer
            await outbox.send(GenerationStarted(prompt, 0))
            await outbox.send(TokenChunk((), "stop"))
            return True
        resource = self.models.lookup(prompt.model)
        loaded = resource.require()
        engine = loaded.engine
        if engine.distributed:
            refuse_distributed(request, resource)
        # Each choice has its own grammar state (compiled once, cached) and its own seed stream.
        constraints = [await output_constraint(prompt, loaded, resource.family) for _ in range(request.n)]
        sampling = request.sampling
        choices = [(sampling if sampling.seed is None or i == 0 else replace(sampling, seed=sampling.seed + i),
                    constraint) for i, constraint in enumerate(constraints)]
        adapters = resource.adapters.select(request.model, request.adapter)
        tokens = list(prompt.token_ids)
        note_request(model=resource.name, prompt_tokens=len(tokens))
        policy = request.cache
        # Image positions are keyed by their pixels' digests: the same screenshot next turn is a hit.
        keyed = tokens if prompt.images is None else key_tokens(tokens, prompt.images.spans)
        hit = await engine.match_prefix(keyed, policy, adapters, prompt.images)
        try:
            handles = engine.submit_choices(tokens, choices, max_tokens=prompt.max_tokens,
                                            stop_ids=prompt.stop_token_ids, prefix=hit, policy=policy,
                                            adapters=adapters, images=prompt.images, label=request.request_id,
                                            message_ends=prompt.message_ends)
        except EngineOverloaded as exc:
            raise ApiError("overloaded", f"The model {prompt.model!r} is busy: {exc}. Retry after "
                           f"{exc.retry_after:g} s.", retry_after=exc.retry_after) from None
        # However forwarding ends (done, downstream finished early, client gone) the sequences are
        # cancelled; the engine drops them next step.
        started = GenerationStarted(prompt, len(tokens), handles[0].cached_tokens, handles[0].cache_write_tokens)
        return await forward_rows(started, handles, outbox)


def refuse_distributed(request: ChatRequest, resource: ModelResource) -> None:
    """A 400 for what a model served across ranks cannot do yet: every rank must compute the same, and these
    features keep per-rank state rank 0 does not send (grammar matchers, adapter weights, bias tables)."""
    what = ("structured output (response_format)" if request.response_format is not None else
            "a forced tool call (tool_choice)" if forced_call_grammars(request, resource.family) else
            "LoRA adapters" if request.adapter or request.model in resource.config.adapter_aliases else
            "logit_bias" if request.sampling.logit_bias else None)
    if what is not None:
        param = {"LoRA adapters": "adapter", "logit_bias": "logit_bias"}.get(
            what, "response_format" if request.response_format is not None else "tool_choice")
        raise ApiError("invalid_request", f"The model {resource.name!r} is served across processes "
                       f"(distributed); {what} is not supported there yet.", param=param)
