"""The ``response_store`` resource: stored Responses for ``previous_response_id`` and GET.

A per-process store with a time-to-live and a byte-capped LRU: agents chain
turns through it, so recently used responses stay and old ones go. Each entry
keeps the response object as sent (for ``GET /v1/responses/{id}``) and the
conversation a follow-up continues (messages in template shape). Sizes are
estimated from the JSON encoding, which is what dominates an entry's memory.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from flow.registry import register_resource
from flow.resources import ResourceConfig
from protocols.ir import Message
from runtime.device import DeviceThread


class ResponseStoreConfig(ResourceConfig):
    ttl_seconds: float = Field(default=3600.0, gt=0, description="how long a stored response can be continued")
    max_bytes: int = Field(default=64 * 1024 * 1024, ge=1024, description="LRU cap on the stored bytes")


@dataclass(frozen=True)
class StoredResponse:
    id: str
    body: dict[str, Any]
    conversation: tuple[Message, ...]
    size: int
    expires_at: float


@register_resource
class ResponseStore:
    type_name: ClassVar[str] = "response_store"
    Config: ClassVar[type[ResourceConfig]] = ResponseStoreConfig
    description: ClassVar[str] = "stored Responses API responses (TTL + byte-capped LRU)"

    def __init__(self, resource_id: str, config: ResponseStoreConfig) -> None:
        self.id = resource_id
        self.config = config
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # stages call in from trio; tests may look in from other threads
        self.counters = {"stored": 0, "hits": 0, "misses": 0, "evicted": 0, "expired": 0}

    async def start(self, device: DeviceThread) -> None:
        """Nothing to load."""

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def put(self, response_id: str, body: dict[str, Any], conversation: tuple[Message, ...]) -> None:
        size = len(json.dumps(body, default=str)) + sum(
            len(m.content) + len(json.dumps(m.extra, default=str)) for m in conversation)
        entry = StoredResponse(response_id, body, conversation, size, time.monotonic() + self.config.ttl_seconds)
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response_id] = entry
            self._bytes += size
            self.counters["stored"] += 1
            while self._bytes > self.config.max_bytes and len(self._entries) > 1:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size
                self.counters["evicted"] += 1

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None and entry.expires_at <= time.monotonic():
                del self._entries[response_id]
                self._bytes -= entry.size
                self.counters["expired"] += 1
                entry = None
            if entry is None:
                self.counters["misses"] += 1
                return None
            self._entries.move_to_end(response_id)
            self.counters["hits"] += 1
            return entry

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"type": self.type_name, "entries": len(self._entries), "bytes": self._bytes,
                    "max_bytes": self.config.max_bytes, "ttl_seconds": self.config.ttl_seconds, **self.counters}

    def delete(self, response_id: str) -> bool:
        with self._lock:
            entry = self._entries.pop(response_id, None)
            if entry is not None:
                self._bytes -= entry.size
            return entry is not None
