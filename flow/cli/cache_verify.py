"""``flow cache verify FILE``: does a prefix-cache hit give a conversation the same next token as a cold run?

The conversation (an OpenAI chat ``messages`` list, an Anthropic Messages body with its ``system``, or either as
``{"messages": [...]}``) is sent twice to a flow server — a running one (``--url``) or one started here on a
model directory (``--model``) — through its own protocol endpoint, so it is templated and tokenized exactly as a
client's would be: once to put its prompt in the prefix cache, then again with ``cache_audit``. The second
request's hit is recomputed cold on the server's idle device time and the two next-token logit vectors are
compared (runtime/prefix_audit.py); this command reads the outcome from ``/stats`` and prints it. Exit status 0:
the next token agrees; 1: it does not; 2: nothing could be verified (no hit, no prefix cache, a timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import httpx

DEFAULT_URL = "http://127.0.0.1:8080"  # `flow serve`'s default address
ANTHROPIC_ONLY = {"tool_use", "tool_result", "thinking", "document"}


def read_conversation(path: Path) -> tuple[str, dict[str, Any]]:
    """The protocol (``openai`` or ``anthropic``) and the body's conversation part, from a file."""
    data = json.loads(path.read_text(encoding="utf-8"))
    body: dict[str, Any] = {"messages": data} if isinstance(data, list) else dict(data)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{path}: expected a list of messages, or an object with a non-empty 'messages' list")
    blocks = {block.get("type") for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
              for block in m["content"] if isinstance(block, dict)}
    anthropic = "system" in body or bool(blocks & ANTHROPIC_ONLY)
    keep = ("messages", "system", "tools") if anthropic else ("messages", "tools")
    return ("anthropic" if anthropic else "openai"), {k: body[k] for k in keep if k in body}


@contextmanager
def model_server(model: str) -> Iterator[str]:
    """The default graph on ``model`` with an in-memory prefix cache, served here; its base URL."""
    from flow.builtins import compile_tables
    from flow.catalog.bundled import graphs_dir
    from flow.graph.spec import load_tables
    from flow.serve.embedded import running_server

    tables = load_tables(graphs_dir() / "default.toml")
    tables["resources"]["model"].update(path=model, name="verify", aliases=[])
    tables["resources"].setdefault("prefix_cache", {"type": "prefix_cache"}).update(disk=False)
    with running_server(compile_tables(tables, "flow cache verify")) as server:
        yield server.base_url


def send(client: httpx.Client, protocol: str, model: str, conversation: dict[str, Any], audit: bool) -> Any:
    body = {**conversation, "model": model, "max_tokens": 1, "temperature": 0, "stream": False}
    if audit:
        body["cache_audit"] = True
    path = "/v1/messages" if protocol == "anthropic" else "/v1/chat/completions"
    answer = client.post(path, json=body)
    if answer.status_code != 200:
        raise RuntimeError(f"{path} answered {answer.status_code}: {answer.text[:500]}")
    return answer.json()


def cached_tokens(protocol: str, answer: Any) -> int:
    usage = answer.get("usage") or {}
    if protocol == "anthropic":
        return int(usage.get("cache_read_input_tokens") or 0)
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def find_audit(client: httpx.Client, request_id: str, timeout: float) -> dict[str, Any] | None:
    """The audit of ``request_id`` in ``/stats`` once the server has run it (None: not within ``timeout``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.get("/stats").json()
        for resource in (stats.get("resources") or {}).values():
            for audit in ((resource or {}).get("audit") or {}).get("recent", []):
                if audit.get("request") == request_id:
                    return audit  # type: ignore[no-any-return]
        time.sleep(0.1)
    return None


def verify(base_url: str, key: str | None, model: str | None, path: Path, timeout: float) -> int:
    protocol, conversation = read_conversation(path)
    headers = {"Authorization": f"Bearer {key}", "x-api-key": key} if key else {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=max(timeout, 60.0)) as client:
        if model is None:
            models = client.get("/v1/models").json().get("data") or []
            if not models:
                print("flow cache verify: the server lists no models", file=sys.stderr)
                return 2
            model = str(models[0]["id"])
        send(client, protocol, model, conversation, audit=False)  # its prompt's blocks go to the cache
        answer = send(client, protocol, model, conversation, audit=True)
        hit = cached_tokens(protocol, answer)
        if not hit:
            print("flow cache verify: the second request reused no cached tokens, so there is no hit to verify "
                  "(is a prefix cache on for this model, and the conversation longer than one block?)",
                  file=sys.stderr)
            return 2
        request_id = str(answer["id"]).split("_", 1)[-1] if protocol == "anthropic" else \
            str(answer["id"]).removeprefix("chatcmpl-")
        audit = find_audit(client, request_id, timeout)
    if audit is None:
        print(f"flow cache verify: no audit of request {request_id} within {timeout:g} s (audits run when the "
              "device is idle; a busy server may need longer: --timeout)", file=sys.stderr)
        return 2
    verdict = "agrees" if audit["agree"] else "DISAGREES"
    print(f"{path.name} ({protocol}, model {model}): a hit of {audit['prefix_tokens']} tokens; the next token "
          f"{verdict} with a cold run (hit {audit['hit_token']}, cold {audit['cold_token']}); largest next-token "
          f"logit difference {audit['max_difference']:.3g}")
    return 0 if audit["agree"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flow cache verify", description=__doc__.split("\n\n")[0] if __doc__
                                     else None)
    parser.add_argument("file", type=Path, help="conversation JSON (OpenAI messages or an Anthropic body)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--url", help=f"a running flow server (default {DEFAULT_URL})")
    where.add_argument("--model", dest="model_dir",
                       help="a model directory, hub id or tiny:PRESET: served here with an in-memory prefix cache")
    parser.add_argument("--model-id", help="the model to ask on a running server (default: its first)")
    parser.add_argument("--key", default=os.environ.get("FLOW_API_KEY"), help="API key (default $FLOW_API_KEY)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the audit")
    args = parser.parse_args(argv)
    try:
        server = model_server(args.model_dir) if args.model_dir else nullcontext(args.url or DEFAULT_URL)
        with server as base_url:
            model = "verify" if args.model_dir else args.model_id
            return verify(base_url, args.key, model, args.file, args.timeout)
    except (OSError, ValueError, RuntimeError, httpx.HTTPError) as exc:
        print(f"flow cache verify: {exc}", file=sys.stderr)
        return 2
