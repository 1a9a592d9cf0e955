"""``flow probe``: what it records, and that serving uses the record before detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from flow.catalog.capabilities import Capabilities, CapabilityStore
from flow.cli.main import main
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


def test_probe_records_an_embedding_models_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "caps.sqlite"
    assert main(["probe", "tiny:tiny-bert", "--db", str(db)]) == 0
    assert "pooling:         mean" in capsys.readouterr().out
    assert main(["probe", "tiny:tiny-reranker", "--db", str(db)]) == 0
    bert, reranker = sorted(CapabilityStore(db).all(), key=lambda c: "reranker" in c.model)
    assert bert.kind == "embeddings" and bert.context_length == 512
    assert {k: bert.profile[k] for k in ("task", "dims", "pooling", "normalized", "matryoshka")} == {
        "task": "embed", "dims": 32, "pooling": "mean", "normalized": True, "matryoshka": None}
    assert reranker.profile["task"] == "score" and len(reranker.evidence["pair_scores"]) == 2
    assert main(["probe", "--list", "--db", str(db)]) == 0
    listing = capsys.readouterr().out
    assert "embeddings, 32 dims, mean pooling" in listing and "rerank (cross-encoder)" in listing


def test_a_store_from_before_kinds_keeps_its_rows(tmp_path: Path) -> None:
    import sqlite3

    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as conn:  # the first release's table: no kind, no profile
        conn.execute("CREATE TABLE capabilities (model TEXT PRIMARY KEY, family TEXT NOT NULL, tool_parser TEXT NOT "
                     "NULL, reasoning_parser TEXT NOT NULL, tool_delivery TEXT NOT NULL, thinking INTEGER NOT NULL, "
                     "context_length INTEGER NOT NULL, tool_calls_verified INTEGER NOT NULL, probed_at REAL NOT "
                     "NULL, evidence TEXT NOT NULL)")
        conn.execute("INSERT INTO capabilities VALUES ('/m', 'qwen3', 'hermes_json', 'think_tag', 'template', 1, "
                     "4096, 1, 1.0, '{}')")
    conn.close()
    store = CapabilityStore(db)
    old = store.get("/m")
    assert old is not None and (old.family, old.kind, old.profile) == ("qwen3", "text", {})
    store.put(Capabilities(model="/e", family="-", tool_parser="null", reasoning_parser="null", tool_delivery="-",
                           thinking=False, context_length=512, kind="embeddings", profile={"dims": 32}))
    assert [c.model for c in store.all()] == ["/e", "/m"] and store.get("/e").profile == {"dims": 32}  # type: ignore[union-attr]


# 1-D and 3-D (M-RoPE) positions, and cross-attention (one <|image|> token per image)
@pytest.mark.parametrize("preset", ["tiny-smolvlm", "tiny-qwen2.5-vl", "tiny-mllama"])
def test_probe_records_a_vision_models_image_capabilities(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          preset: str) -> None:
    from runtime.tiny import PRESETS
    from runtime.tiny.vlm import image_tokens

    db = tmp_path / "caps.sqlite"
    assert main(["probe", f"tiny:{preset}", "--max-tokens", "8", "--db", str(db)]) == 0
    assert "images:          several per message" in capsys.readouterr().out
    (caps,) = CapabilityStore(db).all()
    spec = PRESETS[preset]
    assert spec.vision is not None and caps.kind == "vision" and caps.profile["multi_image"] is True
    assert caps.profile["image_tokens"] == {f"{w}x{h}": image_tokens(spec.arch, spec.vision, w, h)
                                            for w, h in ((64, 48), (1024, 768))}
    assert caps.profile["max_images"] is None  # neither declares a limit
    assert main(["probe", "--list", "--db", str(db)]) == 0
    assert ": vision, family" in capsys.readouterr().out
