"""Rerank (``POST /v1/rerank``, ``/rerank``, ``/v2/rerank``): the Jina / Cohere request and response shape.

``query``, ``documents`` as strings or ``{"text": ...}`` objects, ``top_n``, ``return_documents``; the answer
lists ``results: [{index, relevance_score, document?}]`` best first, with ``usage`` and how it was scored
(``meta.scoring``). Errors take the OpenAI error shape, as vLLM's and other local servers' rerank routes do.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr

from protocols.errors import ApiError
from protocols.ir import Ranking, RerankRequest
from protocols.openai_embeddings import MAX_INPUTS
from protocols.validation import parse_json_body


class _Document(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: StrictStr


class RerankBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # Cohere's and Jina's other fields are tolerated

    model: StrictStr
    query: StrictStr
    documents: list[StrictStr | _Document]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


def decode_rerank_request(body: bytes, request_id: str) -> RerankRequest:
    parsed = parse_json_body(RerankBody, body)
    documents = tuple(d if isinstance(d, str) else d.text for d in parsed.documents)
    if not documents:
        raise ApiError("invalid_request", "'documents' must not be empty.", param="documents")
    if len(documents) >= MAX_INPUTS:
        raise ApiError("invalid_request", f"'documents' has {len(documents)} items; at most {MAX_INPUTS - 1}.",
                       param="documents")
    if not parsed.query:
        raise ApiError("invalid_request", "'query' must not be empty.", param="query")
    for i, document in enumerate(documents):
        if not document:
            raise ApiError("invalid_request", f"'documents[{i}]' is empty.", param=f"documents[{i}]")
    return RerankRequest(model=parsed.model, query=parsed.query, documents=documents, top_n=parsed.top_n,
                         return_documents=parsed.return_documents, request_id=request_id)


def encode_ranking(ranking: Ranking) -> dict[str, Any]:
    request = ranking.request
    order = sorted(range(len(ranking.scores)), key=lambda i: (-ranking.scores[i], i))[: request.top_n]
    results = []
    for index in order:
        result: dict[str, Any] = {"index": index, "relevance_score": ranking.scores[index]}
        if request.return_documents:
            result["document"] = {"text": request.documents[index]}
        results.append(result)
    return {"id": f"rerank-{request.request_id}", "model": ranking.model, "results": results,
            "usage": {"prompt_tokens": ranking.prompt_tokens, "total_tokens": ranking.prompt_tokens},
            "meta": {"scoring": ranking.scoring}}
