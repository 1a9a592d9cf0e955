"""A lean streaming client for ``flow bench``, in a process of its own, as a real client is.

    python -m flow.cli.stream_client URL BODY_JSON

POSTs the chat request, reads the SSE stream with the standard library only, and prints one JSON line: the
perf-counter stamps of the first and last content chunks, how many content chunks came, the completion tokens
the usage reported and the time to the first content chunk. In the server's process its parsing would take the
interpreter lock from the server's own threads, a cost no real client puts on a server.
"""

from __future__ import annotations

import http.client
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit


def stream(url: str, body: dict[str, Any]) -> dict[str, Any]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port or 80, timeout=600)
    data = json.dumps(body).encode()
    start = time.perf_counter()
    connection.request("POST", parts.path or "/", body=data, headers={"content-type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    first = last = None
    chunks = tokens = 0
    while line := response.readline():
        if not line.startswith(b"data: {"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            last = time.perf_counter()
            first = first or last
            chunks += 1
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    connection.close()
    return {"start": start, "first": first, "last": last, "chunks": chunks, "tokens": tokens}


if __name__ == "__main__":
    print(json.dumps(stream(sys.argv[1], json.loads(sys.argv[2]))))
