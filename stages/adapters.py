"""``adapters.manage``: the LoRA adapters mounted on the graph's models, at run time.

* ``GET /v1/adapters``: ``{adapters: [{id, path, rank, scale, size_bytes, mounted_layers, format, digest, model,
  source, state}]}`` (the reference API's shape), the same list as ``data`` beside ``object: "list"`` (flow's own
  list shape, which its earlier clients read);
* ``POST /v1/adapters`` ``{id, path, model?, check_base_model?}``: all or nothing — a shape that does not fit the
  model, or another base model named in its config is a 400 and nothing is mounted; ``model`` is needed only when
  the stage serves several text models. The path is a client's: no ``$VARS`` expand (a leading ``~`` does: the
  server's user's home), and it must be an adapter directory under the adapter roots (the hub cache and
  ``<data dir>/adapters``, widened by ``roots``); anything else is one and the same 400, whatever the reason, so
  the answer does not tell which paths exist (:mod:`flow.resources.adapters`);
* ``DELETE /v1/adapters/{adapter_id}``: 404 if no model has it; requests already using it finish with it.

Requests then name adapters in their ``adapter`` field, or through a model id the graph maps to adapters
(``adapter_aliases`` on the model resource).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import trio
from pydantic import BaseModel, ConfigDict, Field

from flow.resources.adapters import (
    AdapterMount,
    default_roots,
    expand_path,
    find_request_adapter,
    not_an_adapter,
    request_path,
)
from flow.resources.model import MODEL_REFERENCES, ModelResource, ModelSet
from protocols import openai_chat
from protocols.adapter_spec import check_adapter_id
from protocols.errors import ApiError
from protocols.ir import HttpRequest
from protocols.validation import parse_json_body
from stages.chat import ModelStageConfig
from stages.protocol import EndpointStage


class AdaptersConfig(ModelStageConfig):
    roots: list[str] = Field(
        default_factory=list, description="more directories clients may mount adapters from (~ and $VARS expand), "
                                          "besides the Hugging Face hub cache and <flow data dir>/adapters")
    default_roots: bool = Field(
        default=True, description="clients may mount adapters from the hub cache and <flow data dir>/adapters; "
                                  "false: from roots only (none given: clients cannot mount adapters)")


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

    def setup(self) -> None:
        super().setup()
        self.models = [m for m in self.links.many("models", ModelResource) if m.kind in ("text", None)]

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        if http.method == "GET":
            data = [entry for model in self.models for entry in model.adapters.describe()]
            return {"adapters": data, "object": "list", "data": data}
        if http.method == "DELETE":
            return await self._unmount(http.param("adapter_id"))
        return await self._mount(parse_json_body(MountBody, http.body))

    async def _mount(self, body: MountBody) -> dict[str, Any]:
        try:
            check_adapter_id(body.id)
        except ValueError as exc:
            raise ApiError("invalid_request", f"'id': {exc}.", param="id") from None
        model = self._model(body.model)
        if model.config.distributed is not None:  # said before the path is looked at: it cannot be mounted anyway
            raise ApiError("invalid_request", f"The model {model.name!r} is served across processes "
                           "(distributed); LoRA adapters are not supported there yet.", param="model")
        path = await self._allowed(body.path)
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

    def roots(self) -> list[Path]:
        """Where clients may mount adapters from now (the hub cache follows the environment, as ``/library``)."""
        configured = [expand_path(root) for root in self.config.roots]  # the operator's own: $VARS may expand
        return [*default_roots(), *configured] if self.config.default_roots else configured

    async def _allowed(self, text: str) -> Path:
        """The adapter directory a client's path names, resolved, or the one refusal (see :mod:`flow.resources.adapters`)."""
        roots = self.roots()
        found = await trio.to_thread.run_sync(find_request_adapter, request_path(text), roots)
        if found is None:
            raise not_an_adapter(text, roots)
        return found
