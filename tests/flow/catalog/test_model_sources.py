"""A model resource's sources: ``path``, then ``fallbacks`` not downloaded but for the last — how the demo graph
serves real models where the machine has them and smoke-test models where it does not."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from flow.builtins import compile_tables
from flow.graph.resource import Links
from flow.graph.spec import load_tables
from flow.resources.model import ModelResource
from runtime.model_kinds import detect_kind_of
from tests.harness import GRAPHS, running_server, tables_with_model


def test_the_first_source_on_this_machine_is_served(tiny_qwen3: Path, tmp_path: Path) -> None:
    tables = tables_with_model("$FLOW_TEST_NEVER_SET/model", fallbacks=[str(tmp_path / "absent"), str(tiny_qwen3)])
    with running_server(compile_tables(tables, "fallbacks")) as running:
        (model,) = running.server.models
        assert model.source == str(tiny_qwen3) and model.kind == "text"
        answer = httpx.post(running.url + "/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert answer.status_code == 200


def demo_models() -> dict[str, ModelResource]:
    """The demo graph's model resources, built as the server builds them (nothing loaded)."""
    graph = compile_tables(load_tables(GRAPHS / "demo.toml"), "demo.toml")
    return {r.id: ModelResource(r.id, r.config, Links()) for r in graph.resources.values() if r.cls is ModelResource}


def test_the_demo_serves_real_models_when_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  tiny_llama: Path) -> None:
    monkeypatch.setenv("FLOW_REAL_MODELS", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "smollm2-135m-instruct").symlink_to(tiny_llama)  # stands in for the real one
    models = demo_models()
    assert models["model"].resolve_source() == tiny_llama.resolve()
    assert models["model"].source == "$FLOW_REAL_MODELS/smollm2-135m-instruct"


def test_the_demo_falls_back_to_smoke_test_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOW_REAL_MODELS", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.cache/flow/real-models
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # nothing in the hub cache
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    models = demo_models()
    for resource, preset in (("model", "tiny:tiny-qwen3"), ("embedder", "tiny:tiny-bert")):
        models[resource].resolve_source()
        assert models[resource].source == preset
    assert detect_kind_of(models["vision"].resolve_source()) == "vision"  # every kind, without a download
    assert detect_kind_of(models["vision_qwen"].resolve_source()) == "vision"  # 3-D positions too
