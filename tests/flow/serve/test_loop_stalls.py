"""No request holds the event loop, through the real server: a PDF whose 100 pages share one content stream of
16,000 operators (16 KB; over half a minute of CPU to read in full on a fast machine, minutes on a slow one: well
past its budget anywhere), a form of 350,000 empty fields, and a 2,048-input embeddings request are each answered
while ``/health``, asked every 25 ms beside them, answers in under 100 ms; the PDF is stopped at its CPU budget
with a 413 naming it; the loop's lag is on ``/metrics`` and ``/stats``, and a stall is logged with the stage and
route that held it."""

from __future__ import annotations

import base64
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from protocols.documents import PDF_CPU_SECONDS
from runtime.tiny import ensure_tiny_model
from tests.harness import RunningServer, running_server, tables_with_model
from tests.hostile import empty_fields_form, shared_stream_pdf

HEALTH_BOUND = 0.1
PDF_B64 = base64.b64encode(shared_stream_pdf(pages=100, operators=16000)).decode()


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[RunningServer]:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["bert"] = {"type": "model", "path": str(ensure_tiny_model("tiny-bert")), "name": "bert"}
    tables["server"] = {"max_body_bytes": 32 << 20}  # as with a speech-to-text model: uploads up to 25 MB
    with running_server(compile_tables(tables, "loop stalls")) as running:
        yield running


def health_beside(server: RunningServer, work: Callable[[], httpx.Response]) -> tuple[httpx.Response, list[float]]:
    """``work()``'s answer, and the times ``/health`` took, asked every 25 ms while it ran."""
    times: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            client.get("/health")  # the connection is open before timing starts
            while not done.is_set():
                started = time.perf_counter()
                assert client.get("/health").status_code == 200
                times.append(time.perf_counter() - started)
                done.wait(0.025)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        time.sleep(0.1)
        answer = work()
    finally:
        done.set()
        prober.join()
    return answer, times


def loop_stats(server: RunningServer) -> dict[str, Any]:
    return httpx.get(server.base_url + "/stats", timeout=30).json()["event_loop"]  # type: ignore[no-any-return]


def held_by_work(server: RunningServer) -> int:
    """Stalls during which the loop was running code (flow's or a library's), not waiting for a core."""
    held = loop_stats(server)["stalls_held_by"]
    return int(held["flow"] + held["library"])


def assert_loop_free(server: RunningServer, times: list[float], held_before: int) -> None:
    assert len(times) >= 5, times
    # The server's own watch: no timer late by over 100 ms because the loop was busy with work. (A loaded
    # machine may still give the process no core for that long: the watch tells those apart by the stack.)
    assert held_by_work(server) == held_before, loop_stats(server)
    # What a client sees, typically: /health answered at once.
    assert statistics.median(times) < HEALTH_BOUND, (statistics.median(times), max(times))


def test_a_pdf_that_costs_a_minute_is_stopped_at_its_budget_beside_a_free_loop(server: RunningServer) -> None:
    held = held_by_work(server)
    for path, body in [
        ("/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "file", "file": {"filename": "a.pdf", "file_data": f"data:application/pdf;base64,{PDF_B64}"}},
            {"type": "text", "text": "Summarize."}]}]}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": PDF_B64}}]}]}),
    ]:
        started = time.monotonic()
        answer, times = health_beside(server, lambda: httpx.post(server.base_url + path, json=body, timeout=120))
        assert answer.status_code == 413, answer.text
        message = answer.json()["error"]["message"]
        assert f"at most {PDF_CPU_SECONDS:g} s of CPU" in message, message
        # Stopped at its budget (CPU seconds; the wall clock may be longer on a loaded machine), not a minute.
        assert time.monotonic() - started < 4 * PDF_CPU_SECONDS + 10
        assert_loop_free(server, times, held)


def test_a_form_of_350_000_empty_fields_is_refused_beside_a_free_loop(server: RunningServer) -> None:
    held = held_by_work(server)
    body, content_type = empty_fields_form(350_000)
    answer, times = health_beside(server, lambda: httpx.post(
        server.base_url + "/v1/audio/transcriptions", content=body, headers={"content-type": content_type},
        timeout=120))
    assert answer.status_code == 413, answer.text
    assert "more than 256 parts" in answer.json()["error"]["message"]
    assert_loop_free(server, times, held)


def test_a_2048_input_embeddings_request_beside_a_free_loop(server: RunningServer) -> None:
    held = held_by_work(server)
    texts = [f"sentence number {i} about the river and the sea" for i in range(2048)]
    answer, times = health_beside(server, lambda: httpx.post(
        server.base_url + "/v1/embeddings", json={"model": "bert", "input": texts}, timeout=300))
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"]) == 2048
    assert_loop_free(server, times, held)


def test_the_lag_is_measured_and_exported(server: RunningServer) -> None:
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    for name in ("flow_event_loop_lag_seconds_count", "flow_event_loop_lag_max_seconds",
                 "flow_event_loop_stalls_total"):
        assert name in metrics
    count = next(float(line.split()[-1]) for line in metrics.splitlines()
                 if line.startswith("flow_event_loop_lag_seconds_count"))
    assert count > 10  # a timer every 20 ms since the server started
    stats = loop_stats(server)
    assert {"lag_ms", "max_lag_ms", "stalls", "stalls_held_by", "last_stall"} <= set(stats)


def test_a_body_of_more_objects_than_any_request_needs_is_refused_beside_a_free_loop(server: RunningServer) -> None:
    held = held_by_work(server)
    messages = [{"role": "user", "content": "a"}] * 60_000  # 2.2 MB; parsing and validating it held the loop 3 s
    answer, times = health_beside(server, lambda: httpx.post(
        server.base_url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "messages": messages},
        timeout=120))
    assert answer.status_code == 413, answer.text
    assert "more than 25,000 JSON objects and arrays" in answer.json()["error"]["message"]
    assert_loop_free(server, times, held)
    # Brackets inside strings are text, not structure: a body of code is not refused for them.
    code = "function f(a) { return [a, {b: [1, 2]}]; }\n" * 20_000
    answer = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": code[:200_000]}] * 4})
    assert answer.status_code in (200, 400), answer.text
    assert "JSON objects and arrays" not in answer.text


def test_reading_the_loops_stack_runs_no_collection_inside_the_thread_list_lock() -> None:
    """``sys._current_frames()`` holds CPython's thread-list lock while it builds its dict; a collection started
    there runs Python code that may hand the GIL away with the lock held, which froze the whole process. The
    watcher reads the stacks with the collector held off: a GC hook never runs inside."""
    import gc
    import sys
    import threading

    from flow.serve.loop_watch import _thread_frames

    inside: list[str] = []

    def hook(phase: str, info: dict[str, int]) -> None:
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "_thread_frames":
                inside.append(frame.f_code.co_name)
                return
            frame = frame.f_back

    hold = threading.Event()
    threads = [threading.Thread(target=hold.wait, daemon=True) for _ in range(20)]
    for thread in threads:
        thread.start()
    threshold = gc.get_threshold()
    gc.callbacks.append(hook)
    gc.set_threshold(1, 1, 1)  # a collection at every allocation (unguarded, ~1 call in 10 collects inside)
    try:
        for _ in range(200):
            assert threading.get_ident() in _thread_frames()
    finally:
        gc.callbacks.remove(hook)
        gc.set_threshold(*threshold)
        hold.set()
    assert inside == [] and gc.isenabled()
