"""Model ids as clients send them: glob aliases (``claude-*`` for Claude Code's own model names, ``*`` for any id
no model claims), exact ids first, patterns in graph order; listings show exact ids only."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx

from flow.builtins import compile_tables
from tests.harness import GRAPHS, RunningServer, running_server, tables_with_model


def test_glob_aliases_answer_the_ids_they_match(tiny_qwen3: Path, tiny_llama: Path) -> None:
    tables = tables_with_model(tiny_qwen3)
    tables["resources"]["model"]["aliases"] = ["default", "claude-*"]
    tables["resources"]["other"] = {"type": "model", "path": str(tiny_llama), "name": "other", "aliases": ["*"]}
    with running_server(compile_tables(tables, "glob aliases")) as running:
        client = anthropic.Anthropic(base_url=running.base_url, api_key="none")
        for model_id, served in (("claude-opus-4-8", "tiny"), ("claude-haiku-4-5", "tiny"), ("gpt-4o", "other"),
                                 ("other", "other"), ("tiny", "tiny")):
            message = client.messages.create(model=model_id, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
            assert message.model == model_id
            stats = {m["id"]: m["engine"]["submitted"] for m in running.health()["models"]}
            assert stats[served] >= 1
        listing = [m["id"] for m in httpx.get(running.url + "/models", timeout=10).json()["data"]]
        assert listing == ["tiny", "default", "other"]
        one = httpx.get(running.url + "/models/claude-opus-4-8", timeout=10).json()
        assert one["id"] == "claude-opus-4-8" and one["alias_of"] == "tiny"


def test_without_a_catch_all_unknown_ids_stay_404(qwen3_server: RunningServer) -> None:
    answer = httpx.post(qwen3_server.url + "/chat/completions", timeout=30, json={
        "model": "claude-opus-4-8", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "model_not_found"


def test_model_on_the_command_line_replaces_the_name_and_its_aliases(tiny_llama: Path, tmp_path: Path) -> None:
    from flow.cli.main import _load_graph

    graph_file = tmp_path / "graph.toml"
    graph_file.write_text(f'extends = "{GRAPHS / "demo.toml"}"\n[resources.model]\n'
                          'aliases = ["default", "demo-old", "claude-*"]\n')
    graph = _load_graph(str(graph_file), model=str(tiny_llama))
    config = graph.resources["model"].config
    assert config.name == tiny_llama.name  # type: ignore[attr-defined]
    assert config.aliases == ["default", "claude-*"] and config.fallbacks == []  # type: ignore[attr-defined]
