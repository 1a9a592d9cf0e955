"""The audio paths of the OpenAI audio API.

Speech to text: ``openai.audio.transcriptions.decode`` / ``openai.audio.translations.decode`` →
``transcribe`` → ``openai.audio.transcriptions.format``. Text to speech: ``openai.audio.speech.decode`` →
``synthesize`` → ``openai.audio.speech.format``; ``audio.voices`` lists the voices.

``synthesize`` splits the input at sentence boundaries and speaks the sentences in one job of the model's
audio worker, handing each sentence's samples on as a :class:`SpeechChunk` as soon as it is synthesized; the
format stage encodes them into the requested container as they come (one header, then samples), so the first
audio leaves before the rest of the input is spoken.

``transcribe`` decodes the upload (PyAV, on a worker thread: any accepted container, resampled to the
model's rate, at most ``max_seconds`` long), checks the options against the model (a language Whisper
knows; translation needs a multilingual model) and runs mlx-audio's Whisper as a job of the model's audio
worker, which shares the device thread with the chat batch (:mod:`runtime.audio`). A streamed request gets
the text of each finished segment as a :class:`TranscriptDelta` while later windows decode; every request
ends with the :class:`Transcript`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import trio
from pydantic import Field

from flow.resources import MODEL_REFERENCES, ModelResource, ModelSet
from flow.stage import ExitStage, Outbox, Stage, StageConfig
from protocols import openai_audio, openai_chat, openai_speech
from protocols.audio_codecs import AudioEncoder, decode_audio
from protocols.errors import ApiError
from protocols.ir import (
    HttpRequest,
    SpeechChunk,
    SpeechDone,
    SpeechEvent,
    SpeechRequest,
    Transcript,
    TranscriptDelta,
    TranscriptEvent,
    TranscriptionRequest,
    TranscriptSegment,
    WireFrame,
)
from protocols.sse import data_frame
from stages.protocol import SSE_HEADERS, BodyDecode, EndpointStage

if TYPE_CHECKING:
    import numpy as np

    from runtime.audio import LoadedAudio, SpeechOptions, TranscribeOptions

In = TypeVar("In")
Out = TypeVar("Out")
MAX_PROMPT_CHARS = 4096  # Whisper reads at most 223 prompt tokens; a longer prompt is a mistake


class TranscriptionsDecode(BodyDecode[TranscriptionRequest]):
    type_name: ClassVar[str] = "openai.audio.transcriptions.decode"
    output_type: ClassVar[Any] = TranscriptionRequest
    body_types: ClassVar[frozenset[str]] = frozenset({openai_audio.MULTIPART})
    description = "reads an OpenAI transcription form (multipart: file, model, language, prompt, formats, stream)"
    task: ClassVar[str] = "transcribe"

    def decode(self, http: HttpRequest) -> TranscriptionRequest:
        return openai_audio.decode_transcription_request(http.body, http.header("content-type") or "",
                                                         http.request_id, self.task)


class TranslationsDecode(TranscriptionsDecode):
    type_name: ClassVar[str] = "openai.audio.translations.decode"
    description = "reads an OpenAI translation form (multipart: file, model, prompt, formats): speech to English text"
    task: ClassVar[str] = "translate"


class AudioModelsConfig(StageConfig):
    models: list[str] = Field(default_factory=list, description="model resources served (default: all)")


CAPABILITY_LABELS = {"stt": ("speech-to-text", "transcribe speech"), "tts": ("text-to-speech", "speak")}


class AudioModelStage(Stage[In, Out]):
    """A stage that works with one of its audio models, which must have its ``capability``."""

    Config: ClassVar[type[StageConfig]] = AudioModelsConfig
    references = MODEL_REFERENCES
    capability: ClassVar[str]  # "stt" or "tts"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = ModelSet(self.links.many("models", ModelResource))

    async def audio_model(self, model_id: str) -> tuple[ModelResource, LoadedAudio]:
        """The audio model a request names, loaded; a 400 naming the models that can serve it if it is of
        another kind or cannot do this."""
        resource = self.models.lookup(model_id, kind="audio")
        loaded = await resource.ensure_audio()
        if self.capability not in loaded.capabilities:
            kind, able = CAPABILITY_LABELS[self.capability]
            can = sorted(m.name for m in self.models.all()
                         if m.audio is not None and self.capability in m.audio.capabilities)
            raise ApiError("invalid_request", f"The model {resource.name!r} is not a {kind} model: it cannot "
                           f"{able}. Models that can: {', '.join(can) or '(none loaded on this server)'}.",
                           param="model", code="wrong_model_kind")
        return resource, loaded


class TranscribeConfig(AudioModelsConfig):
    max_seconds: float = Field(default=1800.0, gt=0, description="the longest recording a request may send")


class Transcribe(AudioModelStage[TranscriptionRequest, TranscriptEvent]):
    type_name: ClassVar[str] = "transcribe"
    input_type: ClassVar[Any] = TranscriptionRequest
    output_type: ClassVar[Any] = TranscriptEvent
    Config = TranscribeConfig
    capability = "stt"
    description = ("transcribes or translates speech with a Whisper model (mlx-audio), sharing the device thread "
                   "fairly with chat; streams finished segments")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert isinstance(self.config, TranscribeConfig)
        self.max_seconds = self.config.max_seconds

    async def run(self, inbox: trio.MemoryReceiveChannel[TranscriptionRequest],
                  outbox: Outbox[TranscriptEvent]) -> None:
        async for request in inbox:
            resource, loaded = await self.audio_model(request.model)
            options = transcribe_options(resource.name, loaded, request)
            samples = await trio.to_thread.run_sync(decode_audio, request.audio, loaded.sample_rate,
                                                    self.max_seconds, request.filename)
            await self._transcribe(resource.name, loaded, request, options, samples, outbox)

    @staticmethod
    async def _transcribe(model: str, loaded: LoadedAudio, request: TranscriptionRequest,
                          options: TranscribeOptions, samples: Any, outbox: Outbox[TranscriptEvent]) -> None:
        from runtime.audio import run_reporting, transcribe

        sent = ""

        async def deliver(segments: list[TranscriptSegment]) -> None:
            nonlocal sent
            text = "".join(s.text for s in segments)
            text = text if sent else text.lstrip()  # the transcript's text starts with its first word
            if text:
                sent += text
                await outbox.send(TranscriptDelta(text))

        result = await run_reporting(
            loaded.worker, lambda report: transcribe(loaded, samples, options, report if request.stream else None),
            deliver)
        text = result.text.strip()  # Whisper's text starts with a space token; OpenAI's answers do not
        if request.stream and text.startswith(sent) and len(text) > len(sent):
            await outbox.send(TranscriptDelta(text[len(sent):]))
        await outbox.send(Transcript(request, model, text, result.language, len(samples) / loaded.sample_rate,
                                     result.segments))


def transcribe_options(model: str, loaded: LoadedAudio, request: TranscriptionRequest) -> TranscribeOptions:
    """The request's options for this model, or a 400 saying what it accepts."""
    from runtime.audio import TranscribeOptions, whisper_languages

    language = request.language
    if language is not None:
        code = whisper_languages().get(language.lower())
        if code is None:
            raise ApiError("invalid_request", f"'language' {language!r} is not a language Whisper knows; send an "
                           "ISO-639-1 code such as en, de, fr, es, zh or ja, or leave it out to detect it.",
                           param="language")
        if not loaded.multilingual and code != "en":
            raise ApiError("invalid_request", f"The model {model!r} is English-only; send language = en or leave it "
                           "out, or use a multilingual Whisper model.", param="language")
        language = code
    if request.task == "translate" and not loaded.multilingual:
        raise ApiError("invalid_request", f"The model {model!r} is English-only and cannot translate; translations "
                       "need a multilingual Whisper model.", param="model")
    if request.prompt is not None and len(request.prompt) > MAX_PROMPT_CHARS:
        raise ApiError("invalid_request", f"'prompt' is {len(request.prompt)} characters long; Whisper reads at most "
                       f"its last ~220 tokens, send at most {MAX_PROMPT_CHARS} characters.", param="prompt")
    return TranscribeOptions(task=request.task, language=language, prompt=request.prompt,
                             temperature=request.temperature or None, word_timestamps=request.word_timestamps)


class TranscriptionsFormat(ExitStage[TranscriptEvent, WireFrame]):
    type_name: ClassVar[str] = "openai.audio.transcriptions.format"
    input_type: ClassVar[Any] = TranscriptEvent
    output_type: ClassVar[Any] = WireFrame
    codec = openai_chat.ChatCodec  # OpenAI's error shape
    description = ("answers a transcript as json, text, srt, vtt or verbose_json, or streams it as SSE "
                   "transcript.text.delta / transcript.text.done events")

    async def run(self, inbox: trio.MemoryReceiveChannel[TranscriptEvent], outbox: Outbox[WireFrame]) -> None:
        started = False
        async for event in inbox:
            if isinstance(event, TranscriptDelta):
                if not started:
                    await outbox.send(WireFrame(b"", headers=SSE_HEADERS, streaming=True))
                    started = True
                await outbox.send(WireFrame(data_frame(openai_audio.delta_event(event.text))))
                continue
            if event.request.stream:
                frame = data_frame(openai_audio.done_event(event))
                await outbox.send(WireFrame(frame, headers=SSE_HEADERS, streaming=True) if not started
                                  else WireFrame(frame))
                continue
            body, content_type = openai_audio.encode_transcript(event)
            await outbox.send(WireFrame(body, headers=(("content-type", content_type),)))


# ---------------------------------------------------------------------------------------------- text to speech
class SpeechDecode(BodyDecode[SpeechRequest]):
    type_name: ClassVar[str] = "openai.audio.speech.decode"
    output_type: ClassVar[Any] = SpeechRequest
    description = "validates an OpenAI speech body (input, voice, instructions, speed, formats)"

    def decode(self, http: HttpRequest) -> SpeechRequest:
        return openai_speech.decode_speech_request(http.body, http.request_id)


class Synthesize(AudioModelStage[SpeechRequest, SpeechEvent]):
    type_name: ClassVar[str] = "synthesize"
    input_type: ClassVar[Any] = SpeechRequest
    output_type: ClassVar[Any] = SpeechEvent
    capability = "tts"
    description = ("speaks text with a text-to-speech model (mlx-audio) sentence by sentence, each sentence's "
                   "audio handed on as soon as it is synthesized; shares the device thread fairly with chat")

    async def run(self, inbox: trio.MemoryReceiveChannel[SpeechRequest], outbox: Outbox[SpeechEvent]) -> None:
        from runtime.audio import run_reporting, synthesize

        async for request in inbox:
            resource, loaded = await self.audio_model(request.model)
            options = speech_options(resource, loaded, request)
            pieces = openai_speech.sentences(request.input)

            async def deliver(samples: np.ndarray) -> None:
                chunk = samples.astype("<f4").tobytes()
                await outbox.send(SpeechChunk(request, resource.name, loaded.sample_rate, chunk))

            total = await run_reporting(loaded.worker, lambda report: synthesize(loaded, pieces, options, report),
                                        deliver)
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
    input_type: ClassVar[Any] = SpeechEvent
    output_type: ClassVar[Any] = WireFrame
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


class VoicesList(EndpointStage):
    type_name: ClassVar[str] = "audio.voices"
    Config = AudioModelsConfig
    references = MODEL_REFERENCES
    codec = openai_chat.ChatCodec
    description = "lists the voices of the text-to-speech models (GET /v1/audio/voices, ?model= for one)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.models = ModelSet(self.links.many("models", ModelResource))

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
