"""The prefix cache's audit through the real server (``audit_rate``): a hit's next-token logits recomputed cold on
idle device time and compared — honest hits agree to float32 rounding, a planted wrong block is caught (its
disagreement counted in /stats and /metrics and logged with the request and the prefix length)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from flow.builtins import compile_tables
from flow.cli import cache_verify
from tests.harness import RunningServer, running_server, tables_with_prefix_cache

SYSTEM = "You keep the lighthouse on the northern cape. " * 12  # a few blocks of 16 tokens
BLOCK = 16


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    tables = tables_with_prefix_cache(tiny_llama, tmp_path_factory.mktemp("kv"), block_tokens=BLOCK,
                                      audit_rate=1.0, disk=False)
    with running_server(compile_tables(tables, "prefix audit (test)")) as running:
        yield running


def ask(server: RunningServer, question: str) -> dict[str, Any]:
    answer = httpx.post(server.url + "/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def audit(server: RunningServer) -> dict[str, Any]:
    stats = httpx.get(server.base_url + "/stats", timeout=30).json()
    return stats["resources"]["prefix_cache"]["audit"]  # type: ignore[no-any-return]


def audited(server: RunningServer, count: int) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while (found := audit(server))["audits"] < count:
        assert time.monotonic() < deadline, f"no audit #{count} within 60 s: {found}"
        time.sleep(0.05)
    return found


def test_honest_hits_agree_with_their_cold_runs(server: RunningServer) -> None:
    before = audit(server)["audits"]
    ask(server, "Where is the lamp?")  # cold: its prompt's blocks go to the cache
    first = ask(server, "Where is the lamp?")  # a hit, audited
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
    found = audited(server, before + 1)
    assert found["rate"] == 1.0 and found["agreements"] == found["audits"] and found["disagreements"] == 0
    assert found["max_difference"] < 1e-2  # float32 rounding of another chunking, nothing more
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert f'flow_prefix_cache_audits_total{{resource="prefix_cache"}} {found["audits"]}' in metrics
    assert 'flow_prefix_cache_audit_agreements_total{resource="prefix_cache"}' in metrics


def test_flow_cache_verify_against_the_running_server(server: RunningServer, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An OpenAI messages file: sent twice through /v1/chat/completions, the second with ``cache_audit``; the audit
    of that request is read from /stats (exit 0: the next token agrees)."""
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([{"role": "system", "content": "You count the ships. " * 15},
                                        {"role": "user", "content": "How many tonight?"}]))
    assert cache_verify.main([str(conversation), "--url", server.base_url, "--model-id", "tiny"]) == 0
    said = capsys.readouterr().out
    assert "(openai, model tiny): a hit of" in said and "agrees with a cold run" in said


def test_a_planted_wrong_block_is_caught(server: RunningServer, caplog: pytest.LogCaptureFixture) -> None:
    """The cached blocks of a conversation are overwritten with noise (as a damaged block that passed its checksum
    would be): the next hit's first logits are far from the cold run's, and the audit says so."""
    import mlx.core as mx

    engine = server.server.models[0].loaded.engine  # type: ignore[union-attr]
    prefix = engine.prefix
    question = "Which ships passed tonight?"
    ask(server, question)  # its blocks, honest
    caught: list[dict[str, Any]] = []
    for seed in range(3):  # noise that leaves the greedy next token where it was is possible, three times not
        def plant(seed: int = seed) -> int:
            mx.random.seed(seed)
            planted = 0
            for block in list(prefix._blocks.values()):
                if block.arrays is not None and block.length:
                    block.arrays = [None if a is None else mx.random.normal(a.shape).astype(a.dtype) * 3
                                    for a in block.arrays]
                    block.segment = None
                    planted += 1
            mx.eval([a for b in prefix._blocks.values() for a in (b.arrays or []) if a is not None])
            return planted
        assert engine.device.call(plant) > 0
        count = audit(server)["audits"] + 1
        with caplog.at_level(logging.WARNING, logger="flow.prefix_audit"):
            ask(server, question)
            found = audited(server, count)
        assert found["max_difference"] > 0.5  # the hit's logits moved far: nothing like rounding
        if found["disagreements"]:
            caught.append(found)
            break
    assert caught, "three planted blocks never changed the next token"
    last = caught[0]["last_disagreement"]
    assert last["prefix_tokens"] >= BLOCK and last["hit_token"] != last["cold_token"]
    assert any("disagrees with its cold run" in r.getMessage() and f"prefix {last['prefix_tokens']} tokens"
               in r.getMessage() for r in caplog.records)


def test_flow_cache_verify_serves_a_model_directory_for_an_anthropic_body(tiny_llama: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    body = {"system": "You keep the tide tables. " * 15,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "When is high water?"}]}]}
    conversation = tmp_path / "messages.json"
    conversation.write_text(json.dumps(body))
    assert cache_verify.main([str(conversation), "--model", str(tiny_llama)]) == 0
    said = capsys.readouterr().out
    assert "(anthropic, model verify): a hit of" in said and "agrees with a cold run" in said


def test_flow_cache_verify_says_what_it_could_not_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert cache_verify.main([str(empty), "--url", "http://127.0.0.1:9"]) == 2
    assert "expected a list of messages" in capsys.readouterr().err
