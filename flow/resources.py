"""Long-lived resources that graphs declare under ``[resources.*]``.

A resource outlives requests: the ``model`` resource owns a loaded model, its
tokenizer and its engine. Stages are handed resources by name when the server
starts; requests only borrow them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import trio
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flow.capabilities import CapabilityStore, family_from_capabilities
from flow.families import Family, builtin_families, resolve_family
from flow.registry import register_resource
from protocols.errors import ApiError
from runtime.device import DeviceThread
from runtime.engine import EngineConfig, Strategy
from runtime.models import LoadedModel, load_model, resolve_model_path

log = logging.getLogger("flow.resources")


class ResourceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(ResourceConfig):
    path: str = Field(description="local directory, Hugging Face repo id, or tiny:PRESET")
    name: str | None = Field(default=None, description="the model id clients use (default: the resource id)")
    aliases: list[str] = Field(default_factory=list, description="other ids that select this model")
    max_batch: int = Field(default=32, ge=1, description="sequences decoding at once")
    prefill_chunk: int = Field(default=512, ge=16, description="prompt tokens prefilled per engine step")
    strategy: Strategy = Field(
        default="decode_first",
        description="engine step order: decode_first (streams first), prefill_first (new requests first), "
                    "balanced (decode first; prefill every other step once the batch is half full)")
    max_queue: int = Field(default=256, ge=1, description="requests waiting for a batch slot beyond which "
                                                          "new ones get 429 with Retry-After")
    default_max_tokens: int = Field(default=2048, ge=1, description="max_tokens when a request gives none")
    family: str = Field(default="auto", description="model family (graphs/families/*.toml), or auto-detect")
    kv_budget_bytes: int | None = Field(
        default=None, ge=1, description="KV cache memory one request may claim (default: half the machine's memory)")

    @field_validator("family")
    @classmethod
    def _known_family(cls, value: str) -> str:
        known = builtin_families()
        if value != "auto" and value not in known:
            raise ValueError(f"unknown family {value!r}; valid: auto, {', '.join(sorted(known))}")
        return value


@register_resource
class ModelResource:
    type_name: ClassVar[str] = "model"
    Config: ClassVar[type[ResourceConfig]] = ModelConfig
    description: ClassVar[str] = "an MLX language model with its tokenizer and generation engine"

    def __init__(self, resource_id: str, config: ModelConfig) -> None:
        self.id = resource_id
        self.config = config
        self.name = config.name or resource_id
        self.loaded: LoadedModel | None = None
        self.family: Family = builtin_families()["default"]

    @property
    def ids(self) -> list[str]:
        return [self.name, *self.config.aliases]

    async def start(self, device: DeviceThread) -> None:
        path: Path = await trio.to_thread.run_sync(resolve_model_path, self.config.path)
        engine_config = EngineConfig(max_batch=self.config.max_batch, prefill_chunk=self.config.prefill_chunk,
                                     strategy=self.config.strategy, max_queue=self.config.max_queue)
        started = time.perf_counter()
        self.loaded = await trio.to_thread.run_sync(load_model, self.name, path, device, engine_config)
        # A probed model is served as the probe showed works; others by family detection.
        probed = CapabilityStore().get(path) if self.config.family == "auto" else None
        self.family = (family_from_capabilities(probed, builtin_families()) if probed is not None else
                       resolve_family(self.config.family, path, f"{self.name} {self.config.path}",
                                      getattr(self.loaded.tokenizer, "chat_template", None)))
        log.info("model %s ready (%.1f s, family %s)%s", self.name, time.perf_counter() - started, self.family.name,
                 " — SMOKE-TEST MODEL: random weights, output is gibberish" if self.loaded.smoke_test else "")

    def close(self) -> None:
        if self.loaded is not None:
            self.loaded.engine.close()

    @property
    def kv_budget_bytes(self) -> int:
        return self.config.kv_budget_bytes or _half_of_memory()

    def require(self) -> LoadedModel:
        if self.loaded is None:
            raise ApiError("overloaded", f"Model {self.name!r} is still loading; retry shortly.", retry_after=2)
        return self.loaded


def _half_of_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2)
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class ModelSet:
    """The models a stage serves, looked up by the id or alias a request names."""

    def __init__(self, models: Iterable[ModelResource]) -> None:
        self._by_id: dict[str, ModelResource] = {}
        for model in models:
            for model_id in model.ids:
                self._by_id.setdefault(model_id, model)

    @classmethod
    def from_resources(cls, resources: Mapping[str, Any]) -> ModelSet:
        return cls(r for r in resources.values() if isinstance(r, ModelResource))

    def lookup(self, model_id: str) -> ModelResource:
        found = self._by_id.get(model_id)
        if found is None:
            raise ApiError(
                "not_found",
                f"The model {model_id!r} does not exist on this server. Available models: "
                f"{', '.join(sorted(self._by_id)) or '(none)'}.",
                param="model",
                code="model_not_found",
            )
        return found
