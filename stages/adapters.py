"""``adapters.manage``: the LoRA adapters mounted on the graph's models, at run time.

* ``GET /v1/adapters``: ``{object: "list", data: [{id, path, format, rank, scale, size_bytes, mounted_layers,
  digest, model, source, state}]}``;
* ``POST /v1/adapters`` ``{id, path, model?, check_base_model?}``: all or nothing — a directory that is not an
  adapter, a shape that does not fit the model, or another base model named in its config is a 400 and nothing
  is mounted; ``model`` is needed only when the stage serves several text models;
* ``DELETE /v1/adapters/{adapter_id}``: 404 if no model has it; requests already using it finish with it.

Requests then name adapters in their ``adapter`` field, or through a model id the graph maps to adapters
(``adapter_aliases`` on the model resource).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from flow.adapters import AdapterMount, expand_path
from flow.resources import MODEL_REFERENCES, ModelResource, ModelSet
from protocols import openai_chat
from protocols.adapter_spec import check_adapter_id
from protocols.errors import ApiError
from protocols.ir import HttpRequest
from protocols.validation import parse_json_body
from stages.chat import ModelStageConfig
from stages.protocol import EndpointStage


class AdaptersConfig(ModelStageConfig):
    roots: list[str] = Field(
        default_factory=list, description="directories adapters may be mounted from (default: any directory the "
                                          "server can read); a path outside them is a 403")


class MountBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=64)
    path: str = Field(min_length=1, max_length=4096)
    model: str | None = None
    check_base_model: bool = True


class AdaptersManage(EndpointStage):
    type_name: ClassVar[str] = "adapters.manage"
    description = "lists, mounts (POST {id, path}) and unmounts (DELETE /{adapter_id}) LoRA adapters at run time"
    Config = AdaptersConfig
    references = MODEL_REFERENCES
    codec = openai_chat.ChatCodec
    config: AdaptersConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = [m for m in self.links.many("models", ModelResource) if m.kind in ("text", None)]

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        if http.method == "GET":
            data = [entry for model in self.models for entry in model.adapters.describe()]
            return {"object": "list", "data": data}
        if http.method == "DELETE":
            return await self._unmount(http.param("adapter_id"))
        return await self._mount(parse_json_body(MountBody, http.body))

    async def _mount(self, body: MountBody) -> dict[str, Any]:
        try:
            check_adapter_id(body.id)
        except ValueError as exc:
            raise ApiError("invalid_request", f"'id': {exc}.", param="id") from None
        model = self._model(body.model)
        path = self._allowed(expand_path(body.path))
        loaded = await model.ensure_loaded()  # mounted on what is loaded now, and again on every later load
        names = model.served_names(loaded.path, loaded.config)
        adapter = await model.adapters.mount(loaded, AdapterMount(body.id, path, body.check_base_model), names)
        return {**adapter.describe(), "object": "adapter", "model": model.name, "source": "api", "state": "mounted"}

    async def _unmount(self, adapter_id: str) -> dict[str, Any]:
        owner = next((m for m in self.models if adapter_id in m.adapters.mounts), None)
        if owner is None:
            mounted = sorted(i for m in self.models for i in m.adapters.mounts)
            raise ApiError("not_found", f"No adapter {adapter_id!r} is mounted. Mounted: "
                           f"{', '.join(mounted) or '(none)'}.", param="adapter_id", code="adapter_not_found")
        in_use = await owner.adapters.unmount(owner.loaded, adapter_id)
        return {"id": adapter_id, "object": "adapter", "model": owner.name, "deleted": True,
                "in_use_by": in_use}  # sequences that finish with it; it leaves memory after them

    def _model(self, model_id: str | None) -> ModelResource:
        if model_id is not None:
            return ModelSet(self.models).lookup(model_id)
        if len(self.models) == 1:
            return self.models[0]
        raise ApiError("invalid_request", "'model' is required: this server has several text models "
                       f"({', '.join(m.name for m in self.models) or 'none'}).", param="model")

    def _allowed(self, path: Path) -> Path:
        if not self.config.roots:
            return path
        real = Path(os.path.realpath(path))
        roots = [Path(os.path.realpath(expand_path(r))) for r in self.config.roots]
        if not any(real == root or root in real.parents for root in roots):
            raise ApiError("permission", f"Adapters may only be mounted from {', '.join(map(str, roots))}; "
                           f"{path} is outside them.", param="path")
        return path
