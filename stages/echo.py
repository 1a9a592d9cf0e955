"""``generate.echo``: a stand-in for ``generate`` that replies with the last user message.

It exists for tests and demos of everything after the model: swap it for
``generate`` in a graph (one line) and a client's own text comes back through
the real tokenizer, detokenizer, stop matcher, family parsers and protocol
formatters, a few tokens per step, as a model would produce it. That makes
tool-call and reasoning output reproducible on random-weight test models.
"""

from __future__ import annotations

from typing import ClassVar

import trio
from pydantic import Field

from flow.graph.stage import Outbox
from protocols.ir import FinishReason, Generation, GenerationStarted, PreparedPrompt, TokenChunk
from stages.chat import ModelStageConfig
from stages.model_stage import ModelStage


class EchoConfig(ModelStageConfig):
    tokens_per_chunk: int = Field(default=3, ge=1, description="tokens per chunk, like one engine step's worth")


class EchoGenerate(ModelStage[PreparedPrompt, Generation]):
    type_name: ClassVar[str] = "generate.echo"
    Config = EchoConfig
    description = "test stand-in for generate: streams the last user message's tokens as the model's output"

    async def run(self, inbox: trio.MemoryReceiveChannel[PreparedPrompt], outbox: Outbox[Generation]) -> None:
        step: int = self.config.tokens_per_chunk  # type: ignore[attr-defined]
        async for prompt in inbox:
            tokenizer = self.models.lookup(prompt.model).require().tokenizer
            users = [m.content for m in prompt.request.messages if m.role == "user"]
            script = users[-1] if users else (prompt.request.prompt if isinstance(prompt.request.prompt, str) else "")
            ids = list(tokenizer.encode(script, add_special_tokens=False))[: prompt.max_tokens]
            await outbox.send(GenerationStarted(prompt, prompt_tokens=len(prompt.token_ids)))
            for start in range(0, len(ids), step):
                await outbox.send(TokenChunk(tuple(ids[start : start + step])))
                await trio.sleep(0)
            finish: FinishReason = "length" if len(ids) >= prompt.max_tokens else "stop"
            await outbox.send(TokenChunk((), finish))
