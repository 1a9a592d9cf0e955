"""``flow probe``: what it records, and that serving uses the record before detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from flow.capabilities import Capabilities, CapabilityStore
from flow.cli import main
from runtime.models import resolve_model_path
from tests.harness import graph_with_model, running_server


def test_probe_records_template_delivery_and_thinking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "caps.sqlite"
    assert main(["probe", "tiny:tiny-qwen3", "--max-tokens", "24", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "SMOKE-TEST MODEL" in out and "family:          qwen3" in out
    caps = CapabilityStore(db).all()
    assert len(caps) == 1
    qwen = caps[0]
    assert (qwen.family, qwen.tool_delivery, qwen.tool_parser, qwen.reasoning_parser) == (
        "qwen3", "template", "hermes_json", "think_tag")
    assert qwen.thinking and qwen.context_length == 4096
    assert "get_weather" in qwen.evidence["calls_by_parser"].get("hermes_json", []) or not qwen.tool_calls_verified
    assert main(["probe", "--list", "--db", str(db)]) == 0
    assert "family qwen3" in capsys.readouterr().out


def test_probe_finds_gemma3_needs_injected_tools(tmp_path: Path) -> None:
    db = tmp_path / "caps.sqlite"
    assert main(["probe", "tiny:tiny-gemma3", "--max-tokens", "16", "--db", str(db)]) == 0
    (gemma,) = CapabilityStore(db).all()
    assert gemma.family == "gemma3" and gemma.tool_delivery == "injected" and not gemma.thinking


def test_serving_reads_the_store_before_detection(tiny_llama: Path) -> None:
    path = resolve_model_path(str(tiny_llama))
    store = CapabilityStore()  # the test session's data directory (see conftest)
    store.put(Capabilities(model=str(path), family="default", tool_parser="pythonic", reasoning_parser="null",
                           tool_delivery="injected", thinking=False, context_length=4096))
    with running_server(graph_with_model(tiny_llama, name="tiny-llama")) as server:
        model = server.server.models[0]
        assert model.family.name == "default"
        assert (model.family.tools.parser, model.family.tools.delivery) == ("pythonic", "injected")
    with store._connect() as conn:
        conn.execute("DELETE FROM capabilities")


def test_corrupt_store_falls_back_to_detection(tmp_path: Path) -> None:
    db = tmp_path / "broken.sqlite"
    db.write_bytes(b"not a database at all" * 100)
    assert CapabilityStore(db).get("/any/model") is None
