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

from flow.stage import Outbox
from protocols import openai_chat, rerank
from protocols.ir import HttpRequest, Ranking, RerankRequest
from stages.embeddings import EmbeddingModelStage, embed_ids, tokenize
from stages.protocol import BodyDecode, JsonFormat

SCORING = "cosine similarity of the query's and the document's embeddings"


class RerankDecode(BodyDecode[RerankRequest]):
    type_name: ClassVar[str] = "rerank.decode"
    output_type: ClassVar[Any] = RerankRequest
    description = "validates a Jina/Cohere rerank body (query, documents, top_n, return_documents)"

    def decode(self, http: HttpRequest) -> RerankRequest:
        return rerank.decode_rerank_request(http.body, http.request_id)


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


class RerankFormat(JsonFormat[Ranking]):
    type_name: ClassVar[str] = "rerank.format"
    input_type: ClassVar[Any] = Ranking
    description = "answers results [{index, relevance_score, document?}] best first"
    codec = openai_chat.ChatCodec  # OpenAI's error shape

    def encode(self, item: Ranking) -> dict[str, Any]:
        return rerank.encode_ranking(item)
