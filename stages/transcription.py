"""Speech to text: ``openai.audio.transcriptions.decode`` / ``openai.audio.translations.decode`` →
``transcribe`` → ``openai.audio.transcriptions.format``.

``transcribe`` decodes the upload (PyAV, on a worker thread: any accepted container, resampled to the
model's rate, at most ``max_seconds`` long), checks the options against the model (a language Whisper
knows; translation needs a multilingual model) and runs mlx-audio's Whisper as a job of the model's audio
worker, which shares the device thread with the chat batch (:mod:`runtime.audio`). A streamed request gets
the text of each finished segment as a :class:`TranscriptDelta` while later windows decode; every request
ends with the :class:`Transcript`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import trio
from pydantic import Field

from flow.graph.stage import ExitStage, Outbox
from protocols import openai_audio, openai_chat
from protocols.audio_codecs import decode_audio
from protocols.errors import ApiError
from protocols.ir import (
    HttpRequest,
    Transcript,
    TranscriptDelta,
    TranscriptEvent,
    TranscriptionRequest,
    TranscriptSegment,
    WireFrame,
)
from protocols.sse import data_frame
from stages.audio import AudioModelsConfig, AudioModelStage
from stages.protocol import SSE_HEADERS, BodyDecode

if TYPE_CHECKING:
    from runtime.audio import LoadedAudio, TranscribeOptions

MAX_PROMPT_CHARS = 4096  # Whisper reads at most 223 prompt tokens; a longer prompt is a mistake


class TranscriptionsDecode(BodyDecode[TranscriptionRequest]):
    type_name: ClassVar[str] = "openai.audio.transcriptions.decode"
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

class TranscribeConfig(AudioModelsConfig):
    max_seconds: float = Field(default=1800.0, gt=0, description="the longest recording a request may send")


class Transcribe(AudioModelStage[TranscriptionRequest, TranscriptEvent]):
    type_name: ClassVar[str] = "transcribe"
    Config = TranscribeConfig
    capability = "stt"
    description = ("transcribes or translates speech with a Whisper model (mlx-audio), sharing the device thread "
                   "fairly with chat; streams finished segments")

    def setup(self) -> None:
        super().setup()
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
        from runtime.audio import transcribe
        from runtime.sliced_jobs import run_reporting

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
