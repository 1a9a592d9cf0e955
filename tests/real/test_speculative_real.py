"""Speculative decoding on trained weights: real Qwen2.5-Coder-0.5B-Instruct asked to rename a function in a
file and give the whole file back — the case prompt lookup is for — answers byte for byte the same with
speculation on as off, and most of its tokens come from accepted drafts."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.real.conftest import RealModel, RealServer, real_server

pytestmark = pytest.mark.real

SOURCE = '''def parse_header(line):
    """Split a 'Key: value' header line into its name and value."""
    name, _, value = line.partition(":")
    return name.strip().lower(), value.strip()


def parse_headers(lines):
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers


def content_length(headers):
    return int(headers.get("content-length", "0"))
'''
PROMPT = ("Rename the function parse_header to read_header everywhere in this file and reply with the whole "
          f"file only, in a python code block.\n\n```python\n{SOURCE}```")
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def servers(real_model: RealModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RealServer,
                                                                                                   RealServer]]:
    path = real_model("qwen2.5-coder-0.5b-instruct")
    graph = tmp_path_factory.mktemp("graph") / "speculative.toml"
    graph.write_text(f'extends = "{Path(__file__).resolve().parents[2] / "graphs" / "default.toml"}"\n\n'
                     '[resources.model]\nspeculative = { kind = "ngram", max_draft = 8 }\n')
    with real_server(path, tmp_path_factory.mktemp("off")) as off:
        with real_server(path, tmp_path_factory.mktemp("on"), graph=str(graph)) as on:
            yield off, on


def answer(server: RealServer) -> str:
    body = httpx.post(server.url + "/chat/completions", timeout=600, json={
        "model": server.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
        "temperature": 0}).json()
    return str(body["choices"][0]["message"]["content"])


def test_a_file_rewrite_is_identical_and_mostly_drafted(servers: tuple[RealServer, RealServer]) -> None:
    off, on = servers
    expected = answer(off)
    assert "def parse_headers(lines):" in expected  # it writes the file back (renamed or not: a 0.5B model)
    assert answer(on) == expected
    engine = httpx.get(on.base_url + "/health", timeout=30).json()["models"][0]["engine"]
    assert engine["accepted_tokens"] > MAX_TOKENS // 3, engine
