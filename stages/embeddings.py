"""The embeddings path: ``openai.embeddings.decode`` → ``embed`` → ``openai.embeddings.format``.

``embed`` tokenizes each input with the model's own tokenizer (special tokens as the model was trained
with; token-id inputs get the same special tokens around them, so they embed like the text they encode),
checks lengths and token ids, and hands the inputs to the model's embedder on the device thread, where
inputs of concurrent requests share forward passes (:mod:`runtime.embeddings`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np
import trio
from pydantic import Field

from flow.graph.stage import Outbox, StageConfig
from flow.resources.model import ModelResource
from protocols import openai_chat, openai_embeddings
from protocols.errors import ApiError
from protocols.ir import EmbeddingRequest, Embeddings, HttpRequest
from runtime.device import wait_future
from stages.model_stage import ModelStage
from stages.protocol import BodyDecode, JsonFormat

if TYPE_CHECKING:
    from runtime.embeddings import LoadedEmbedder

In = TypeVar("In")
Out = TypeVar("Out")


class EmbeddingsDecode(BodyDecode[EmbeddingRequest]):
    type_name: ClassVar[str] = "openai.embeddings.decode"
    description = "validates an OpenAI embeddings body (text, texts, token ids) into an embeddings request"

    def decode(self, http: HttpRequest) -> EmbeddingRequest:
        return openai_embeddings.decode_embeddings_request(http.body, http.request_id)


class EmbedConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="model resources served (default: all)")
    truncate: bool = Field(default=False, description="cut inputs longer than the model reads, instead of a 400")


class EmbeddingModelStage(ModelStage[In, Out]):
    """A stage that computes with one of its embedding models (``embed``, ``rerank``)."""

    Config = EmbedConfig

    def setup(self) -> None:
        super().setup()
        self.truncate = bool(getattr(self.config, "truncate", False))

    async def embedder(self, model: str) -> tuple[ModelResource, LoadedEmbedder]:
        """The embedding model a request names, loaded (400 if it names a model of another kind)."""
        resource = self.models.lookup(model, kind="embeddings")
        return resource, await resource.ensure_embedder()


class Embed(EmbeddingModelStage[EmbeddingRequest, Embeddings]):
    type_name: ClassVar[str] = "embed"
    description = "embeds each input with an embedding model; concurrent requests share forward passes"

    async def run(self, inbox: trio.MemoryReceiveChannel[EmbeddingRequest], outbox: Outbox[Embeddings]) -> None:
        async for request in inbox:
            resource, loaded = await self.embedder(request.model)
            if loaded.profile.task != "embed":
                raise ApiError("invalid_request", f"The model {resource.name!r} is a cross-encoder: it scores "
                               "query–document pairs (POST /v1/rerank) and gives no embeddings.", param="model",
                               code="wrong_model_kind")
            dims = served_dimensions(resource.name, loaded, request.dimensions)
            ids = await tokenizing(request.inputs, partial(tokenize, loaded, request.inputs, self.truncate))
            vectors = shorten(await embed_ids(loaded, ids), dims)
            rows = tuple(np.ascontiguousarray(v, dtype="<f4").tobytes() for v in vectors)
            await outbox.send(Embeddings(request, resource.name, rows, dims, sum(len(i) for i in ids)))


def served_dimensions(model: str, loaded: LoadedEmbedder, requested: int | None) -> int:
    """The vector size a request gets: the model's own, or a Matryoshka size it was trained for (else a 400
    naming the accepted values)."""
    native, matryoshka = loaded.dims, loaded.profile.matryoshka
    if requested is None or matryoshka.accepts(requested, native):
        return requested or native
    accepted = (matryoshka.describe(native) if matryoshka.declared
                else f"{native} (it was not trained to be shortened)")
    raise ApiError("invalid_request", f"dimensions = {requested} is not available for {model!r}, which gives "
                   f"{native}-dimension vectors; send {accepted}, or leave dimensions out.", param="dimensions")


def shorten(vectors: np.ndarray, dims: int) -> np.ndarray:
    """Matryoshka: the first ``dims`` components, renormalised to unit length."""
    if dims == vectors.shape[1]:
        return vectors
    cut: np.ndarray = vectors[:, :dims]
    return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)  # type: ignore[no-any-return]


# Text up to this many characters is tokenized on the event loop (well under a millisecond); more goes to a worker
# thread. A thread's round trip costs more than a sentence's tokenizing, and under load its wake-up waits for a
# core the forward passes hold: 64 one-sentence clients reached the device in fewer, smaller passes.
INLINE_TOKENIZE_CHARS = 2048


async def tokenizing(texts: Sequence[str | tuple[int, ...]], work: Callable[[], list[list[int]]]) -> list[list[int]]:
    """``work()``, which tokenizes ``texts``: on the event loop when they are short, else on a worker thread."""
    if sum(len(text) for text in texts) <= INLINE_TOKENIZE_CHARS:
        return work()
    return await trio.to_thread.run_sync(work)


def tokenize(loaded: LoadedEmbedder, inputs: Sequence[str | tuple[int, ...]], truncate: bool,
             label: str = "input[{}]") -> list[list[int]]:
    """Every input as the token ids the model reads, special tokens included (tokenizing long texts: run it on
    a worker thread); 400 for out-of-vocabulary ids and (unless ``truncate``) inputs longer than the model's
    maximum, naming input ``i`` as ``label.format(i)``."""
    tokenizer, limit = loaded.tokenizer, loaded.max_length
    texts = [(i, item) for i, item in enumerate(inputs) if isinstance(item, str)]
    out: list[list[int]] = [[] for _ in inputs]
    if texts:
        encoded = tokenizer([text for _, text in texts], add_special_tokens=True,
                            truncation=truncate, max_length=limit if truncate else None)["input_ids"]
        for (i, _), ids in zip(texts, encoded):
            out[i] = list(ids)
    head, tail = loaded.special_head, loaded.special_tail
    specials = len(head) + len(tail)
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            continue
        bad = next((t for t in item if not 0 <= t < loaded.vocab_size), None)
        if bad is not None:
            raise ApiError("invalid_request", f"'{label.format(i)}' has token id {bad}, outside this model's "
                           f"vocabulary (0 to {loaded.vocab_size - 1}).", param=label.format(i))
        body = list(item)[: limit - specials] if truncate else list(item)
        out[i] = [*head, *body, *tail]
    return checked_lengths(out, limit, label)


def tokenize_pairs(loaded: LoadedEmbedder, query: str, documents: Sequence[str], truncate: bool) -> list[list[int]]:
    """Query–document pairs as a cross-encoder reads them (``[CLS] query [SEP] document [SEP]``); with
    ``truncate``, long documents are cut, never the query."""
    limit = loaded.max_length
    encoded = loaded.tokenizer([query] * len(documents), list(documents), add_special_tokens=True,
                               truncation="only_second" if truncate else False,
                               max_length=limit if truncate else None)["input_ids"]
    return checked_lengths([list(ids) for ids in encoded], limit, "documents[{}]")


def checked_lengths(ids: list[list[int]], limit: int, label: str) -> list[list[int]]:
    """``ids``, unless one is longer than the model reads: a 400 naming it."""
    for i, row in enumerate(ids):
        if len(row) > limit:
            raise ApiError("invalid_request", f"'{label.format(i)}' is {len(row)} tokens long; this model reads "
                           f"at most {limit} (the stage's truncate = true cuts longer inputs instead).",
                           param=label.format(i), code="context_length_exceeded")
    return ids


async def embed_ids(loaded: LoadedEmbedder, ids: list[list[int]]) -> np.ndarray:
    """The inputs' vectors, computed on the device thread in passes shared with other requests."""
    future = loaded.embedder.submit(ids)
    try:
        return await wait_future(future)
    except trio.Cancelled:
        future.cancel()  # the client left: its inputs leave the queue
        raise


class EmbeddingsFormat(JsonFormat[Embeddings]):
    type_name: ClassVar[str] = "openai.embeddings.format"
    description = "answers an OpenAI embeddings list (float arrays or base64 float32)"
    codec = openai_chat.ChatCodec  # OpenAI's error shape

    def encode(self, item: Embeddings) -> dict[str, Any]:
        return openai_embeddings.encode_embeddings(item)
