"""Ollama's native API as graph stages: the ``/api/chat`` and ``/api/generate`` entries and their exit (on the
shared inference path), ``/api/embed`` around the ``embed`` stage, and the model endpoints (``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/version``) that Ollama clients ask before anything else."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from flow.catalog.families import template_text
from flow.resources.model import MODEL_REFERENCES, ModelResource, ModelSet
from protocols import ollama
from protocols.errors import ApiError
from protocols.ir import ChatRequest, EmbeddingRequest, Embeddings, HttpRequest
from protocols.validation import parse_json_body
from stages.chat import ModelStageConfig
from stages.protocol import BodyDecode, EndpointStage, JsonFormat, ProtocolDecode, ProtocolFormat


class OllamaChatDecode(ProtocolDecode):
    type_name: ClassVar[str] = "ollama.chat.decode"
    description = "validates an Ollama /api/chat body (options, format, tools, think) into a chat request"
    context_type = ollama.OllamaContext

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return ollama.decode_chat_request(http.body, http.request_id, created)


class OllamaGenerateDecode(ProtocolDecode):
    type_name: ClassVar[str] = "ollama.generate.decode"
    description = "validates an Ollama /api/generate body (prompt, system, raw) into a chat request"
    context_type = ollama.OllamaContext

    def decode(self, http: HttpRequest, created: int) -> ChatRequest:
        return ollama.decode_generate_request(http.body, http.request_id, created)


class OllamaFormat(ProtocolFormat):
    type_name: ClassVar[str] = "ollama.format"
    description = "encodes events as Ollama NDJSON lines (message or response pieces, then done with counts)"
    codec = ollama.OllamaCodec
    reads_context = ollama.OllamaContext


class OllamaEmbedDecode(BodyDecode[EmbeddingRequest]):
    type_name: ClassVar[str] = "ollama.embed.decode"
    description = "validates an Ollama /api/embed body (input, dimensions) into an embeddings request"

    def decode(self, http: HttpRequest) -> EmbeddingRequest:
        return ollama.decode_embed_request(http.body, http.request_id)


class OllamaEmbedFormat(JsonFormat[Embeddings]):
    type_name: ClassVar[str] = "ollama.embed.format"
    description = "answers Ollama's {model, embeddings} body"
    codec = ollama.OllamaCodec

    def encode(self, item: Embeddings) -> dict[str, Any]:
        return ollama.encode_embed(item)


class OllamaModelsConfig(ModelStageConfig):
    version: str = Field(default="0.13.5", description="the Ollama version /api/version reports: clients gate "
                                                       "features on it (codex --oss needs 0.13.4 for the Responses "
                                                       "API, which this server has)")


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)


class OllamaModels(EndpointStage):
    type_name: ClassVar[str] = "ollama.models"
    description = "Ollama's model endpoints: GET /api/tags, POST /api/show, GET /api/ps, GET /api/version"
    Config = OllamaModelsConfig
    references = MODEL_REFERENCES
    codec = ollama.OllamaCodec
    config: OllamaModelsConfig

    def setup(self) -> None:
        super().setup()
        self.models = self.links.many("models", ModelResource)

    async def answer(self, http: HttpRequest) -> dict[str, Any]:
        endpoint = http.path.rstrip("/").rsplit("/", 1)[-1]
        if endpoint == "version":
            return {"version": self.config.version}
        if endpoint == "tags":
            return {"models": [self._entry(model, model_id) for model in self.models for model_id in model.ids]}
        if endpoint == "ps":
            return {"models": [{**self._entry(model, model.name), "expires_at": "2318-01-01T00:00:00Z",
                                "size_vram": model.weight_bytes} for model in self.models if model.ready]}
        if endpoint == "show":
            model_id = parse_json_body(ShowBody, http.body).model
            model = ModelSet(self.models).find(model_id)
            if model is None:
                raise ApiError("not_found", f"model '{model_id}' not found", param="model")
            return self._show(model)
        raise ApiError("not_found", f"{http.path} is not an Ollama endpoint this stage serves.")

    @staticmethod
    def _directory(model: ModelResource) -> Path | None:
        if model.loaded is not None:
            return model.loaded.path
        if model.embedding is not None:
            return model.embedding.path
        local = Path(os.path.expandvars(model.source)).expanduser()
        return local if local.is_dir() else None

    def _entry(self, model: ModelResource, model_id: str) -> dict[str, Any]:
        directory = self._directory(model)
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) if directory else 0
        modified = max((f.stat().st_mtime for f in directory.glob("*.safetensors")), default=model.created) \
            if directory else model.created
        return {"name": model_id, "model": model_id,
                "modified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(modified)), "size": size,
                "digest": hashlib.sha256(f"{model.source}:{size}".encode()).hexdigest(),
                "details": _details(_config(directory), size)}

    def _show(self, model: ModelResource) -> dict[str, Any]:
        directory = self._directory(model)
        config = _config(directory)
        size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) if directory else 0
        details = _details(config, size)
        if model.kind == "embeddings":
            capabilities = ["embedding"]
        else:
            capabilities = ["completion"]
            if model.family.tools.parser not in ("", "none"):
                capabilities.append("tools")
            if model.family.reasoning.parser not in ("", "null"):
                capabilities.append("thinking")
        template = template_text(getattr(model.loaded.tokenizer, "chat_template", None)) if model.loaded else None
        arch = details["family"]
        info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": _parameters(config, size)}
        context = config.get("max_position_embeddings") or config.get("text_config", {}).get("max_position_embeddings")
        if context:
            info[f"{arch}.context_length"] = context
        return {"modelfile": "", "parameters": "", "template": template or "", "details": details,
                "model_info": info, "capabilities": capabilities}


def _config(directory: Path | None) -> dict[str, Any]:
    try:
        loaded = json.loads((directory / "config.json").read_text()) if directory else {}
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _bytes_per_parameter(config: dict[str, Any]) -> tuple[float, str]:
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    bits = quantization.get("bits") if isinstance(quantization, dict) else None
    if isinstance(bits, int):
        return bits / 8 + 0.0625, f"Q{bits}"  # packed weights and their scales and biases
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float32": (4.0, "F32"), "float16": (2.0, "F16")}.get(dtype, (2.0, "BF16"))


def _parameters(config: dict[str, Any], size: int) -> int:
    return int(size / _bytes_per_parameter(config)[0])


def _details(config: dict[str, Any], size: int) -> dict[str, Any]:
    arch = str(config.get("model_type") or "unknown")
    count = _parameters(config, size)
    shown = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return {"parent_model": "", "format": "safetensors", "family": arch, "families": [arch],
            "parameter_size": shown, "quantization_level": _bytes_per_parameter(config)[1]}
