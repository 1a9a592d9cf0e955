"""The rerank path: ``rerank.decode`` → ``rerank`` → ``rerank.format`` (Jina / Cohere shape).

``rerank`` scores each document with the model the request names, in the same shared passes as
``/v1/embeddings`` (:mod:`runtime.embeddings`): a **cross-encoder** (a sequence-classification head, as
mlx-embeddings loads ModernBERT rerankers) reads each query–document pair and gives its relevance in [0, 1];
an **embedding model** gives the cosine similarity of the document's vector and the query's (unit vectors, so
their dot product, in [-1, 1]). The response says which (``meta.scoring``).
"""

from __future__ import annotations

from functools import partial
from typing import Any, ClassVar

import numpy as np
import trio

from flow.graph.stage import Outbox
from protocols import openai_chat, rerank
from protocols.ir import HttpRequest, Ranking, RerankRequest
from stages.embeddings import EmbeddingModelStage, embed_ids, tokenize, tokenize_pairs, tokenizing
from stages.protocol import BodyDecode, JsonFormat

COSINE = "cosine similarity of the query's and the document's embeddings"
CROSS_ENCODER = "cross-encoder: a sequence-classification model's relevance for each query–document pair"


class RerankDecode(BodyDecode[RerankRequest]):
    type_name: ClassVar[str] = "rerank.decode"
    description = "validates a Jina/Cohere rerank body (query, documents, top_n, return_documents)"

    def decode(self, http: HttpRequest) -> RerankRequest:
        return rerank.decode_rerank_request(http.body, http.request_id)


class Rerank(EmbeddingModelStage[RerankRequest, Ranking]):
    type_name: ClassVar[str] = "rerank"
    description = "scores documents against a query: a cross-encoder per pair, or embedding cosine similarity"

    async def run(self, inbox: trio.MemoryReceiveChannel[RerankRequest], outbox: Outbox[Ranking]) -> None:
        async for request in inbox:
            resource, loaded = await self.embedder(request.model)
            if loaded.profile.task == "score":
                ids = await tokenizing((request.query, *request.documents), partial(
                    tokenize_pairs, loaded, request.query, request.documents, self.truncate))
                scores, scoring = (await embed_ids(loaded, ids))[:, 0], CROSS_ENCODER
            else:
                query = await tokenizing((request.query,), partial(
                    tokenize, loaded, (request.query,), self.truncate, "query"))
                ids = [*query, *await tokenizing(request.documents, partial(
                    tokenize, loaded, request.documents, self.truncate, "documents[{}]"))]
                vectors = await embed_ids(loaded, ids)
                scores, scoring = np.clip(vectors[1:] @ vectors[0], -1.0, 1.0), COSINE
            await outbox.send(Ranking(request, resource.name, tuple(float(x) for x in scores), scoring,
                                      sum(len(row) for row in ids)))


class RerankFormat(JsonFormat[Ranking]):
    type_name: ClassVar[str] = "rerank.format"
    description = "answers results [{index, relevance_score, document?}] best first"
    codec = openai_chat.ChatCodec  # OpenAI's error shape

    def encode(self, item: Ranking) -> dict[str, Any]:
        return rerank.encode_ranking(item)
