"""``models.list``: ``GET /v1/models`` and ``GET /v1/models/{model_id}`` as a graph stage.

One body both SDKs read: OpenAI's ``{object: "list", data: [{id, object, created, owned_by}]}`` and
Anthropic's ``{data: [{type, id, display_name, created_at}], has_more, first_id, last_id}`` (each ignores
the other's fields). Aliases are listed as models of their own with ``alias_of``; glob aliases (``claude-*``)
are not listed, but an id they match is found. Being a stage, the
listing is on the graph's routes: a graph may drop it, move it, or list only some models (``models``).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from pydantic import Field

from flow.graph.stage import StageConfig
from flow.resources.model import MODEL_REFERENCES, ModelResource, ModelSet
from protocols import openai_chat
from protocols.errors import ApiError
from protocols.ir import HttpRequest
from stages.protocol import EndpointStage


class ModelsConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="model resources listed (default: all)")


def model_entries(model: ModelResource) -> list[dict[str, Any]]:
    """The listing's entries for one model resource: its name, then each alias."""
    created = int(model.created)
    created_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    entries = []
    for model_id in model.ids:
        entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created, "owned_by": "flow",
                                 "type": "model", "display_name": model_id, "created_at": created_at,
                                 "lifecycle": "active"}
        if model_id != model.name:
            entry["alias_of"] = model.name
        if model_id in model.config.adapter_aliases:
            entry["adapter"] = model.config.adapter_aliases[model_id]  # this id means the model with these
        loaded = model.loaded or model.embedding or model.audio
        if model.kind is not None:
            entry["kind"] = model.kind
        if model.embedding is not None:
            entry["max_input_tokens"] = model.embedding.max_length
            if model.embedding.profile.task == "score":
                entry["task"] = "rerank"  # a cross-encoder: scores, no vectors
            else:
                entry["dimensions"] = model.embedding.dims
        elif model.loaded is not None:
            entry["max_input_tokens"] = model.loaded.context_length
        elif model.audio is not None:
            entry["capabilities"] = model.audio.capabilities
            if model.audio.tts:
                entry["voices"] = list(model.audio.accepted_voices)
        if loaded is not None:
            if loaded.smoke_test:
                entry["description"] = "SMOKE-TEST MODEL: random weights, output is gibberish"
                entry["display_name"] = f"{model_id} (smoke-test model)"
        entries.append(entry)
    return entries


class ModelsList(EndpointStage):
    type_name: ClassVar[str] = "models.list"
    description = ("the served models in a shape both SDKs read; with a {model_id} route parameter, one model "
                   "(404 model_not_found otherwise)")
    Config = ModelsConfig
    references = MODEL_REFERENCES
    codec = openai_chat.ChatCodec

    def setup(self) -> None:
        super().setup()
        self.models = self.links.many("models", ModelResource)

    def listing(self) -> list[dict[str, Any]]:
        return [entry for model in self.models for entry in model_entries(model)]

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        data = self.listing()
        model_id = dict(http.params).get("model_id")
        if model_id is None:
            return {"object": "list", "data": data, "has_more": False,
                    "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None}
        found = next((entry for entry in data if entry["id"] == model_id), None)
        if found is None and (model := ModelSet(self.models).find(model_id)) is not None:
            found = {**model_entries(model)[0], "id": model_id, "display_name": model_id, "alias_of": model.name}
        if found is None:
            raise ApiError("not_found", f"The model {model_id!r} does not exist on this server. Available "
                           f"models: {', '.join(e['id'] for e in data) or '(none)'}.", param="model",
                           code="model_not_found")
        return found
