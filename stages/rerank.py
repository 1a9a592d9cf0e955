"""The rerank path: ``rerank.decode`` → ``rerank`` → ``rerank.format`` (Jina / Cohere shape).

``rerank`` scores each document by the cosine similarity of its embedding and the query's, computed by an
embedding model in the same shared passes as ``/v1/embeddings`` (:mod:`runtime.embeddings`); the vectors are
L2-normalised, so the score is their dot product, in [-1, 1]. The response says so (``meta.scoring``).
Cross-encoder rerankers (a sequence-classification head scoring each query-document pair) are a different
model shape and are not served by this stage.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import trio

from flow.stage import EntryStage, ExitStage, Outbox
from protocols import openai_chat, rerank
from protocols.ir import HttpRequest, Ranking, RerankRequest, WireFrame
from stages.embeddings import EmbeddingModelStage, embed_ids, tokenize
from stages.protocol import json_frame

SCORING = "cosine similarity of the query's and the document's embeddings"


class RerankDecode(EntryStage[HttpRequest, RerankRequest]):
    type_name: ClassVar[str] = "rerank.decode"
    input_type: ClassVar[Any] = HttpRequest
    output_type: ClassVar[Any] = RerankRequest
    description = "validates a Jina/Cohere rerank body (query, documents, top_n, return_documents)"

    async def run(self, inbox: trio.MemoryReceiveChannel[HttpRequest], outbox: Outbox[RerankRequest]) -> None:
        async for http in inbox:
            await outbox.send(rerank.decode_rerank_request(http.body, http.request_id))


class Rerank(EmbeddingModelStage[RerankRequest, Ranking]):
    type_name: ClassVar[str] = "rerank"
    input_type: ClassVar[Any] = RerankRequest
    output_type: ClassVar[Any] = Ranking
    description = "scores documents against a query by embedding cosine similarity (an embedding model)"

    async def run(self, inbox: trio.MemoryReceiveChannel[RerankRequest], outbox: Outbox[Ranking]) -> None:
        async for request in inbox:
            resource, loaded = await self.embedder(request.model)
            query = await trio.to_thread.run_sync(tokenize, loaded, (request.query,), self.truncate, "query")
            documents = await trio.to_thread.run_sync(tokenize, loaded, request.documents, self.truncate,
                                                      "documents[{}]")
            vectors = await embed_ids(loaded, [*query, *documents])
            scores = np.clip(vectors[1:] @ vectors[0], -1.0, 1.0)
            await outbox.send(Ranking(request, resource.name, tuple(float(x) for x in scores), SCORING,
                                      sum(len(ids) for ids in (*query, *documents))))


class RerankFormat(ExitStage[Ranking, WireFrame]):
    type_name: ClassVar[str] = "rerank.format"
    input_type: ClassVar[Any] = Ranking
    output_type: ClassVar[Any] = WireFrame
    description = "answers results [{index, relevance_score, document?}] best first"
    codec = openai_chat.ChatCodec  # OpenAI's error shape

    async def run(self, inbox: trio.MemoryReceiveChannel[Ranking], outbox: Outbox[WireFrame]) -> None:
        async for ranking in inbox:
            await outbox.send(json_frame(rerank.encode_ranking(ranking)))
