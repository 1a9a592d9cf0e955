"""A large JSON answer is written a piece at a time, the event loop given back between pieces, to the same
bytes as one ``dumps`` call."""

from __future__ import annotations

import json

import numpy as np
import trio

from protocols.sse import dumps
from stages.protocol import PIECE_ITEMS, dumps_in_pieces


async def test_the_bytes_are_those_of_one_dumps_call() -> None:
    vectors = np.random.default_rng(0).standard_normal((300, 16)).astype(np.float32)
    answers = [
        {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
         "model": "m", "usage": {"prompt_tokens": 3, "total_tokens": 3}},
        {"items": list(range(PIECE_ITEMS * 3 + 1)), "nested": {"deeper": ["é", "∑", None, True] * 50}},
        list(range(PIECE_ITEMS + 1)),
        {1: "a non-string key: written whole"},
        {"short": [1, 2, 3], "empty": [], "text": "bad \ud800 input"},
        [],
        "plain",
    ]
    for answer in answers:
        assert await dumps_in_pieces(answer) == dumps(answer)
    body = json.loads(await dumps_in_pieces(answers[0]))
    assert np.array_equal(np.array([d["embedding"] for d in body["data"]], dtype=np.float32), vectors)


async def test_other_tasks_run_between_the_pieces() -> None:
    """Each piece ends with a checkpoint: a task beside the encoder moves while a long list is written."""
    ticks: list[int] = []
    done = trio.Event()

    async def beside() -> None:
        while not done.is_set():
            ticks.append(1)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(beside)
        await trio.lowlevel.checkpoint()  # let it start
        before = len(ticks)
        await dumps_in_pieces({"data": list(range(PIECE_ITEMS * 10))})
        during = len(ticks) - before
        done.set()
    assert during >= 9
