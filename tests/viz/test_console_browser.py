"""The console in a real browser: headless Chromium (the system's, Debian package ``chromium``) driven by
Playwright. One browser for the module; each test gets its own page. Screenshots go to the module's tmp
directory (their paths are printed; look at them when the page changes).

Skipped, saying why, where Playwright or Chromium is missing (``.ci/run`` installs Chromium with apt-get).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import chromium_path, headless_chromium
from tests.fake_hub import hub_switched_on
from tests.harness import RunningServer, graph_with_key, running_server

pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed")
CHROMIUM = chromium_path()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no system Chromium (apt-get install chromium)")

WAIT_MS = 30_000
# wait_for_function's predicates are functions, not expressions: the page's CSP forbids eval, and Playwright
# evaluates an expression predicate with it.
LIVE = "() => document.getElementById('conn').textContent === 'live'"
RUNS = "(stage) => Number((document.querySelector(`g[data-stage=\"${stage}\"] text.live`).textContent" \
       ".match(/runs (\\d+)/) || [0, 0])[1])"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    assert CHROMIUM is not None
    with headless_chromium(CHROMIUM) as chromium:
        yield chromium


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


@pytest.fixture(scope="module")
def keyed(tiny_qwen3: Path) -> Iterator[RunningServer]:
    with running_server(graph_with_key(tiny_qwen3, "s3cret", "console-browser-keyed")) as running:
        yield running


class Page:
    """A browser page on the console, collecting what the browser complains about."""

    def __init__(self, browser: Any, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1500, "height": 1000})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)

    def shot(self, path: Path) -> None:
        self.page.screenshot(path=str(path), full_page=True)
        print(f"screenshot: {path}")

    def text(self, selector: str) -> str:
        return str(self.page.locator(selector).first.text_content() or "")


@pytest.fixture
def console(browser: Any, qwen3_server: RunningServer) -> Iterator[Page]:
    page = Page(browser, qwen3_server.base_url + "/")
    page.page.wait_for_selector("#graph svg g[data-stage]", timeout=WAIT_MS)
    page.page.wait_for_function(LIVE, timeout=WAIT_MS)
    yield page
    page.page.close()


def test_the_page_draws_every_stage_of_the_graph_without_errors(console: Page, qwen3_server: RunningServer,
                                                                shots: Path) -> None:
    drawn = console.page.eval_on_selector_all("#graph svg g[data-stage]", "els => els.map(e => e.dataset.stage)")
    assert sorted(drawn) == sorted(qwen3_server.server.live.gen.graph.stages)
    for sid in ("openai_chat", "prepare", "generate", "process", "openai_chat_out", "console"):
        assert console.page.locator(f'#graph g[data-stage="{sid}"]').is_visible()
    # The live figures are painted: every stage that has run shows its counters, the model its batch.
    console.page.wait_for_function(
        "() => document.querySelector('g[data-resource=\"model\"] text.live').textContent.startsWith('batch')",
        timeout=WAIT_MS)
    assert console.text("#models tbody td") == "tiny"
    assert console.errors == []
    console.shot(shots / "console.png")


def test_live_counters_change_while_requests_run(console: Page, qwen3_server: RunningServer, shots: Path) -> None:
    def runs(stage: str) -> int:
        return int(console.page.evaluate(RUNS, stage))

    before_total = int(console.text("#requests-total"))
    before_runs = runs("generate")
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(base_url=qwen3_server.url, timeout=120) as client:
            while not stop.is_set():
                with client.stream("POST", "/chat/completions", json={
                        "model": "tiny", "stream": True, "max_tokens": 48,
                        "messages": [{"role": "user", "content": "count"}]}) as r:
                    for _ in r.iter_bytes():
                        pass

    workers = [threading.Thread(target=traffic) for _ in range(3)]
    for worker in workers:
        worker.start()
    try:
        console.page.wait_for_function(
            "(n) => Number(document.getElementById('requests-total').textContent) > n", arg=before_total,
            timeout=WAIT_MS)
        # An edge on the inference path shows items flowing, and the recent list has chat requests.
        console.page.wait_for_selector('g.edge.flowing[data-edge="generate -> process"]', timeout=WAIT_MS)
        console.page.wait_for_selector("#recent tbody tr", timeout=WAIT_MS)
        console.shot(shots / "console-busy.png")
    finally:
        stop.set()
        for worker in workers:
            worker.join(120)
    console.page.wait_for_function(f"(n) => ({RUNS})('generate') > n", arg=before_runs, timeout=WAIT_MS)
    assert runs("generate") > before_runs
    assert "POST /v1/chat/completions" in console.text("#recent tbody")
    assert console.errors == []


def test_a_hidden_tab_reads_nothing_until_it_is_shown_again(console: Page) -> None:
    """Nobody looks at a hidden tab: it closes its feed of the figures (no cost to the server or the machine),
    and opens it again as soon as it is shown."""
    feeds: list[str] = []  # the feed's requests, as they begin and end

    def feed(kind: str) -> Any:
        return lambda r: feeds.append(kind) if "/stats/events" in r.url else None

    console.page.on("request", feed("open"))
    console.page.on("requestfailed", feed("closed"))
    console.page.on("requestfinished", feed("closed"))
    visibility = """(hidden) => {
        Object.defineProperty(document, "hidden", {configurable: true, get: () => hidden});
        document.dispatchEvent(new Event("visibilitychange"));
    }"""
    uptime = "() => document.getElementById('graph-name').textContent"
    console.page.evaluate(visibility, True)
    console.page.wait_for_timeout(500)
    assert feeds == ["closed"]  # the one open feed, closed at once
    painted = console.page.evaluate(uptime)
    console.page.wait_for_timeout(4500)  # two readings' time and more
    assert feeds == ["closed"] and console.page.evaluate(uptime) == painted  # nothing read, nothing painted
    console.page.evaluate(visibility, False)
    console.page.wait_for_function("(before) => document.getElementById('graph-name').textContent !== before",
                                   arg=painted, timeout=WAIT_MS)
    assert feeds == ["closed", "open"]  # followed again, on one request
    assert console.text("#conn") == "live" and console.errors == []


def test_the_playground_streams_a_chat(console: Page, shots: Path) -> None:
    console.page.wait_for_selector("#chat-model option", state="attached", timeout=WAIT_MS)
    console.page.fill("#chat-input", "Tell me a story")
    console.page.fill("#chat-max", "24")
    console.page.click("#chat-send")
    console.page.wait_for_function("() => document.getElementById('chat-info').textContent.includes('chunks')",
                                   timeout=WAIT_MS)
    output = console.text("#chat-output")
    assert output and not output.startswith("Error")
    assert int(console.text("#chat-info").split(" ", 1)[0]) >= 1
    assert console.errors == []
    console.shot(shots / "console-playground.png")


def test_with_a_key_the_page_asks_for_it_and_keeps_it_for_the_session(browser: Any, keyed: RunningServer,
                                                                      shots: Path) -> None:
    page = Page(browser, keyed.base_url + "/")
    try:
        page.page.wait_for_selector("#key-dialog[open]", timeout=WAIT_MS)
        assert page.page.locator("#key-error").is_hidden()
        page.shot(shots / "console-key.png")
        page.page.fill("#api-key", "wrong")
        page.page.click("#key-submit")
        page.page.wait_for_selector("#key-dialog[open] #key-error:not([hidden])", timeout=WAIT_MS)
        page.page.fill("#api-key", "s3cret")
        page.page.click("#key-submit")
        page.page.wait_for_selector("#graph svg g[data-stage]", timeout=WAIT_MS)
        page.page.wait_for_function(LIVE, timeout=WAIT_MS)
        assert page.page.evaluate("sessionStorage.getItem('flow.apiKey')") == "s3cret"
        assert page.page.evaluate("localStorage.length") == 0
        # A reload in the same tab finds the key: no prompt.
        page.page.reload()
        page.page.wait_for_function(LIVE, timeout=WAIT_MS)
        assert not page.page.locator("#key-dialog").is_visible()
        # Only the expected refusals (the two 401s before the right key) were logged.
        assert all("401" in error for error in page.errors), page.errors
    finally:
        page.page.close()


def test_the_library_pulls_a_model_with_live_progress(console: Page, tiny_qwen3: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, shots: Path) -> None:
    repo = "acme/console-pull"
    console.page.wait_for_selector("#library tbody tr", timeout=WAIT_MS)
    assert "hub offline" in console.text("#library-note") and console.page.locator("#pull-button").is_disabled()
    with hub_switched_on(monkeypatch, repo, tiny_qwen3, tmp_path / "hub-cache"):
        console.page.reload()
        console.page.wait_for_function("() => !document.getElementById('pull-button').disabled", timeout=WAIT_MS)
        console.page.fill("#pull-repo", repo)
        console.page.click("#pull-button")
        console.page.wait_for_selector(f"#downloads tr:has-text('{repo}'):has-text('done')", timeout=WAIT_MS)
        console.page.wait_for_selector(f"#library tr:has-text('{repo}') .badge.ok", timeout=WAIT_MS)
        row = console.text(f"#library tr:has-text('{repo}')")
        assert "text" in row and "qwen3" in row and "fits" in row
        assert console.page.locator("#library .badge.serving").count() >= 1  # the model this server runs
        console.page.fill("#pull-repo", "not a repo")
        console.page.click("#pull-button")
        console.page.wait_for_function("() => document.getElementById('pull-error').textContent.includes('owner/name')",
                                       timeout=WAIT_MS)
        console.shot(shots / "console-library.png")
    # The refused pull logged its 400; nothing else went wrong.
    assert all("400" in error for error in console.errors), console.errors
