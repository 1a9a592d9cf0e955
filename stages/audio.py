"""What the audio stages share: the stage that works with one of its audio models (mlx-audio, kind ``audio``),
and the voice listing (``audio.voices``, ``GET /v1/audio/voices``).

The paths themselves: speech to text in :mod:`stages.transcription`, text to speech in :mod:`stages.speech`.
Audio jobs run on the model's audio worker, which shares the device thread with the chat batch
(:mod:`runtime.audio`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import Field

from flow.graph.stage import StageConfig
from flow.resources.model import ModelResource
from protocols import openai_chat, openai_speech
from protocols.errors import ApiError
from protocols.ir import HttpRequest, WireFrame
from stages.model_stage import ModelStage
from stages.protocol import EndpointStage

if TYPE_CHECKING:
    from runtime.audio import LoadedAudio

In = TypeVar("In")
Out = TypeVar("Out")


class AudioModelsConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="model resources served (default: all)")


CAPABILITY_LABELS = {"stt": ("speech-to-text", "transcribe speech"), "tts": ("text-to-speech", "speak")}


class AudioModelStage(ModelStage[In, Out]):
    """A stage that works with one of its audio models, which must have its ``capability``."""

    Config: ClassVar[type[StageConfig]] = AudioModelsConfig
    capability: ClassVar[str]  # "stt" or "tts"

    async def audio_model(self, model_id: str) -> tuple[ModelResource, LoadedAudio]:
        """The audio model a request names, loaded; a 400 naming the models that can serve it if it is of
        another kind or cannot do this."""
        kind, able = CAPABILITY_LABELS[self.capability]
        resource = self.models.lookup(model_id, kind="audio", what=kind, serves=self._may_serve)
        loaded = await resource.ensure_audio()
        if self.capability not in loaded.capabilities:
            can = sorted(m.name for m in self.models.all() if m.audio is not None and self._may_serve(m))
            raise ApiError("invalid_request", f"The model {resource.name!r} is not a {kind} model: it cannot "
                           f"{able}. Models that can: {', '.join(can) or '(none loaded on this server)'}.",
                           param="model", code="wrong_model_kind")
        return resource, loaded

    def _may_serve(self, model: ModelResource) -> bool:
        """Whether an audio model has this stage's capability, or may have it (not loaded yet: not known)."""
        return model.audio is None or self.capability in model.audio.capabilities


class VoicesList(ModelStage[HttpRequest, WireFrame], EndpointStage):
    type_name: ClassVar[str] = "audio.voices"
    Config = AudioModelsConfig
    codec = openai_chat.ChatCodec
    description = "lists the voices of the text-to-speech models (GET /v1/audio/voices, ?model= for one)"

    async def answer(self, http: HttpRequest) -> Any:
        from urllib.parse import parse_qs

        wanted = parse_qs(http.query).get("model", [None])[0]
        chosen = [self.models.lookup(wanted, kind="audio")] if wanted else [
            m for m in self.models.all() if m.kind in ("audio", None)]
        listing: list[tuple[str, tuple[str, ...]]] = []
        for model in chosen:
            loaded = await model.ensure_audio()
            if loaded.tts:
                listing.append((model.name, loaded.accepted_voices))
        return openai_speech.voices_list(listing)
