"""The OpenAI Responses stages: ``POST /v1/responses`` and ``GET|DELETE /v1/responses/{id}``.

Decode and format share one ``response_store`` resource: the format stage
stores each finished response (unless the request said ``store: false``), the
decode stage resolves ``previous_response_id`` from it, and the retrieve stage
answers GET and DELETE by itself (it is its route's entry and exit).

The store is an SQLite file, so its calls run on worker threads (a stored
response is committed to disk before the client gets its last bytes). If the
file is damaged, what needs it answers 503 ``unavailable`` before any
generation: a request that would be stored or continues a stored one, GET and
DELETE; ``store: false`` requests without ``previous_response_id`` still work.
"""

from __future__ import annotations

from typing import Any, ClassVar

import trio

from flow.graph.resource import Reference
from flow.graph.stage import StageConfig
from flow.resources.response_store import ResponseStore
from protocols import openai_responses
from protocols.errors import ApiError
from protocols.ir import ChatRequest, FinalResult, HttpRequest, Message
from protocols.openai_responses import ResponsesContext
from stages.protocol import EndpointStage, FormatConfig, ProtocolDecode, ProtocolFormat, off_loop_only


class StoreConfig(StageConfig):
    store: str | None = None  # the response_store resource (default: the graph's only one)


class StoreFormatConfig(FormatConfig):
    store: str | None = None


STORE_REFERENCES = {"store": Reference("response_store")}


class OpenAIResponsesDecode(ProtocolDecode):
    type_name: ClassVar[str] = "openai.responses.decode"
    description = "validates a Responses body (items, tools, previous_response_id) into a chat request"
    context_type = ResponsesContext
    Config = StoreConfig
    references = STORE_REFERENCES

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", ResponseStore)

    def _previous(self, response_id: str) -> tuple[Message, ...] | None:
        off_loop_only("previous_response_id")  # the store's file is read on a worker thread
        entry = self.store.get(response_id)
        return None if entry is None else entry.conversation

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        request = openai_responses.decode_responses_request(http.body, http.request_id, created, self._previous)
        if self.store.damaged is not None and _stored(request):
            raise self.store.unavailable()  # now, not after generating an answer it cannot keep
        return request


def _stored(request: ChatRequest) -> bool:
    return request.context_as(ResponsesContext).stored


class OpenAIResponsesFormat(ProtocolFormat):
    type_name: ClassVar[str] = "openai.responses.format"
    description = "encodes events as a Responses object or its numbered event chain; stores the result"
    codec = openai_responses.ResponsesCodec
    reads_context = ResponsesContext
    Config = StoreFormatConfig
    references = STORE_REFERENCES

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", ResponseStore)

    async def finished(self, result: FinalResult, body: dict[str, Any]) -> None:
        if _stored(result.request):  # committed to disk before the client has the whole response
            conversation = openai_responses.conversation_after(result)
            await self.store.keep(body["id"], body, conversation)


class OpenAIResponsesRetrieve(EndpointStage):
    type_name: ClassVar[str] = "openai.responses.retrieve"
    description = "GET returns a stored response, DELETE forgets it (route parameter: response_id)"
    Config = StoreConfig
    references = STORE_REFERENCES
    codec = openai_responses.ResponsesCodec

    def setup(self) -> None:
        super().setup()
        self.store = self.links.one("store", ResponseStore)

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        response_id = http.param("response_id")
        if http.method == "DELETE":
            if not await trio.to_thread.run_sync(self.store.delete, response_id):
                raise self._not_found(response_id)
            return {"id": response_id, "object": "response", "deleted": True}
        entry = await trio.to_thread.run_sync(self.store.get, response_id)
        if entry is None:
            raise self._not_found(response_id)
        return entry.body

    @staticmethod
    def _not_found(response_id: str) -> ApiError:
        return ApiError("not_found", f"Response with id '{response_id}' not found (unknown, expired, or "
                        "created with store=false).", param="response_id")
