"""The console's routes over HTTP (the page in a real browser: test_console_browser.py), its figures in
``/stats``, and ``flow viz --format svg|html``."""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from flow.builtins import compile_file, compile_tables
from flow.cli import main as cli
from flow.serve.stats_feed import MAX_FEEDS
from tests.harness import (
    GRAPHS,
    RunningServer,
    feed_events,
    graph_with_key,
    graph_with_model,
    merged,
    openai_error,
    running_server,
    tables_with_model,
)
from viz.svg import render_svg


@pytest.fixture(scope="module")
def keyed(tiny_qwen3: Path) -> Iterator[RunningServer]:
    with running_server(graph_with_key(tiny_qwen3, "s3cret", "console-keyed")) as running:
        yield running


def test_the_page_is_one_self_contained_document(qwen3_server: RunningServer) -> None:
    page = httpx.get(qwen3_server.base_url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp and "frame-ancestors 'none'" in csp
    # Nothing is loaded from elsewhere: no external script, style sheet, image or font.
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)
    assert "/*CONSOLE_JS*/" not in page.text and "function openFeed()" in page.text and ".flow-graph" in page.text
    assert httpx.head(qwen3_server.base_url + "/", timeout=10).status_code == 200  # connectivity checks


def test_the_drawing_has_every_stage_and_edge_of_the_live_graph(qwen3_server: RunningServer) -> None:
    svg = httpx.get(qwen3_server.base_url + "/console/graph.svg", timeout=10)
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    graph = qwen3_server.server.live.gen.graph
    stages = set(re.findall(r'data-stage="([^"]+)"', svg.text))
    assert stages == set(graph.stages)
    edges = {e.replace("&gt;", ">") for e in re.findall(r'data-edge="([^"]+)"', svg.text)}
    assert edges == {f"{src} -> {dst}" for src, dst in graph.graph.edges}
    assert set(re.findall(r'data-resource="([^"]+)"', svg.text)) == set(graph.resources)
    assert "PreparedPrompt" in svg.text and "StreamEvent" in svg.text  # edges say what they carry


def test_stats_carry_what_the_page_draws(qwen3_server: RunningServer) -> None:
    r = httpx.post(qwen3_server.url + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 0})  # greedy: sampling may draw EOS first on the random-weight model
    assert r.status_code == 200
    httpx.post(qwen3_server.url + "/chat/completions", json={"model": "tiny", "messages": "not a list"})
    stats = httpx.get(qwen3_server.base_url + "/stats").json()
    prepare = stats["stages"]["prepare"]
    assert prepare["runs"] >= 1 and prepare["active"] == 0 and prepare["queued"] == 0
    assert stats["stages"]["openai_chat"]["errors"] >= 1  # the malformed body failed in the decode stage
    assert stats["edges"]["generate -> process"]["queued"] == 0
    model = stats["models"]["tiny"]
    assert model["resource"] == "model" and model["pinned"] is False and model["idle_seconds"] >= 0
    assert "loading_seconds" not in model  # only while a load is under way
    recent = stats["recent_requests"]
    chats = [r for r in recent if r["route"] == "POST /v1/chat/completions"]
    assert {200, 400} <= {r["status"] for r in chats}
    done = next(r for r in chats if r["status"] == 200)
    assert not done["running"] and done["duration_ms"] >= done["ttfb_ms"] > 0
    assert done["model"] == "tiny" and done["prompt_tokens"] > 0 and 1 <= done["completion_tokens"] <= 3


def test_the_stats_feed_is_a_reading_then_what_changed(qwen3_server: RunningServer) -> None:
    base = qwen3_server.base_url
    with httpx.stream("GET", base + "/stats/events?interval=0.2", timeout=60) as feed:
        assert feed.status_code == 200 and feed.headers["content-type"].startswith("text/event-stream")
        assert feed.headers["cache-control"] == "no-store"
        events = feed_events(feed)
        name, reading = next(events)
        assert name == "stats" and set(reading) == set(httpx.get(base + "/stats", timeout=60).json())
        runs = reading["stages"]["prepare"]["runs"]
        chat = httpx.post(qwen3_server.url + "/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0})  # greedy: sampling may draw EOS first on the random-weight model
        assert chat.status_code == 200
        after = httpx.get(base + "/stats", timeout=60).json()  # nothing else runs now: the feed must come to this
        kinds = set()
        for name, data in events:
            kinds.add(name)
            reading = data if name == "stats" else merged(reading, data)
            if reading["stages"] == after["stages"] and reading["edges"] == after["edges"]:
                break
        assert kinds == {"change"} and reading["stages"]["prepare"]["runs"] == runs + 1
        assert reading["requests"] == after["requests"] and reading["models"]["tiny"]["state"] == "ready"
        assert reading["recent_requests"][0]["route"] == "POST /v1/chat/completions"


def test_a_bad_feed_interval_is_a_400_naming_the_range(qwen3_server: RunningServer) -> None:
    for interval in ("0", "fast", "100"):
        error = openai_error(httpx.get(qwen3_server.base_url + f"/stats/events?interval={interval}", timeout=10))
        assert error["param"] == "interval" and "from 0.2 to 60" in error["message"]


def test_feeds_past_the_limit_are_refused_until_one_closes(qwen3_server: RunningServer) -> None:
    url = qwen3_server.base_url + "/stats/events?interval=60"
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=30, limits=httpx.Limits(max_connections=MAX_FEEDS + 2)))
        feeds = [stack.enter_context(client.stream("GET", url)) for _ in range(MAX_FEEDS)]
        assert all(f.status_code == 200 for f in feeds)
        reading = [feed.iter_raw() for feed in feeds]  # kept: a dropped iterator closes its response
        for chunks in reading:
            next(chunks)  # each feed has begun: it counts
        refused = client.get(url)
        error = openai_error(refused, 429)
        assert refused.headers["retry-after"] == "2" and "close one, or read GET /stats" in error["message"]
        feeds[0].close()
        deadline = time.monotonic() + 60
        while True:  # the server notices the closed connection at the feed's next write or wake-up
            with client.stream("GET", url) as again:
                if again.status_code == 200:
                    break
            assert again.status_code == 429 and time.monotonic() < deadline, "a closed feed still counted"
            time.sleep(0.1)


def test_the_feed_ends_when_the_server_stops(tiny_qwen3: Path) -> None:
    ended: list[str] = []

    def follow(base: str, first: threading.Event) -> None:
        with httpx.stream("GET", base + "/stats/events?interval=0.5", timeout=120) as feed:
            for name, _ in feed_events(feed):  # until the server ends the body
                ended.append(name)
                first.set()
        ended.append("end")

    first = threading.Event()
    with running_server(graph_with_model(tiny_qwen3, name="feed")) as running:
        reader = threading.Thread(target=follow, args=(running.base_url, first), daemon=True)
        reader.start()
        # The first reading, not just the response's head: on a loaded machine the stop below could otherwise
        # come before the feed's first event is written, and the feed would (rightly) end with none.
        assert first.wait(60)
    reader.join(60)  # the server's stop (above) waits for its connections: a feed left open would hold it
    assert not reader.is_alive() and ended[0] == "stats" and ended[-1] == "end"


def test_the_consoles_own_reads_stay_out_of_the_recent_requests(qwen3_server: RunningServer) -> None:
    base = qwen3_server.base_url
    for path in ("/", "/console/graph.svg", "/library", "/downloads", "/fit?model=tiny"):
        assert httpx.get(base + path, timeout=60).status_code == 200, path
    assert httpx.post(qwen3_server.url + "/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code == 200
    stats = httpx.get(base + "/stats", timeout=60).json()
    routes = [r["route"] for r in stats["recent_requests"]]
    assert routes[0] == "POST /v1/chat/completions"
    assert not {"GET /", "GET /console/graph.svg", "GET /library", "GET /downloads", "GET /fit"} & set(routes)
    assert stats["requests"]["total"] >= 6  # counted all the same


def test_with_a_key_the_page_opens_and_everything_it_reads_needs_the_key(keyed: RunningServer) -> None:
    page = httpx.get(keyed.base_url + "/", timeout=10)
    assert page.status_code == 200 and "key-dialog" in page.text
    assert "s3cret" not in page.text and "tiny" not in page.text  # the page holds no server data
    for path in ("/console/graph.svg", "/stats", "/stats/events?interval=60"):
        refused = httpx.get(keyed.base_url + path, timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        with httpx.stream("GET", keyed.base_url + path, headers={"authorization": "Bearer s3cret"}) as allowed:
            assert allowed.status_code == 200
    # Public is the page's route only, with its method: nothing else on it, no other path under it.
    assert httpx.post(keyed.base_url + "/", json={}).status_code == 401
    assert httpx.get(keyed.base_url + "/v1/nope").status_code == 401
    # Public still checks host and origin.
    rebinding = httpx.get(keyed.base_url + "/", headers={"host": "attacker.example"})
    assert rebinding.status_code == 403


def test_a_graph_without_the_console_still_answers_root(tiny_qwen3: Path) -> None:
    tables = tables_with_model(tiny_qwen3)
    del tables["stages"]["console"], tables["stages"]["console_graph"]
    with running_server(compile_tables(tables, "no-console")) as running:
        root = httpx.get(running.base_url + "/", timeout=10)
        assert root.status_code == 200 and root.json()["status"] == "ok"
        assert httpx.head(running.base_url + "/", timeout=10).status_code == 200
        missing = httpx.get(running.base_url + "/console/graph.svg", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_flow_viz_writes_the_same_drawing_as_svg_and_html(tmp_path: Path) -> None:
    expected = render_svg(compile_file(GRAPHS / "default.toml"))
    stages = sorted(set(re.findall(r'data-stage="([^"]+)"', expected)))
    for fmt in ("svg", "html"):
        out = tmp_path / f"graph.{fmt}"
        assert cli.main(["viz", "default", "--format", fmt, "-o", str(out)]) == 0
        text = out.read_text()
        assert sorted(set(re.findall(r'data-stage="([^"]+)"', text))) == stages
        assert ".flow-graph" in text and "<script" not in text and "http://www.w3.org/2000/svg" in text
    assert (tmp_path / "graph.html").read_text().startswith("<!doctype html>")
    svg = (tmp_path / "graph.svg").read_text()
    assert svg.startswith("<svg") and "<style>" in svg


def test_after_a_reload_the_drawing_is_the_new_graph(tiny_qwen3: Path) -> None:
    tables = tables_with_model(tiny_qwen3)
    edited = tables_with_model(tiny_qwen3)
    del edited["stages"]["rerank_in"], edited["stages"]["rerank"], edited["stages"]["rerank_out"]
    with running_server(compile_tables(tables, "v1"), loader=lambda: compile_tables(edited, "v2")) as running:
        before = httpx.get(running.base_url + "/console/graph.svg", timeout=10).text
        assert 'data-stage="rerank"' in before
        assert httpx.post(running.base_url + "/admin/reload", timeout=120).status_code == 200
        after = httpx.get(running.base_url + "/console/graph.svg", timeout=10).text
        assert 'data-stage="rerank"' not in after and 'data-stage="prepare"' in after
        assert httpx.get(running.base_url + "/stats", timeout=10).json()["graph"]["version"] == 2
