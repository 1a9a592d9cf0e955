"""The short fixed-seed fuzz run (CI): every protocol's requests, valid and mutated, through a real server.

Each endpoint runs its fixed cases (``strategies.regressions``: the Hardening issue's list) and then
draws cases from ``strategies.cases`` with a fixed seed (``derandomize``), sends
them to one ``flow serve`` child process and judges each answer (``tests.fuzz.run_case``): no 5xx,
4xx in the route's error shape, 200 streams that end properly, the same server process alive and
serving afterwards. Failures are collected rather than raised, so that one run lists every distinct
failure of an endpoint (grouped by signature), each with the smallest case that hit it made smaller
still (``Collector.minimize``: Hypothesis' own shrinking would restart the server for every step of a
crash) and the curl lines that reproduce it.

The long run is ``scripts/fuzz.py --minutes N``.
"""

from __future__ import annotations

import time

import httpx
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings

from tests.fuzz import Collector, FlowProcess, run_case
from tests.fuzz.strategies import NAMES, Case, cases, regressions

# Drawn cases per endpoint (after its fixed ones, strategies.regressions): with a server that passes, the
# file runs in about three minutes on two cores. A valid transcription decodes a random Whisper to its length
# limit (about 2 s each here), so that endpoint draws fewer; scripts/fuzz.py --minutes N draws without a bound.
EXAMPLES = {"chat": 90, "completions": 60, "responses": 60, "messages": 80, "count_tokens": 40, "agent_create": 40,
            "agent_patch": 30, "agent_generate": 50, "embeddings": 40, "rerank": 30, "speech": 25, "lookup": 30,
            "transcriptions": 8}
MINIMIZE_SECONDS = 30.0  # per endpoint, for making failing cases smaller
# No case may hold the server's event loop longer than this (its own watch: /stats event_loop). Stalls its
# stack shows as waiting — the loaded machine gave the process no core — are the machine's, not a case's.
STALL_BOUND_MS = 250.0


def loop_stalls(server: FlowProcess, client: httpx.Client, since: float) -> list[dict[str, object]]:
    """The stalls over STALL_BOUND_MS, held by work, that began after ``since`` (a time.time())."""
    stats = client.get(server.url + "/stats", timeout=30).json()["event_loop"]
    return [stall for stall in stats["recent_stalls"]
            if stall["at"] >= since and stall["held_by"] != "waiting" and stall["ms"] > STALL_BOUND_MS]


@pytest.mark.parametrize("name", NAMES)
def test_fuzz(name: str, fuzz_server: FlowProcess, fuzz_client: httpx.Client) -> None:
    found = Collector()
    started = time.time()

    def fuzz(case: Case) -> None:
        found.add(run_case(fuzz_server, case, client=fuzz_client))

    test = given(case=cases(name))(fuzz)
    for case in reversed(regressions(name)):
        test = example(case=case)(test)
    settings(max_examples=EXAMPLES[name], deadline=None, database=None, derandomize=True, print_blob=False,
             phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))(test)()
    stalls = loop_stalls(fuzz_server, fuzz_client, started)
    assert not stalls, f"cases of {name} held the event loop over {STALL_BOUND_MS:g} ms: {stalls}"
    if found.hits:
        found.minimize(fuzz_server, client=fuzz_client, seconds=MINIMIZE_SECONDS, crash_budget=3)
        pytest.fail(found.report(fuzz_server.url), pytrace=False)
