"""Data safety: damaged files never stop the server, user data is never harmed, stored data persists.

Caches are disposable (a damaged KV index is set aside and the tier starts cold); stores are not (a
damaged agent or response store is left byte for byte as it was and only its routes answer 503);
data files are private (0600, their directory 0700); what a client was told is stored survives a
restart and a ``kill -9`` (the last test runs a real ``flow serve`` process and kills it mid-traffic).

Servers here use the default graph's own file locations inside ``FLOW_DATA_DIR`` (a temporary
directory per test), so the defaults themselves are what is tested.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio
import trio.testing

from flow.builtins import compile_tables
from flow.graph.resource import Links
from flow.resources.response_store import ResponseStore, ResponseStoreConfig
from protocols.ir import Message
from runtime.kv_disk import DiskTier, HostBlock
from runtime.private_files import is_private, private_db, private_dir, private_file
from tests.harness import GRAPHS, RunningServer, running_server, serve_process, tables_with_model

GARBAGE = b"this is not an SQLite database, whatever its name says\n" * 40
SYSTEM = "You are the keeper's assistant at the old lighthouse. Answer briefly, mention the lamp. " * 2
LONG = ("The keeper climbed the spiral stairs at dusk, trimmed the wick, polished the great lens and "
        "watched the ships pass the reef while the wind rose over the grey water. ")


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh FLOW_DATA_DIR (not created yet: flow creates it)."""
    directory = tmp_path / "data"
    monkeypatch.setenv("FLOW_DATA_DIR", str(directory))
    return directory


@contextmanager
def default_server(model: Path) -> Iterator[RunningServer]:
    """The default graph on the test model, every file in its default place in FLOW_DATA_DIR."""
    with running_server(compile_tables(tables_with_model(model), "default.toml (data safety)")) as server:
        yield server


def post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def stats(base_url: str) -> dict[str, Any]:
    return httpx.get(base_url + "/stats", timeout=30).json()["resources"]  # type: ignore[no-any-return]


def chat(server: RunningServer, text: str) -> httpx.Response:
    return post(server, "/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                              "max_tokens": 4, "temperature": 0})


def output_text(body: dict[str, Any]) -> str:
    """A Responses object's text (its message items' output_text parts)."""
    return "".join(part["text"] for item in body["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


def assert_unavailable(response: httpx.Response, path: Path) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "store_unavailable"
    assert str(path) in error["message"] and "untouched" in error["message"], error["message"]
    assert ".recover" in error["message"]


def malformed_db(path: Path) -> None:
    """A real SQLite file (valid header, agents table) with a page overwritten: 'malformed', not 'not a db'."""
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE agents (id TEXT PRIMARY KEY, model TEXT)")
    db.executemany("INSERT INTO agents VALUES (?, ?)", [(f"a{i}", "x" * 50) for i in range(2000)])
    db.commit()
    db.close()
    with path.open("r+b") as f:
        f.seek(4096 * 3)
        f.write(b"\xff" * 200)


# --------------------------------------------------------------------------- private files


def test_private_dirs_and_files(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        nested = private_dir(tmp_path / "a" / "b")
        assert mode(tmp_path / "a") == mode(nested) == 0o700
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o755)
        private_dir(theirs)
        assert mode(theirs) == 0o755  # the user's directory keeps its mode...
        private_dir(theirs, ours=True)
        assert mode(theirs) == 0o700  # ...flow's own is tightened
        made = private_file(nested / "new.sqlite")
        assert made.read_bytes() == b"" and mode(made) == 0o600
        old_file = nested / "old.sqlite"
        old_file.write_bytes(b"keep")
        old_file.chmod(0o644)
        (nested / "old.sqlite-wal").write_bytes(b"")
        (nested / "old.sqlite-wal").chmod(0o644)
        private_db(old_file)
        assert old_file.read_bytes() == b"keep" and mode(old_file) == mode(nested / "old.sqlite-wal") == 0o600
    finally:
        os.umask(old)


# --------------------------------------------------------------------------- the KV disk tier


def _block(value: float) -> HostBlock:
    return HostBlock((np.full((1, 2, 16, 4), value, np.float16),) * 2, "float16")


def test_disk_tier_sets_a_damaged_index_aside_and_starts_cold(tmp_path: Path) -> None:
    directory = tmp_path / "kv"
    (directory / "blocks" / "ab").mkdir(parents=True)
    (directory / "index.sqlite").write_bytes(GARBAGE)
    (directory / "index.sqlite-wal").write_bytes(b"stale wal")
    orphan = directory / "blocks" / "ab" / ("ab" * 32 + ".safetensors")
    orphan.write_bytes(b"a block the damaged index described")
    directory.chmod(0o755)

    disk = DiskTier(directory, 1 << 30, own_directory=True)
    try:
        s = disk.stats()
        assert s["damaged_index_set_aside"] == 1 and s["blocks"] == 0
        aside = Path(s["damaged_index"])
        assert aside.parent == directory and aside.name.startswith("index.sqlite.damaged-")
        assert aside.read_bytes() == GARBAGE
        wal = directory / "index.sqlite-wal"
        assert not wal.exists() or wal.read_bytes() != b"stale wal"  # moved with it, or dropped by SQLite
        assert not orphan.exists() and s["orphans_removed"] == 1  # cache: gone with the index
        assert mode(directory) == mode(directory / "blocks") == 0o700
        assert mode(directory / "index.sqlite") == 0o600

        key = bytes(range(32))
        disk.write(key, None, b"ns", _block(1.5), time.time() + 600)
        disk.flush()
        assert mode(disk.path(key)) == 0o600 and mode(disk.path(key).parent) == 0o700
        assert mode(directory / "index.sqlite-wal") == 0o600  # SQLite copied the index's mode
        read = disk.read(key)
        assert read is not None and float(read.arrays[0][0, 0, 0, 0]) == 1.5
    finally:
        disk.close()

    again = DiskTier(directory, 1 << 30)  # a sound index is kept
    try:
        assert again.stats()["damaged_index_set_aside"] == 0 and again.has(key)
        path = again.path(key)
        path.write_bytes(path.read_bytes()[:-8] + b"garbage!")  # a damaged block: detected, never served
        assert again.read(key) is None and again.stats()["corrupt"] == 1
        again.flush()
        assert not path.exists()
    finally:
        again.close()


def test_disk_tier_sets_aside_an_index_with_rows_it_did_not_write(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20).close()
    db = sqlite3.connect(tmp_path / "index.sqlite")
    db.execute("INSERT INTO blocks VALUES ('not hex', NULL, 'ns', 1, 'x', 'float16', 1e12, 0)")
    db.commit()
    db.close()
    disk = DiskTier(tmp_path, 1 << 20)
    try:
        assert disk.stats()["damaged_index_set_aside"] == 1 and disk.stats()["blocks"] == 0
    finally:
        disk.close()


# --------------------------------------------------------------------------- the response store


def open_responses(path: Path, **config: Any) -> ResponseStore:
    store = ResponseStore("responses", ResponseStoreConfig(path=str(path), **config), Links())
    trio.run(store.start, None)
    return store


def test_response_store_bounds_age_and_size_by_last_use_and_persists(tmp_path: Path) -> None:
    path = tmp_path / "responses.sqlite"
    conversation = (Message("user", "Where is the lamp?"),
                    Message("assistant", "Up top.", extra=(("reasoning_content", "It is a lighthouse."),)))
    store = open_responses(path, max_bytes=4096)
    for rid in ("a", "b", "c"):
        store.put(rid, {"id": rid, "pad": "x" * 1000}, conversation)
    found = store.get("a")  # now the most recently used
    assert found is not None and found.conversation == conversation and found.body["id"] == "a"
    store.put("d", {"id": "d", "pad": "x" * 1000}, conversation)  # over the cap: the least recently used goes
    assert store.get("b") is None and store.stats()["evicted"] == 1
    store.close()

    again = open_responses(path, max_bytes=4096)
    assert again.stats()["entries"] == 3
    again.put("e", {"id": "e", "pad": "x" * 1000}, conversation)
    assert [rid for rid in "acde" if again.get(rid) is not None] == ["a", "d", "e"]  # c: last used before a
    again.close()
    assert mode(path) == 0o600

    short = open_responses(tmp_path / "short.sqlite", ttl_seconds=0.05)
    short.put("old", {"id": "old"}, conversation)
    time.sleep(0.1)
    assert short.get("old") is None and short.stats()["expired"] == 1
    short.close()
    assert open_responses(tmp_path / "short.sqlite").stats()["entries"] == 0


def test_responses_that_finish_together_are_committed_together(tmp_path: Path) -> None:
    """keep() from many requests at once: a transaction (and a worker thread) per group, not per response; every
    response on disk when its keep() returns; those riding on a request cancelled meanwhile are stored too."""
    path = tmp_path / "responses.sqlite"
    store = open_responses(path)
    commits: list[frozenset[str]] = []
    put_many = store.put_many

    def counted(puts: list[Any]) -> None:
        time.sleep(0.02)  # a sync to disk that takes a while: the other requests gather meanwhile
        put_many(puts)
        commits.append(frozenset(rid for rid, *_ in puts))

    store.put_many = counted  # type: ignore[method-assign]
    conversation = (Message("user", "Where is the lamp?"), Message("assistant", "Up top."))
    kept: list[str] = []

    async def keep(rid: str) -> None:
        await store.keep(rid, {"id": rid, "text": rid * 10}, conversation)
        kept.append(rid)
        with sqlite3.connect(path) as other:  # on disk, for anyone, once keep() returns
            assert other.execute("SELECT COUNT(*) FROM responses WHERE id = ?", (rid,)).fetchone()[0] == 1

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            first = trio.CancelScope()

            async def cancelled_first() -> None:
                with first:
                    await store.keep("first", {"id": "first"}, conversation)

            nursery.start_soon(cancelled_first)
            await trio.sleep(0.005)  # "first" commits alone; its request is cancelled while it does
            for i in range(40):
                nursery.start_soon(keep, f"r{i}")
            await trio.sleep(0.001)
            first.cancel()

    trio.run(main)
    assert sorted(kept) == sorted(f"r{i}" for i in range(40))
    assert commits == [frozenset({"first"}), frozenset(f"r{i}" for i in range(40))]
    assert store.get("first") is not None and store.stats()["stored"] == 41
    store.close()
    assert open_responses(path).stats()["entries"] == 41


def test_a_request_waits_for_its_own_commit_only(tmp_path: Path) -> None:
    """Under a steady arrival of responses, each keep() returns once its own group is on disk, never held for the
    groups that gathered after it (the first one's request used to commit every later group)."""
    store = open_responses(tmp_path / "responses.sqlite")
    gates: list[threading.Event] = []  # one per commit: the test says when its sync to disk ends
    put_many = store.put_many

    def gated(puts: list[Any]) -> None:
        gate = threading.Event()
        gates.append(gate)
        gate.wait(30)
        put_many(puts)

    store.put_many = gated  # type: ignore[method-assign]
    conversation = (Message("user", "Where is the lamp?"),)
    returned: list[str] = []

    async def keep(rid: str) -> None:
        await store.keep(rid, {"id": rid}, conversation)
        returned.append(rid)

    async def commits_under_way(n: int) -> None:
        """Until the n-th commit's worker thread waits at its gate (threads start in their own time)."""
        while len(gates) < n:
            await trio.sleep(0.001)
        await trio.testing.wait_all_tasks_blocked()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep, "a")  # leads the first commit
            await commits_under_way(1)
            nursery.start_soon(keep, "b")  # leads the second, behind the first
            nursery.start_soon(keep, "c")  # joins the second
            await trio.testing.wait_all_tasks_blocked()
            assert len(gates) == 1 and returned == []
            gates[0].set()
            await commits_under_way(2)
            assert returned == ["a"]
            nursery.start_soon(keep, "d")  # leads the third, behind the second
            await trio.testing.wait_all_tasks_blocked()
            gates[1].set()
            await commits_under_way(3)
            assert sorted(returned) == ["a", "b", "c"]  # b led its commit, and is back while d's waits on disk
            gates[2].set()

    trio.run(main)
    assert sorted(returned) == ["a", "b", "c", "d"] and store.stats()["stored"] == 4
    store.close()


# --------------------------------------------------------------------------- damaged files, one server


def test_damaged_files_never_stop_the_server(tiny_qwen3: Path, data: Path) -> None:
    private_dir(data)
    (data / "kv-cache").mkdir()
    (data / "kv-cache" / "index.sqlite").write_bytes(GARBAGE)
    (data / "capabilities.sqlite").write_bytes(GARBAGE)
    (data / "responses.sqlite").write_bytes(GARBAGE)
    agents = data / "agents.sqlite"
    malformed_db(agents)
    agents.chmod(0o644)
    stores = (agents, data / "responses.sqlite")
    before = {p.name: (p.read_bytes(), mode(p)) for p in stores}

    with default_server(tiny_qwen3) as server:
        # Everything that does not need a damaged store serves as usual; the cache starts cold.
        text = chat(server, "Is the lamp lit? " + LONG)
        assert text.status_code == 200, text.text
        again = chat(server, "Is the lamp lit? " + LONG)
        assert again.json()["choices"][0]["message"] == text.json()["choices"][0]["message"]
        unstored = post(server, "/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 3,
                                               "store": False})
        assert unstored.status_code == 200, unstored.text

        # The agents API: every route a 503 naming the file.
        assert_unavailable(httpx.get(server.url + "/agents", timeout=30), agents)
        assert_unavailable(post(server, "/agents", {"model": "tiny"}), agents)
        assert_unavailable(httpx.get(server.url + "/agents/a1", timeout=30), agents)
        assert_unavailable(httpx.delete(server.url + "/agents/a1", timeout=30), agents)
        assert_unavailable(post(server, "/agents/a1/generate", {"messages": [{"role": "user", "content": "hi"}]}),
                           agents)

        # Stored Responses: what needs the store is a 503, before any generation.
        responses = data / "responses.sqlite"
        assert_unavailable(post(server, "/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 3}),
                           responses)
        assert_unavailable(post(server, "/responses", {"model": "tiny", "input": "Hi", "store": False,
                                                       "previous_response_id": "resp_x"}), responses)
        assert_unavailable(httpx.get(server.url + "/responses/resp_x", timeout=30), responses)
        assert_unavailable(httpx.delete(server.url + "/responses/resp_x", timeout=30), responses)

        resources = stats(server.base_url)
        assert resources["agent_store"]["state"] == "damaged" and "malformed" in resources["agent_store"]["reason"]
        assert resources["response_store"]["state"] == "damaged"
        disk = resources["prefix_cache"]["disk"]
        assert disk["damaged_index_set_aside"] == 1 and Path(disk["damaged_index"]).read_bytes() == GARBAGE
        assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 200

    # The stores: not a byte, not a mode changed; no journal left beside them. The capability store (what
    # `flow probe` found) keeps its bytes too.
    assert {p.name: (p.read_bytes(), mode(p)) for p in stores} == before
    assert (data / "capabilities.sqlite").read_bytes() == GARBAGE
    assert not [p.name for p in data.iterdir() if p.name.endswith(("-wal", "-shm", "-journal"))]


# --------------------------------------------------------------------------- persistence and modes


def test_stored_responses_survive_a_restart_and_files_are_private(tiny_qwen3: Path, data: Path) -> None:
    with default_server(tiny_qwen3) as server:
        first = post(server, "/responses", {"model": "tiny", "input": "Name a ship.", "max_output_tokens": 4,
                                            "temperature": 0})
        assert first.status_code == 200, first.text
        gone = post(server, "/responses", {"model": "tiny", "input": "Forget me.", "max_output_tokens": 2})
        assert httpx.delete(f"{server.url}/responses/{gone.json()['id']}", timeout=30).status_code == 200
        agent = post(server, "/agents", {"id": "keeper", "model": "tiny", "max_context": 2**63})
        assert agent.status_code == 400 and agent.json()["error"]["param"] == "max_context"  # not a 500
        assert post(server, "/agents", {"id": "keeper", "model": "tiny", "max_context": 2**31 - 1}).status_code == 200
        patched = httpx.patch(server.url + "/agents/keeper", json={"max_context": 2**63}, timeout=30)
        assert patched.status_code == 400, patched.text
        assert stats(server.base_url)["response_store"]["entries"] == 1

    with default_server(tiny_qwen3) as server:
        rid = first.json()["id"]
        fetched = httpx.get(f"{server.url}/responses/{rid}", timeout=30)
        assert fetched.status_code == 200 and fetched.json() == first.json()
        assert httpx.get(f"{server.url}/responses/{gone.json()['id']}", timeout=30).status_code == 404
        follow = post(server, "/responses", {"model": "tiny", "input": "And another?", "max_output_tokens": 2,
                                             "previous_response_id": rid})
        assert follow.status_code == 200, follow.text
        assert follow.json()["previous_response_id"] == rid
        assert follow.json()["usage"]["input_tokens"] > first.json()["usage"]["input_tokens"]
        store = stats(server.base_url)["response_store"]
        assert store["state"] == "ok" and store["entries"] == 2 and store["hits"] >= 1

    assert mode(data) == 0o700 and mode(data / "kv-cache") == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"agents.sqlite", "responses.sqlite", "index.sqlite"}
    assert any(p.suffix == ".safetensors" for p in files)
    assert [p for p in files if not is_private(p)] == []
    assert [p for p in data.rglob("*") if p.is_dir() and not is_private(p)] == []


def test_the_data_directory_of_an_older_version_is_tightened(tiny_qwen3: Path, data: Path) -> None:
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "agents.sqlite").touch(mode=0o644)
    (data / "agents.sqlite").chmod(0o644)
    with default_server(tiny_qwen3):
        pass
    assert mode(data) == 0o700 and mode(data / "agents.sqlite") == 0o600


# --------------------------------------------------------------------------- kill -9


@contextmanager
def flow_serve(graph: Path, data: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real ``flow serve`` process on a free loopback port, FLOW_DATA_DIR=data; killed at the end."""
    with serve_process([sys.executable, "-m", "flow.cli", "serve", str(graph)], log=log, cwd=GRAPHS.parent,
                       env={**os.environ, "FLOW_DATA_DIR": str(data)}) as served:
        yield served


class Clients:
    """Clients looping against a server until it dies (the chat client asks CHATS distinct questions, then
    stops); each records only what it fully received."""

    CHATS = 3

    def __init__(self, base: str) -> None:
        self.url = base + "/v1"
        self.turns: list[tuple[str, str]] = []  # the agent's acknowledged turns: (user, assistant)
        self.responses: dict[str, str] = {}  # stored response id → its text
        self.answers: dict[str, tuple[str, int]] = {}  # chat prompt → (text, cached tokens)
        self.threads = [threading.Thread(target=self._loop, args=(f,), daemon=True)
                        for f in (self._turn, self._respond, self._chat)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(60)
            assert not thread.is_alive()

    def enough(self) -> bool:
        return len(self.turns) >= 3 and len(self.responses) >= 3 and len(self.answers) == self.CHATS

    def _loop(self, step: Callable[[httpx.Client, int], bool]) -> None:
        with httpx.Client(timeout=120) as client:
            i = 0
            while True:
                try:
                    if not step(client, i):
                        return
                except (httpx.HTTPError, ValueError):  # the server died mid-request: it is not acknowledged
                    return
                i += 1

    def _turn(self, client: httpx.Client, i: int) -> bool:
        user = f"Turn {i}: how is the lamp tonight?"
        r = client.post(self.url + "/agents/keeper/generate", json={
            "messages": [{"role": "user", "content": user}], "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        self.turns.append((user, r.json()["choices"][0]["message"]["content"]))
        return True

    def _respond(self, client: httpx.Client, i: int) -> bool:
        r = client.post(self.url + "/responses", json={"model": "tiny", "input": f"Note {i} for the log book.",
                                                       "max_output_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        self.responses[body["id"]] = output_text(body)
        return True

    def _chat(self, client: httpx.Client, i: int) -> bool:
        prompt = f"Question {i}: what did the keeper see? {LONG}"
        r = client.post(self.url + "/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        body = r.json()
        self.answers[prompt] = (body["choices"][0]["message"]["content"],
                                body["usage"]["prompt_tokens_details"]["cached_tokens"])
        return len(self.answers) < self.CHATS


def test_kill_9_loses_nothing_acknowledged(tiny_qwen3: Path, tmp_path: Path) -> None:
    graph = tmp_path / "graph.toml"
    graph.write_text(f'extends = "{GRAPHS / "default.toml"}"\n\n[resources.model]\npath = "{tiny_qwen3}"\n'
                     f'name = "tiny"\n')
    data, log = tmp_path / "data", tmp_path / "flow.log"

    with flow_serve(graph, data, log) as (proc, base):
        created = httpx.post(base + "/v1/agents", json={"id": "keeper", "model": "tiny", "system_prompt": SYSTEM},
                             timeout=30)
        assert created.status_code == 200, created.text
        clients = Clients(base)
        clients.start()
        deadline = time.monotonic() + 90
        while not clients.enough():
            assert time.monotonic() < deadline, "the clients made too little progress"
            assert all(t.is_alive() for t in clients.threads[:2]), "a client failed before the kill"
            time.sleep(0.05)
        # The chat answers' blocks reach the disk tier's writer thread (niced: it lags under load); it commits
        # as soon as its queue is empty. The agent and Responses clients keep writing meanwhile.
        stored = stats(base)["prefix_cache"]["stored_blocks"]
        while stats(base)["prefix_cache"]["disk"]["written"] < stored and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert all(t.is_alive() for t in clients.threads[:2]), "a client failed before the kill"
        os.kill(proc.pid, signal.SIGKILL)  # mid-traffic: every client has a request in flight
        proc.wait(30)
        clients.join()
    assert all(cached == 0 for _, cached in clients.answers.values())  # distinct prompts: uncached answers

    with flow_serve(graph, data, log) as (_, base):
        resources = stats(base)
        assert resources["agent_store"]["state"] == "ok" and resources["response_store"]["state"] == "ok"
        disk = resources["prefix_cache"]["disk"]
        assert disk["damaged_index_set_aside"] == 0 and disk["blocks"] > 0 and disk["corrupt"] == 0

        # Every acknowledged agent turn, in order (a turn recorded just before the kill may follow them).
        agent = httpx.get(base + "/v1/agents/keeper", timeout=30).json()
        history = [(m["role"], m["content"]) for m in agent["history"]]
        acked = [pair for user, answer in clients.turns for pair in (("user", user), ("assistant", answer))]
        assert history[:len(acked)] == acked and len(history) - len(acked) in (0, 2)

        # Every acknowledged stored response, and it can be continued.
        for rid, text in clients.responses.items():
            fetched = httpx.get(f"{base}/v1/responses/{rid}", timeout=30)
            assert fetched.status_code == 200, fetched.text
            assert output_text(fetched.json()) == text
        follow = httpx.post(base + "/v1/responses", json={"model": "tiny", "input": "And then?",
                                                          "max_output_tokens": 2,
                                                          "previous_response_id": list(clients.responses)[-1]},
                            timeout=120)
        assert follow.status_code == 200, follow.text

        # Cached output after the restart (from the disk tier) is the uncached greedy output.
        reused = 0
        with httpx.Client(timeout=120) as client:
            for prompt, (text, _) in clients.answers.items():
                r = client.post(base + "/v1/chat/completions", json={
                    "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                    "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == text, prompt
                reused += r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused > 0, "no block came back from disk"

        turn = httpx.post(base + "/v1/agents/keeper/generate", json={
            "messages": [{"role": "user", "content": "After the storm?"}], "max_tokens": 4}, timeout=120)
        assert turn.status_code == 200, turn.text
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
