"""``generate.echo``: a stand-in for ``generate`` that replies with the last user message.

It exists for tests, demos and benchmarks of everything after the model: swap it for ``generate`` in a graph
(one line) and a client's own text comes back through the real tokenizer, detokenizer, stop matcher, family
parsers and protocol formatters, as a model would produce it. That makes tool-call and reasoning output
reproducible on random-weight test models, and measures what flow's own Python costs per token.

"As a model would" is kept to the letter, since the benchmarks read the per-token cost off it:

- an :class:`EchoDevice` steps all its rows together, one token per row per step, and hands each step's
  chunks over with :func:`runtime.handle.hand_over`, as the engine's one crossing per step does;
- a row ends as a sequence does: its last token carries ``length`` at ``max_tokens``; a script that runs out
  before gets an empty ``stop`` chunk one step later (the step that sampled the end-of-sequence token), and a
  stop token in the script stops it the same way;
- its rows go downstream through :func:`stages.rows.forward_rows`, the same code ``generate`` uses (chunks
  already waiting are merged, the rows are cancelled when the request ends).

The device is as fast as the stages after it and never faster: the next step starts once every task the
last one woke is waiting again (the event loop is idle), so no chunk waits for the one before it and each
item downstream carries one token, the worst case for per-token cost. ``step_seconds`` makes each step take
at least that long, a device of a given speed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import ClassVar

import trio
from pydantic import Field

from flow.graph.stage import Outbox, Step
from protocols.ir import Generation, GenerationStarted, PreparedPrompt, TokenChunk
from runtime.handle import SequenceHandle, hand_over
from stages.chat import ModelStageConfig
from stages.model_stage import ModelStage
from stages.rows import EachPrompt, forward_rows

SCRIPTS_KEPT = 256


class EchoRow(SequenceHandle):
    """One echoed sequence: its script, and the engine's handle for its chunks (the same hand-over)."""

    def __init__(self, script: Sequence[int], max_tokens: int, stop_ids: frozenset[int]) -> None:
        send, chunks = trio.open_memory_channel[TokenChunk](math.inf)
        super().__init__(0, send, chunks, on_cancel=lambda _id: None)
        self.script = script
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.generated = 0

    def next_chunk(self) -> TokenChunk:
        """This step's chunk; the last one carries its finish reason."""
        token = self.script[self.generated] if self.generated < len(self.script) else None
        if token is None or token in self.stop_ids:
            return TokenChunk((), "stop")
        self.generated += 1
        return TokenChunk((token,), "length" if self.generated >= self.max_tokens else None)


class EchoDevice:
    """Steps every submitted row together; its stepping task runs while it has rows."""

    def __init__(self, step_seconds: float = 0.0) -> None:
        self.step_seconds = step_seconds
        self.rows: list[EchoRow] = []
        self.steps = 0
        self._stepping = False

    def submit(self, script: Sequence[int], max_tokens: int, stop_ids: frozenset[int]) -> EchoRow:
        row = EchoRow(script, max_tokens, stop_ids)
        self.rows.append(row)
        if not self._stepping:
            self._stepping = True
            # A system task, as the device thread is outside every request: a request that ends (or is
            # cancelled) only takes its own row out.
            trio.lowlevel.spawn_system_task(self._run, name="generate.echo device")
        return row

    def step(self) -> None:
        """One step: a chunk for every live row, handed over as the engine hands over a step's chunks."""
        self.steps += 1
        alive: list[EchoRow] = []
        handed: list[tuple[SequenceHandle, TokenChunk | None]] = []
        for row in self.rows:
            if row.finished:  # cancelled
                row.end()
                continue
            chunk = row.next_chunk()
            handed.append((row, chunk))  # a finish closes its channel; a reader gone cancels it
            if chunk.finish_reason is None:
                alive.append(row)
        self.rows = alive
        hand_over(handed)

    async def _run(self) -> None:
        # Imported here, not with the module: trio.testing brings pytest (and rich, pygments) when it is installed,
        # ~50 ms of every server's start and its memory, for a stage only the benchmarks and tests run.
        from trio.testing import wait_all_tasks_blocked

        try:
            while self.rows:
                started = trio.current_time()
                self.step()
                await wait_all_tasks_blocked()
                if self.step_seconds:
                    await trio.sleep_until(started + self.step_seconds)
        finally:
            self._stepping = False


class EchoConfig(ModelStageConfig):
    step_seconds: float = Field(default=0.0, ge=0, description="the least time one device step takes (0: as fast "
                                                               "as the stages after it take the tokens)")


class EchoGenerate(ModelStage[PreparedPrompt, Generation]):
    type_name: ClassVar[str] = "generate.echo"
    Config = EchoConfig
    description = "test stand-in for generate: streams the last user message's tokens as the model's output"
    config: EchoConfig

    def setup(self) -> None:
        super().setup()
        self.device = EchoDevice(self.config.step_seconds)
        # Recent scripts, tokenized: a model does not tokenize its output, so neither should the stand-in for
        # each request (benchmarks send the same text again and again).
        self._scripts: OrderedDict[tuple[str, str], tuple[int, ...]] = OrderedDict()

    def _script(self, model: str, text: str) -> tuple[int, ...]:
        key = (model, text)
        script = self._scripts.get(key)
        if script is None:
            tokenizer = self.models.lookup(model).require().tokenizer
            script = self._scripts[key] = tuple(tokenizer.encode(text, add_special_tokens=False))
            if len(self._scripts) > SCRIPTS_KEPT:
                self._scripts.popitem(last=False)
        else:
            self._scripts.move_to_end(key)
        return script

    def open_step(self) -> Step[PreparedPrompt, Generation]:
        return EachPrompt(self.generate)

    async def generate(self, prompt: PreparedPrompt, outbox: Outbox[Generation]) -> bool:
        if prompt.request.load_only:  # as generate answers it: empty and finished
            await outbox.send(GenerationStarted(prompt, 0))
            await outbox.send(TokenChunk((), "stop"))
            return True
        users = [m.content for m in prompt.request.messages if m.role == "user"]
        text = users[-1] if users else (prompt.request.prompt if isinstance(prompt.request.prompt, str) else "")
        script = self._script(prompt.model, text)
        rows = [self.device.submit(script, prompt.max_tokens, prompt.stop_token_ids) for _ in range(prompt.request.n)]
        return await forward_rows(GenerationStarted(prompt, len(prompt.token_ids)), rows, outbox)
