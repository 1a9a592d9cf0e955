"""A request that reaches a model of the wrong kind: a 400 in its protocol's shape, naming the model's kind and
the models that can serve it; ``/health`` shows each model's kind."""

from __future__ import annotations

from pathlib import Path

import httpx

from flow.builtins import compile_tables
from tests.harness import running_server, tables_with_model


def test_wrong_kind_is_a_400_naming_the_models_that_can(tiny_qwen3: Path) -> None:
    tables = tables_with_model(tiny_qwen3)
    # A second resource declared an embedding model (lazy: this flow does not load embedding models yet).
    tables["resources"]["embedder"] = {"type": "model", "path": str(tiny_qwen3), "name": "embedder",
                                       "kind": "embeddings", "load": "lazy"}
    with running_server(compile_tables(tables, "kinds")) as running:
        chat = httpx.post(running.url + "/chat/completions", timeout=30, json={
            "model": "embedder", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 400
        error = chat.json()["error"]
        assert error["code"] == "wrong_model_kind" and error["param"] == "model"
        assert error["message"] == ("The model 'embedder' is an embeddings model and cannot serve this chat "
                                    "request. Models that can: default, tiny.")
        messages = httpx.post(running.base_url + "/v1/messages", timeout=30, json={
            "model": "embedder", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
        assert "is an embeddings model" in messages.json()["error"]["message"]
        kinds = {m["id"]: m["kind"] for m in running.health()["models"]}
        assert kinds == {"tiny": "text", "embedder": "embeddings"}
        ok = httpx.post(running.url + "/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert ok.status_code == 200
