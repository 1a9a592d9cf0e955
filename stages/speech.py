"""Text to speech: ``openai.audio.speech.decode`` → ``synthesize`` → ``openai.audio.speech.format``.

``synthesize`` splits the input at sentence boundaries and speaks the sentences in one job of the model's
audio worker — or, for a model that batches requests, in its shared speech batch (runtime/speech_batch.py) —
handing each sentence's samples on as a :class:`SpeechChunk` as soon as it is synthesized; the
format stage encodes them into the requested container as they come (one header, then samples), so the first
audio leaves before the rest of the input is spoken.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import trio

from flow.graph.stage import ExitStage, Outbox
from flow.resources.model import ModelResource
from protocols import openai_chat, openai_speech
from protocols.audio_codecs import AudioEncoder
from protocols.errors import ApiError
from protocols.ir import HttpRequest, SpeechChunk, SpeechDone, SpeechEvent, SpeechRequest, WireFrame
from protocols.sse import data_frame
from stages.audio import AudioModelStage
from stages.protocol import SSE_HEADERS, BodyDecode

if TYPE_CHECKING:
    import numpy as np

    from runtime.audio import LoadedAudio, SpeechOptions


class SpeechDecode(BodyDecode[SpeechRequest]):
    type_name: ClassVar[str] = "openai.audio.speech.decode"
    description = "validates an OpenAI speech body (input, voice, instructions, speed, formats)"

    def decode(self, http: HttpRequest) -> SpeechRequest:
        return openai_speech.decode_speech_request(http.body, http.request_id)


class Synthesize(AudioModelStage[SpeechRequest, SpeechEvent]):
    type_name: ClassVar[str] = "synthesize"
    capability = "tts"
    description = ("speaks text with a text-to-speech model (mlx-audio) sentence by sentence, each sentence's "
                   "audio handed on as soon as it is synthesized; concurrent requests share passes where the model "
                   "batches them; shares the device thread fairly with chat")

    async def run(self, inbox: trio.MemoryReceiveChannel[SpeechRequest], outbox: Outbox[SpeechEvent]) -> None:
        from runtime.audio import speak

        async for request in inbox:
            resource, loaded = await self.audio_model(request.model)
            options = speech_options(resource, loaded, request)
            pieces = openai_speech.sentences(request.input)

            async def deliver(samples: np.ndarray) -> None:
                chunk = samples.astype("<f4").tobytes()
                await outbox.send(SpeechChunk(request, resource.name, loaded.sample_rate, chunk))

            total = await speak(loaded, pieces, options, deliver)
            await outbox.send(SpeechDone(request, resource.name, loaded.sample_rate, total, len(request.input)))

def speech_options(resource: ModelResource, loaded: LoadedAudio, request: SpeechRequest) -> SpeechOptions:
    """The request's options for this model, or a 400 saying what it accepts."""
    from runtime.audio import SpeechOptions, speech_parameters

    voices = loaded.accepted_voices
    if request.voice not in voices:
        raise ApiError("invalid_request", f"The model {resource.name!r} has no voice {request.voice!r}; its voices: "
                       f"{', '.join(voices)} (GET /v1/audio/voices lists them).", param="voice",
                       code="unknown_voice")
    accepted = speech_parameters(loaded.model)
    if request.speed != 1.0 and "speed" not in accepted:
        raise ApiError("invalid_request", f"The model {resource.name!r} speaks at one speed; send speed = 1.0 or "
                       "leave it out.", param="speed")
    if request.instructions and "instruct" not in accepted:
        raise ApiError("invalid_request", f"The model {resource.name!r} takes no voice instructions; leave "
                       "'instructions' out.", param="instructions")
    return SpeechOptions(voice=request.voice if loaded.voices else None, speed=request.speed,
                         instructions=request.instructions, max_tokens=resource.config.speech_max_tokens)


class SpeechFormat(ExitStage[SpeechEvent, WireFrame]):
    type_name: ClassVar[str] = "openai.audio.speech.format"
    codec = openai_chat.ChatCodec  # OpenAI's error shape
    description = ("streams speech as the requested file (mp3, opus, aac, flac, wav, pcm: one header, then "
                   "samples) or as SSE speech.audio.delta / speech.audio.done events")

    async def run(self, inbox: trio.MemoryReceiveChannel[SpeechEvent], outbox: Outbox[WireFrame]) -> None:
        import numpy as np

        encoder: AudioEncoder | None = None
        sse = False
        async for event in inbox:
            if encoder is None:
                encoder = AudioEncoder(event.request.response_format, event.sample_rate)
                sse = event.request.stream_format == "sse"
                headers = SSE_HEADERS if sse else (("content-type", encoder.content_type),
                                                   ("x-sample-rate", str(encoder.rate)))
                await outbox.send(WireFrame(b"", headers=headers, streaming=True))
            if isinstance(event, SpeechChunk):
                data = await trio.to_thread.run_sync(encoder.encode, np.frombuffer(event.samples, dtype="<f4"))
            else:
                data = await trio.to_thread.run_sync(encoder.finish)
            if data:
                await outbox.send(WireFrame(data_frame(openai_speech.delta_event(data)) if sse else data))
            if isinstance(event, SpeechDone) and sse:
                await outbox.send(WireFrame(data_frame(openai_speech.done_event(event))))
