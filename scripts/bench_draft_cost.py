"""What counting the drafter's own cost in the verify decision does, side by side in one run (engine level, CPU).

    eval "$(.venv/bin/python -m flow.cli.blas)"
    .venv/bin/python scripts/bench_draft_cost.py

For each drafter, the same greedy request (a repeating prompt, 1 stream) decodes with speculation off, with the
drafter and the decision weighing the drafter's measured cost (``worth_verifying(..., draft_cost)``), and with the
same drafter while the decision ignores it (as before), each engine in turn, ``--rounds`` times. Drafters, on a
tiny random-weight target (so acceptance is what random weights give):

* ``itself``: the target as its own draft model: every draft accepted, each draft token a full target pass;
* ``small``: a much smaller random model of the same tokenizer: cheap, rarely right;
* ``mtp``: tiny-qwen3.5-mtp's own MTP layer (kind ``mtp``).

Figures: decode tok/s (median over rounds), the median of each round's ratio to the off run beside it, drafted
and accepted tokens (all rounds), whether the output is the off run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

import runtime.speculative_step  # noqa: E402
from protocols.ir import SamplingParams  # noqa: E402
from runtime.device import DeviceThread  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.engine_config import EngineConfig, SpeculativeConfig  # noqa: E402
from runtime.models import LoadedModel, load_model  # noqa: E402
from runtime.speculative import worth_verifying  # noqa: E402
from runtime.tiny import PRESETS, TinySpec, ensure_tiny_model  # noqa: E402

PROMPT = list(range(5, 45)) * 3
TARGET = dataclasses.replace(PRESETS["tiny-qwen3"], hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                             intermediate_size=768)
SMALL = dataclasses.replace(PRESETS["tiny-qwen3"], hidden_size=32, num_heads=2, num_kv_heads=1, num_layers=1,
                            intermediate_size=64, seed=7)
MTP_TARGET = dataclasses.replace(PRESETS["tiny-qwen3.5-mtp"], hidden_size=256, num_layers=6, num_heads=8,
                                 num_kv_heads=4, intermediate_size=768)


class Decision:
    """The engine's verify decision, with the drafter's cost weighed or ignored (switched between runs)."""

    weigh = True

    @classmethod
    def __call__(cls, lengths: list[int], states: list[Any], cost: Any, draft_cost: Any = None) -> int:
        return worth_verifying(lengths, states, cost, draft_cost if cls.weigh else None)


async def decode(engine: Engine, max_tokens: int) -> tuple[list[int], float]:
    handle = engine.submit(PROMPT, max_tokens=max_tokens, stop_ids=frozenset(), sampling=SamplingParams())
    out: list[int] = []
    first = end = 0.0
    async with handle:
        async for chunk in handle.chunks:
            if not out and chunk.token_ids:
                first = time.perf_counter()
            out.extend(chunk.token_ids)
            end = time.perf_counter()
    return out, (len(out) - 1) / (end - first)


def compare(device: DeviceThread, name: str, target: TinySpec, kind: str, draft: TinySpec | None,
            args: argparse.Namespace) -> None:
    path = ensure_tiny_model(target)
    drafter: LoadedModel | None = None
    if draft is not None:
        drafter = load_model("draft", ensure_tiny_model(draft), device, EngineConfig())
    spec = SpeculativeConfig(kind=kind, max_draft=4)  # type: ignore[arg-type]
    engines = {"off": load_model("off", path, device, EngineConfig()),
               "weighed": load_model("weighed", path, device, EngineConfig(speculative=spec),
                                     draft_model=drafter.model if drafter else None),
               "ignored": load_model("ignored", path, device, EngineConfig(speculative=spec),
                                     draft_model=drafter.model if drafter else None)}
    rates: dict[str, list[float]] = {k: [] for k in engines}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for key, loaded in engines.items():
            Decision.weigh = key != "ignored"
            outputs[key], rate = trio.run(decode, loaded.engine, args.tokens)
            rates[key].append(rate)
    for key in ("off", "weighed", "ignored"):
        stats = engines[key].engine.stats
        # Each round's ratio to the off run beside it: a shared machine's load drifts between rounds.
        ratio = statistics.median(r / o for r, o in zip(rates[key], rates["off"]))
        print(f"| {name} | {key} | {statistics.median(rates[key]):.1f} | {ratio:.2f} | {stats.draft_tokens} | "
              f"{stats.accepted_tokens} | {outputs[key] == outputs['off']} |", flush=True)
    for loaded in [*engines.values(), *([drafter] if drafter else [])]:
        loaded.engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    setattr(runtime.speculative_step, "worth_verifying", Decision())  # the engine calls it by this name
    device = DeviceThread("bench-draft-cost")
    device.start()
    try:
        print(f"greedy, 1 stream, {args.tokens} tokens, median of {args.rounds} rounds; target: "
              f"{TARGET.num_layers} layers of {TARGET.hidden_size}\n")
        print("| drafter | decision | tok/s | / off | drafted | accepted | output identical |")
        print("|---|---|---|---|---|---|---|")
        compare(device, "itself (draft model)", TARGET, "draft", TARGET, args)
        compare(device, "small (draft model)", TARGET, "draft", SMALL, args)
        compare(device, "MTP layer", MTP_TARGET, "mtp", None, args)
    finally:
        device.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
