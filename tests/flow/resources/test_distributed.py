"""One model served across processes (mlx.distributed, ring backend on loopback): ``flow serve -n 2``.

Real parts only: ``flow serve`` processes on loopback, their ranks as child processes, tiny float32
random-weight models. Greedy (and seeded) output through HTTP must equal the single-process server's, token
for token, alone, in concurrent streams and with a prefix-cache hit; a lost rank must end the streams with an
error event in their protocol and leave no process behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from runtime.tiny import ensure_tiny_model
from tests.harness import GRAPHS, serve_process

ROOT = Path(__file__).resolve().parents[3]
LONG_SYSTEM = ("You are a careful assistant. Answer briefly, cite nothing, and keep every answer on one line. "
               "The user is testing a distributed server, so the same prompt must give the same answer. ") * 2
PROMPTS = ["hello there", "write a haiku about rivers", "what is 2 + 2?", "name three colours"]


@contextmanager
def server(tmp_path: Path, model: Path, *flags: str, graph: Path = GRAPHS / "default.toml"
           ) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``flow serve`` of the default graph on ``model`` (its data, prefix cache included, under tmp_path)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLOW_DATA_DIR": str(tmp_path / "data")}
    log = tmp_path / f"serve-{'-'.join(flags) or 'single'}.log"
    with serve_process([sys.executable, "-m", "flow.cli", "serve", str(graph), "--model", str(model), *flags],
                       log=log, cwd=ROOT, env=env, seconds=180) as running:
        yield running


def long_stream(base: str, on_event: Any, seconds: float = 120) -> list[dict[str, Any]]:
    """The events of a long OpenAI chat stream; ``on_event(n)`` after the n-th. A stream still open after
    ``seconds`` (keepalive frames keep it from timing out) fails the test instead of hanging it."""
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "tell me a long story"}],
            "max_tokens": 3000, "temperature": 0, "stream": True}) as r:
        for line in r.iter_lines():
            assert time.monotonic() < deadline, f"the stream was still open after {seconds} s"
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                on_event(len(events))
    return events


def chat(base: str, content: str, *, max_tokens: int = 24, system: str | None = None,
         **extra: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    r = httpx.post(base + "/v1/chat/completions", json={"model": "default", "messages": messages,
                                                        "max_tokens": max_tokens, "temperature": 0, **extra},
                   timeout=120)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def stream_text(base: str, content: str, max_tokens: int = 32) -> str:
    """An OpenAI chat stream's text."""
    text = []
    with httpx.stream("POST", base + "/v1/chat/completions", timeout=120, json={
            "model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text.append(event["choices"][0]["delta"].get("content") or "")
    return "".join(text)


def answers(base: str) -> dict[str, Any]:
    """What the server answers, in every protocol, alone, in 4 concurrent streams, and from a prefix hit."""
    out: dict[str, Any] = {}
    out["openai"] = chat(base, PROMPTS[0])["choices"][0]["message"]["content"]
    out["seeded"] = chat(base, PROMPTS[1], temperature=0.9, seed=7)["choices"][0]["message"]["content"]
    out["n2"] = [c["message"]["content"] for c in chat(base, PROMPTS[2], n=2, temperature=0.9, seed=3)["choices"]]
    r = httpx.post(base + "/v1/messages", timeout=120, json={
        "model": "default", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": PROMPTS[0]}]})
    assert r.status_code == 200, r.text
    out["anthropic"] = "".join(b.get("text", "") for b in r.json()["content"])
    r = httpx.post(base + "/api/chat", timeout=120, json={
        "model": "default", "stream": False, "options": {"temperature": 0, "num_predict": 24},
        "messages": [{"role": "user", "content": PROMPTS[0]}]})
    assert r.status_code == 200, r.text
    out["ollama"] = r.json()["message"]["content"]
    r = httpx.post(base + "/v1/responses", timeout=120, json={
        "model": "default", "input": PROMPTS[1], "max_output_tokens": 24, "temperature": 0, "store": False})
    assert r.status_code == 200, r.text
    out["responses"] = [c.get("text") for item in r.json()["output"] for c in item.get("content", [])]
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "model": "default", "prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    out["completions"] = r.json()["choices"][0]["text"]
    with ThreadPoolExecutor(4) as pool:
        out["concurrent"] = list(pool.map(lambda p: stream_text(base, p), PROMPTS))
    first = chat(base, PROMPTS[3], system=LONG_SYSTEM)
    again = chat(base, PROMPTS[3], system=LONG_SYSTEM)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again["usage"]
    out["prefix"] = [first["choices"][0]["message"]["content"], again["choices"][0]["message"]["content"]]
    return out


def ranks(base: str) -> dict[str, Any]:
    model = httpx.get(base + "/health", timeout=10).json()["models"][0]
    distributed: dict[str, Any] = model["distributed"]
    return distributed


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def wait_for(condition: Any, seconds: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def tiny_qwen2() -> Path:
    return ensure_tiny_model("tiny-qwen2")


@pytest.mark.parametrize("preset,parallel", [("tiny-llama", "tensor"), ("tiny-qwen2", "pipeline")])
def test_distributed_output_equals_single_process(tmp_path: Path, preset: str, parallel: str) -> None:
    model = ensure_tiny_model(preset)
    with server(tmp_path / "single", model) as (_, base):
        expected = answers(base)
    with server(tmp_path / "dist", model, "-n", "2", "--parallel", parallel) as (proc, base):
        got = answers(base)
        group = ranks(base)
        assert group["state"] == "up" and group["parallel"] == parallel
        per_rank = group["per_rank"]
        assert [r["rank"] for r in per_rank] == [0, 1]
        assert all(r["steps"] > 0 and r["bytes"] > 0 for r in per_rank), per_rank
        metrics = httpx.get(base + "/metrics", timeout=10).text
        assert 'flow_rank_step_seconds_total{model="' in metrics and 'rank="1"' in metrics
        follower = int(group["pids"]["1"])
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert expected["openai"] and expected["responses"] and all(expected["concurrent"]) and all(expected["prefix"])
    assert got == expected
    wait_for(lambda: gone(follower), 60, "rank 1 to stop with the server")


def test_queueing_chunked_prefill_and_cancels_keep_ranks_in_step(tmp_path: Path, tiny_llama: Path) -> None:
    """A small batch (requests queue), prompts prefilled in chunks over several steps, the balanced strategy, a
    burst's budget other than the default (every rank prefills as rank 0 does: the setting travels in the rank
    spec), and clients that leave mid-prefill and mid-decode: the ranks stay in step, the answers are the
    single-process server's."""
    graph = tmp_path / "graph.toml"
    graph.write_text(f'extends = "{GRAPHS / "default.toml"}"\n\n[resources.model]\nmax_batch = 3\n'
                     'prefill_chunk = 16\nprefill_burst = 2\nstrategy = "balanced"\n')
    prompts = [f"{i}: " + "a long question about rivers and their banks " * (1 + 3 * (i % 3)) for i in range(8)]

    def run(base: str) -> list[str]:
        def leave(i: int) -> None:
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                    "model": "default", "messages": [{"role": "user", "content": prompts[i]}], "max_tokens": 400,
                    "temperature": 0, "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n == 3 * i:  # 0: before the first token (mid-prefill or queued), 3: mid-decode
                        return

        with ThreadPoolExecutor(10) as pool:
            gone_early = [pool.submit(leave, i) for i in (0, 1)]
            texts = list(pool.map(lambda p: stream_text(base, p, max_tokens=20), prompts))
            for f in gone_early:
                f.result()
        return texts

    with server(tmp_path / "single", tiny_llama, graph=graph) as (_, base):
        expected = run(base)
    with server(tmp_path / "dist", tiny_llama, "-n", "2", graph=graph) as (_, base):
        got = run(base)
        wait_for(lambda: all(rank["sequences"] == 0 for rank in ranks(base)["per_rank"]), 60, "every rank to drain")
        group = ranks(base)
        assert group["state"] == "up", group
        engine = httpx.get(base + "/health", timeout=10).json()["models"][0]["engine"]
        assert engine["cancelled"] == 2 and engine["prefill_chunks"] > len(prompts), engine
    assert all(expected) and got == expected


def test_hostfile_ranks_on_other_hosts_start_over_ssh(tmp_path: Path, tiny_llama: Path) -> None:
    """A hostfile whose second host is another address (127.0.0.2: loopback too on Linux) is started the way
    mlx.launch starts it, over ``ssh HOST SCRIPT`` — here an ssh that runs the script on this machine."""
    ssh = tmp_path / "fake-ssh"
    ssh.write_text('#!/bin/sh\n# ssh -tt HOST SCRIPT: run SCRIPT here\nfor last; do :; done\nexec /bin/sh -c "$last"\n')
    ssh.chmod(0o700)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([{"ssh": "here", "ips": ["127.0.0.1"]}, {"ssh": "there", "ips": ["127.0.0.2"]}]))
    graph = tmp_path / "graph.toml"
    graph.write_text(f'extends = "{GRAPHS / "default.toml"}"\n\n[resources.model]\n'
                     f'distributed = {{ hostfile = "{hostfile}", ssh = "{ssh}" }}\n')
    with server(tmp_path / "single", tiny_llama) as (_, base):
        expected = chat(base, PROMPTS[0])["choices"][0]["message"]["content"]
    with server(tmp_path, tiny_llama, graph=graph) as (proc, base):
        assert chat(base, PROMPTS[0])["choices"][0]["message"]["content"] == expected
        follower = int(ranks(base)["pids"]["1"])
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    wait_for(lambda: gone(follower), 60, "the ssh-started rank to stop with the server")
    assert "over " + str(ssh) + " on there" in (tmp_path / "serve-single.log").read_text()


def test_refused_features_and_disconnect(tmp_path: Path, tiny_llama: Path) -> None:
    with server(tmp_path, tiny_llama, "-n", "2") as (_, base):
        refused: list[tuple[dict[str, Any], str]] = [
            ({"response_format": {"type": "json_object"}}, "response_format"),
            ({"logit_bias": {"5": 1.0}}, "logit_bias"), ({"adapter": "tune"}, "adapter")]
        for extra, param in refused:
            r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
                "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "distributed" in error["message"]
        r = httpx.post(base + "/v1/adapters", timeout=60, json={"id": "tune", "path": str(tmp_path)})
        assert r.status_code == 400 and "distributed" in r.json()["error"]["message"], r.text
        # A client that leaves mid-stream: its sequence leaves the engine on every rank.
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                "model": "default", "messages": [{"role": "user", "content": "tell me a long story"}],
                "max_tokens": 3000, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            for _ in range(8):
                next(lines)
            assert all(rank["sequences"] == 1 for rank in ranks(base)["per_rank"])
        wait_for(lambda: all(rank["sequences"] == 0 for rank in ranks(base)["per_rank"]), 20,
                 "the sequence to leave every rank")
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["models"][0]["engine"]["cancelled"] == 1


def test_lost_rank_ends_streams_with_an_error_and_leaves_no_process(tmp_path: Path, tiny_llama: Path) -> None:
    """A rank killed mid-stream: the stream ends with an error event, the model is down (503, /health), and the
    server still stops promptly — also when rank 0's device thread stays blocked in the ring all-sum (MLX's
    ring backend does not end a collective issued after a peer's socket failed): then /health says so."""
    log = tmp_path / "serve--n-2.log"
    with server(tmp_path, tiny_llama, "-n", "2") as (proc, base):
        follower = int(ranks(base)["pids"]["1"])
        events = long_stream(base, lambda n: os.kill(follower, signal.SIGKILL) if n == 5 else None, seconds=60)
        assert len(events) > 5
        error = events[-1]["error"]
        assert error["message"] and "Traceback" not in error["message"], error
        wait_for(lambda: httpx.get(base + "/health", timeout=10).status_code == 503, 60, "/health to say 503")
        wait_for(lambda: "rank 1 (pid" in ranks(base)["down_reason"], 60, "the lost rank to be named")
        health = httpx.get(base + "/health", timeout=10).json()
        assert health["status"] == "unavailable"
        model = health["models"][0]
        assert model["ready"] is False and "rank 1" in model["distributed"]["down_reason"]
        r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 503 and "down" in r.json()["error"]["message"], r.text
        # Rank 0's shard is freed with its group, or the device thread is reported stuck (within SETTLE_SECONDS).
        wait_for(lambda: "device_thread" in ranks(base) or " unloaded (" in log.read_text(), 20,
                 "the shard to be freed or the device thread to be reported stuck")
        stuck = ranks(base).get("device_thread")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) is not None
    assert gone(follower)
    text = log.read_text()
    assert "rank 1 (pid" in text and "was killed by signal 9" in text
    if stuck is not None:
        assert "has not come back from a collective" in stuck and "not unloaded" in text, text
    else:
        assert " unloaded (" in text


def test_a_lost_group_is_formed_again_when_restart_is_on(tmp_path: Path, tiny_llama: Path) -> None:
    """``--restart``: a rank killed mid-stream takes the group down; the stream ends with an error, the server
    drains and executes itself again in the same process (same PID, same port) — whether or not rank 0's device
    thread came back from its last collective — which starts new ranks and serves as before."""
    def health_ok() -> bool:
        try:
            return httpx.get(base + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False  # between the drain and the new server's listening socket

    with server(tmp_path, tiny_llama, "-n", "2", "--restart") as (proc, base):
        before = chat(base, PROMPTS[0])["choices"][0]["message"]["content"]
        follower = int(ranks(base)["pids"]["1"])
        events = long_stream(base, lambda n: os.kill(follower, signal.SIGKILL) if n == 5 else None, seconds=60)
        assert "error" in events[-1], events[-1]
        wait_for(lambda: not health_ok(), 30, "the group to go down")
        wait_for(health_ok, 120, "the server to come back with a new group")
        assert proc.poll() is None  # the same process, executed again
        new_follower = int(ranks(base)["pids"]["1"])
        assert new_follower != follower and gone(follower)
        assert chat(base, PROMPTS[0])["choices"][0]["message"]["content"] == before
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) is not None
    assert gone(new_follower)
    log = (tmp_path / "serve--n-2---restart.log").read_text()
    assert "restarting the server to form it again" in log and "flow: restarting" in log


async def test_a_lost_group_never_waits_for_its_device_thread(tiny_llama: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's device thread held for good — as by a ring collective issued after a peer's socket failed, which
    MLX never ends; here by a job that waits on an event, the only way to hold it on purpose: winding the lost
    group down still ends the model's streams with the group's error at once and refuses new sequences, then
    reports the thread stuck after SETTLE_SECONDS instead of waiting for it, and abandons the thread: another
    model's stream on it ends too and jobs fail at once. Once the thread is free again, the
    engine frees what it held without starting a collective."""
    import queue
    import threading

    import trio
    from mlx_lm.utils import load

    from flow.resources import cluster as cluster_module
    from flow.resources.cluster import Cluster, Placement
    from protocols.ir import SamplingParams
    from runtime.device import DeviceLost, DeviceThread
    from runtime.engine import Engine
    from runtime.replication import GroupLost

    monkeypatch.setattr(cluster_module, "SETTLE_SECONDS", 0.5)
    device = DeviceThread("held-device")
    model, tokenizer = device.call(lambda: load(str(tiny_llama)))[:2]
    steps: queue.Queue[bytes] = queue.Queue()
    engine: Engine = Engine(model, device, replicator=QueueReplicator(True, steps, lambda: engine))
    release = threading.Event()
    device.submit(release.wait)  # the collective that never returns
    handle = engine.submit(tokenizer.encode("hello there"), max_tokens=8, stop_ids=frozenset(),
                           sampling=SamplingParams())
    # Another model served by the same device thread (one process, one thread for all MLX work).
    other: Engine = Engine(model, device)
    other_handle = other.submit(tokenizer.encode("hello"), max_tokens=8, stop_ids=frozenset(),
                                sampling=SamplingParams())
    cluster = Cluster("tiny", Placement.local(2))
    cluster.down = "rank 1 (pid 12345) was killed by signal 9; the model's group is down"
    with trio.fail_after(10):
        await cluster.wind_down(engine, device)
        chunks = [chunk async for chunk in handle.chunks]
    assert chunks == [] and isinstance(handle.error, GroupLost) and "rank 1 (pid 12345)" in str(handle.error)
    with pytest.raises(GroupLost, match="rank 1"):
        engine.submit([1, 2, 3], max_tokens=4, stop_ids=frozenset(), sampling=SamplingParams())
    assert cluster.stuck is not None and "has not come back from a collective" in cluster.stuck
    assert cluster.stats()["device_thread"] == cluster.stuck
    # Nothing else waits for the held thread either: the other model's stream has ended, with the reason, and
    # a job for the device fails at once.
    with trio.fail_after(5):
        assert [chunk async for chunk in other_handle.chunks] == []
    assert "model 'tiny'" in str(other_handle.error) and "has not come back" in str(other_handle.error)
    with pytest.raises(DeviceLost, match="has not come back"):
        device.submit(lambda: None).result(timeout=1)
    release.set()  # should the thread ever come back, its loop frees each engine without a collective
    deadline = time.monotonic() + 60
    while (engine.waiting or engine.active or other.waiting or other.active) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.waiting == engine.active == other.waiting == other.active == 0
    assert steps.empty()  # no step message (a collective) was sent
    device.stop()


def test_watchdog_stops_a_group_whose_rank_hangs(tmp_path: Path, tiny_llama: Path) -> None:
    """A rank that stops answering (SIGSTOP: alive, silent) is the watchdog's: the group goes down."""
    graph = tmp_path / "graph.toml"
    graph.write_text(f'extends = "{GRAPHS / "default.toml"}"\n\n[resources.model]\n'
                     "distributed = { ranks = 2, watchdog_seconds = 3 }\n")
    with server(tmp_path, tiny_llama, graph=graph) as (_, base):
        follower = int(ranks(base)["pids"]["1"])
        try:
            started = time.monotonic()
            events = long_stream(base, lambda n: os.kill(follower, signal.SIGSTOP) if n == 5 else None)
            assert "error" in events[-1] and time.monotonic() - started < 30
            wait_for(lambda: gone(follower), 60, "the hung rank to be killed")
            assert "watchdog_seconds 3" in ranks(base)["down_reason"]
        finally:
            if not gone(follower):
                os.kill(follower, signal.SIGKILL)


def test_server_killed_outright_leaves_no_rank(tmp_path: Path, tiny_llama: Path) -> None:
    with server(tmp_path, tiny_llama, "-n", "2") as (proc, base):
        follower = int(ranks(base)["pids"]["1"])
        proc.kill()  # no chance to stop its ranks: they notice their parent is gone
        proc.wait(10)
        wait_for(lambda: gone(follower), 60, "rank 1 to end without its server")


def test_mismatched_ranks_are_refused_before_load(tmp_path: Path, tiny_llama: Path) -> None:
    """Rank 1 has other model files than rank 0: both refuse, naming what differs, before loading weights."""
    other = tmp_path / "other-llama"
    shutil.copytree(tiny_llama, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (other / "config.json").write_text(json.dumps(config))
    from flow.resources.cluster import Placement
    from runtime.distributed import RankSpec

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps(Placement.local(2).addresses))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_HOSTFILE": str(hostfile)}
    leader_code = ("import sys; from pathlib import Path; from runtime.distributed import init_group, join\n"
                   "try:\n    join(init_group('ring'), Path(sys.argv[1]))\n"
                   "except Exception as exc:\n    print('REFUSED', exc); sys.exit(2)\n")
    leader = subprocess.Popen([sys.executable, "-c", leader_code, str(tiny_llama)], env={**env, "MLX_RANK": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    follower = subprocess.run([sys.executable, "-m", "runtime.rank", RankSpec(path=str(other)).json()],
                              env={**env, "MLX_RANK": "1"}, capture_output=True, text=True, timeout=60, cwd=ROOT)
    out, _ = leader.communicate(timeout=60)
    assert leader.returncode == 2 and follower.returncode == 2
    for text in (out.decode(), follower.stderr):
        assert "model files differ: rank 0" in text and "copy the same model files" in text, text
    assert "loaded" not in follower.stderr


def test_step_message_round_trip() -> None:
    from protocols.ir import CachePolicy, SamplingParams
    from runtime.replication import NewSequence, StepMessage, decode, encode

    message = StepMessage("step", (NewSequence((4, 5), (1, 2, 3) * 500, 64, (0, 7),
                                               (SamplingParams(temperature=0.7, seed=11, logit_bias=((3, -1.5),)),
                                                SamplingParams(seed=12)), 32,
                                               CachePolicy("prefix", 0.0, "s1")),), (1, 2))
    assert decode(encode(message)) == message
    assert decode(encode(StepMessage("heartbeat"))) == StepMessage("heartbeat")


def test_hostfile_placement(tmp_path: Path) -> None:
    """mlx.launch's hostfile, both shapes: one ring address per host, ports counting up; remote hosts named."""
    from flow.resources.cluster import ClusterError, Placement

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [{"ssh": "a", "ips": ["127.0.0.1"]},
                                                                 {"ssh": "b", "ips": ["10.0.0.2"]}]}))
    placement = Placement.from_hostfile(hostfile, starting_port=5000)
    assert placement.addresses == [["127.0.0.1:5000"], ["10.0.0.2:5001"]]
    assert placement.remote() == [1] and placement.ssh_hosts == [None, "b"]
    hostfile.write_text(json.dumps([{"ssh": "b", "ips": ["10.0.0.2"]}, {"ssh": "a", "ips": ["127.0.0.1"]}]))
    with pytest.raises(ClusterError, match="rank 0 is the server itself"):
        Placement.from_hostfile(hostfile)
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["127.0.0.1"]}]))
    with pytest.raises(ClusterError, match="at least two hosts"):
        Placement.from_hostfile(hostfile)
    hostfile.write_text(json.dumps([{"ssh": "a"}, {"ssh": "b", "ips": ["127.0.0.1"]}]))
    with pytest.raises(ClusterError, match=r'hosts\[0\].*"ips"'):
        Placement.from_hostfile(hostfile)


def test_distributed_settings_are_checked_as_a_whole() -> None:
    from pydantic import ValidationError

    from flow.resources.model import DistributedSettings, ModelConfig

    with pytest.raises(ValidationError, match="either ranks"):
        DistributedSettings()
    with pytest.raises(ValidationError, match="extra"):
        DistributedSettings(ranks=2, hosts=3)  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="adapters or speculative"):
        ModelConfig.model_validate({"path": "x", "distributed": {"ranks": 2}, "speculative": {"kind": "ngram"}})


class QueueReplicator:
    """Two engines in one process joined by a queue instead of collectives: after every step each records the
    state that must agree between ranks (which sequences are where, how far each has got)."""

    def __init__(self, leader: bool, channel: Any, engine_of: Any) -> None:
        self._leader = leader
        self.channel = channel
        self.engine_of = engine_of
        self.states: list[Any] = []

    @property
    def leader(self) -> bool:
        return self._leader

    def exchange(self, message: Any) -> Any:
        from runtime.replication import GroupLost, decode, encode

        if self._leader:
            self.channel.put(encode(message))  # through the codec, as the collectives carry it
            return message
        received = decode(self.channel.get(timeout=60))
        if received.kind == "stop":
            raise GroupLost("stopped")
        return received

    def step_done(self) -> None:
        engine = self.engine_of()
        prefill = engine.prefill
        rows = [("waiting", s) for s in prefill.waiting] + [("ready", s) for r in prefill.ready for s in r.seqs]
        rows += [("batch", s) for s in engine._batch.seqs]
        self.states.append(tuple((where, s.handle.id, s.prefilled, s.generated, s.fresh, tuple(s.fed))
                                 for where, s in rows))


def test_a_follower_engine_replays_the_leaders_steps_state_for_state(tiny_llama: Path) -> None:
    """Without MLX's collectives: every step of a follower engine fed the leader's step messages holds the same
    sequences in the same places with the same tokens — with queueing, chunked and grouped prefill, choices,
    seeded sampling and cancels that arrive from another thread in the middle of steps."""
    import queue
    import threading

    import trio
    from mlx_lm.utils import load

    from protocols.ir import SamplingParams
    from runtime.device import DeviceThread
    from runtime.engine import Engine
    from runtime.engine_config import EngineConfig
    from runtime.replication import STOP

    config = EngineConfig(max_batch=3, prefill_chunk=16, strategy="balanced")
    channel: queue.Queue[bytes] = queue.Queue()
    leader_device, follower_device = DeviceThread("leader-device"), DeviceThread("follower-device")
    engines: dict[str, Engine] = {}
    leading = QueueReplicator(True, channel, lambda: engines["leader"])
    following = QueueReplicator(False, channel, lambda: engines["follower"])
    model_a, tokenizer = leader_device.call(lambda: load(str(tiny_llama)))[:2]
    model_b = follower_device.call(lambda: load(str(tiny_llama)))[0]
    engines["leader"] = Engine(model_a, leader_device, config, replicator=leading)
    engines["follower"] = follower = Engine(model_b, follower_device, config, replicator=following)
    follower_device.remove_stepper(follower)

    def follow() -> None:
        from runtime.replication import GroupLost

        try:
            while True:
                follower.step()
        except GroupLost:
            return

    done = follower_device.submit(follow)
    prompts = [tokenizer.encode(f"{i}: " + "tell me about the sea and its tides " * (1 + 2 * (i % 4)))
               for i in range(10)]

    async def main() -> list[list[int]]:
        engine = engines["leader"]
        out: list[list[int]] = [[] for _ in prompts]

        async def one(i: int) -> None:
            await trio.sleep(0.01 * i)
            sampling = SamplingParams(temperature=0.8) if i % 3 == 1 else SamplingParams()
            handles = engine.submit_choices(prompts[i], [(sampling, None)] * (2 if i == 4 else 1), max_tokens=24,
                                            stop_ids=frozenset())
            async with trio.open_nursery():
                async for chunk in handles[0].chunks:
                    out[i] += chunk.token_ids
                    if i in (2, 7) and len(out[i]) >= 3:  # a client leaves mid-decode (from the trio thread)
                        threading.Thread(target=handles[0].cancel).start()
                        break

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return out

    out = trio.run(main)
    leader_device.call(lambda: leading.exchange(STOP))
    done.result(timeout=60)
    assert len(leading.states) == len(following.states) > len(prompts)
    assert leading.states == following.states
    assert engines["leader"].stats.cancelled == follower.stats.cancelled >= 1
    assert all(out[i] for i in range(len(prompts)))
