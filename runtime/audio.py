"""Audio models on the device thread: loading (mlx-audio), transcription and speech.

mlx-audio's ``generate`` runs a whole transcription in one call: decoding a long recording takes seconds to
minutes, and the device thread must not spend them while chat streams wait. Each audio job (a plain call into
mlx-audio) runs on a :class:`runtime.sliced_jobs.SlicedWorker`, which gives the device back at the model's
passes (Whisper's decoder steps and each layer of its encoder): while chat streams decode, audio gets at most
its ``share`` of the device's time; alone, a transcription runs at the speed of a direct mlx-audio call.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocols.ir import TranscriptSegment, TranscriptWord
from runtime.device import DeviceThread
from runtime.errors import ModelNotAvailable
from runtime.sliced_jobs import SlicedWorker, checkpoint_children, run_reporting, wait_reporting, with_checkpoint
from runtime.speech_batch import BatchSpeech, SpeechBatcher

log = logging.getLogger("flow.audio")

STT_RATE = 16000  # what Whisper-family models read


@dataclass
class LoadedAudio:
    """An audio model loaded on the device thread, with the worker its jobs run on."""

    name: str
    path: Path
    model: Any
    worker: SlicedWorker
    stt: bool
    tts: bool
    multilingual: bool
    sample_rate: int
    voices: tuple[str, ...]
    weight_bytes: int
    smoke_test: bool
    batcher: SpeechBatcher | None = None  # text-to-speech models that batch requests (mlx-audio's sessions)

    @property
    def accepted_voices(self) -> tuple[str, ...]:
        """The voice names a text-to-speech model answers to: its own, or — a model with one voice — ``default``
        and OpenAI's names, so OpenAI clients work unchanged."""
        from protocols.openai_speech import OPENAI_VOICES

        return self.voices or ("default", *OPENAI_VOICES)

    @property
    def capabilities(self) -> list[str]:
        """What it does: ``stt`` (speech to text), ``tts`` (text to speech)."""
        return [name for name, able in (("stt", self.stt), ("tts", self.tts)) if able]


def load_audio_model(name: str, path: Path, device: DeviceThread, share: float = 0.2,
                     speech_batch_size: int = 8) -> LoadedAudio:
    """Load an mlx-audio model on the device thread (blocking the caller): a Whisper (speech to text) or one of
    mlx-audio's text-to-speech architectures. A text-to-speech model that batches requests (continuous batching
    in mlx-audio) speaks up to ``speech_batch_size`` of them in shared passes (1: each request on its own)."""
    import json

    config = json.loads((path / "config.json").read_text())
    model_type = str(config.get("model_type", "")).lower()
    stt = model_type == "whisper"
    if not stt and not _is_tts_type(model_type):
        raise ModelNotAvailable(f"{path} is a {model_type or 'unknown'} audio model; this version of flow serves "
                                "Whisper speech-to-text models and mlx-audio's text-to-speech models.")

    def _load() -> tuple[Any, int]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        if stt:
            from mlx_audio.stt.utils import load_model
        else:
            from mlx_audio.tts.utils import load_model
        model = load_model(path if not stt else str(path))
        if stt and model.dtype == mx.float16 and not mx.metal.is_available():
            to_float32(model)  # MLX's CPU float16 arithmetic is several times slower than float32
        leaves: Any = tree_flatten(model.parameters())
        return model, sum(v.nbytes for _, v in leaves)

    try:
        model, weight_bytes = device.call(_load)
    except (ValueError, KeyError, AttributeError, TypeError, OSError) as exc:
        raise ModelNotAvailable(f"mlx-audio cannot load {path} ({type(exc).__name__}: {exc})") from None
    worker = SlicedWorker(device, share, "audio")
    if stt:
        if getattr(model, "_processor", None) is None:
            worker.close()
            raise ModelNotAvailable(f"{path} has no Whisper tokenizer mlx-audio can read (tokenizer.json, "
                                    "tokenizer_config.json, preprocessor_config.json).")
        with_checkpoint(model.encoder, worker.checkpoint)
        for block in model.encoder.blocks:  # a 30-second window's encoder pass, layer by layer
            with_checkpoint(block, worker.checkpoint, evaluate=True)
        with_checkpoint(model.decoder, worker.checkpoint)
        model.decode = _reporting_decode(model.decode)
        voices: tuple[str, ...] = ()
        multilingual, rate = bool(model.is_multilingual), STT_RATE
    else:
        checkpoint_children(model, worker.checkpoint, depth=2)
        multilingual, rate, voices = True, int(model.sample_rate), model_voices(model, path)
    batcher = None
    if not stt and speech_batch_size > 1 and callable(getattr(model, "create_tts_batch_session", None)) \
            and callable(getattr(model, "supports_tts_continuous_batch", None)):
        batcher = SpeechBatcher(model, worker, speech_batch_size)
    log.info("audio model %s loaded (%s, %s%s)", name, model_type, "speech to text" if stt else "text to speech",
             f", batches up to {speech_batch_size} requests" if batcher else "")
    return LoadedAudio(name, path, model, worker, stt=stt, tts=not stt, multilingual=multilingual,
                       sample_rate=rate, voices=voices, weight_bytes=weight_bytes,
                       smoke_test=bool(config.get("flow_smoke_test")), batcher=batcher)


def _is_tts_type(model_type: str) -> bool:
    import importlib.util

    from mlx_audio.tts.utils import MODEL_REMAPPING

    module = MODEL_REMAPPING.get(model_type, model_type)
    return bool(module) and importlib.util.find_spec(f"mlx_audio.tts.models.{module}") is not None


def model_voices(model: Any, path: Path) -> tuple[str, ...]:
    """The voices a text-to-speech model ships (its speakers, a ``voices`` table on the model, or a ``voices/``
    folder of voice files); none for a model with one voice."""
    speakers = getattr(model, "get_supported_speakers", None)
    if callable(speakers) and speakers():
        return tuple(sorted(str(v) for v in speakers()))
    table = getattr(model, "voices", None)
    if isinstance(table, dict) and table:
        return tuple(sorted(str(v) for v in table))
    folder = path / "voices"
    if folder.is_dir():
        return tuple(sorted({f.stem for f in folder.iterdir() if f.suffix in (".safetensors", ".pt", ".npy")}))
    return ()


def to_float32(model: Any) -> None:
    """A float16 Whisper as float32 (weights, the encoder's positional table, its compute dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_map

    model.update(tree_map(lambda x: x.astype(mx.float32) if x.dtype == mx.float16 else x, model.parameters()))
    model.encoder._positional_embedding = model.encoder._positional_embedding.astype(mx.float32)
    model.dtype = mx.float32


@dataclass(frozen=True)
class TranscribeOptions:
    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None  # None: Whisper's fallback schedule (0.0, 0.2, … 1.0)
    word_timestamps: bool = False
    seed: int = 0

    def generate_kwargs(self, model: Any) -> dict[str, Any]:
        """The keyword arguments of mlx-audio's ``generate`` for these options (shared with reference calls)."""
        import mlx.core as mx

        kwargs: dict[str, Any] = {"task": self.task, "language": self.language, "initial_prompt": self.prompt,
                                  "word_timestamps": self.word_timestamps, "verbose": None,
                                  "fp16": model.dtype == mx.float16}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        return kwargs


@dataclass(frozen=True)
class TranscriptResult:
    text: str
    language: str
    segments: tuple[TranscriptSegment, ...]


SegmentSink = Callable[[list[TranscriptSegment]], None]


class _SegmentReporter:
    """Hands a job's finished segments to its sink, each once."""

    def __init__(self, sink: SegmentSink) -> None:
        self.sink = sink
        self.reported = 0

    def report(self, raw: list[dict[str, Any]]) -> None:
        if len(raw) > self.reported:
            self.sink([segment_of(s) for s in raw[self.reported:]])
            self.reported = len(raw)


def _reporting_decode(decode: Callable[..., Any]) -> Callable[..., Any]:
    """Whisper's per-window ``decode``, telling the running job's reporter (if it has one) the segments
    finished before this window."""

    def reporting(*args: Any, **kwargs: Any) -> Any:
        import greenlet

        reporter = getattr(greenlet.getcurrent(), "flow_reporter", None)
        if reporter is not None:
            reporter.report(_segments_so_far())
        return decode(*args, **kwargs)

    return reporting


def transcribe(loaded: LoadedAudio, audio: Any, options: TranscribeOptions,
               on_segments: SegmentSink | None = None) -> TranscriptResult:
    """mlx-audio's Whisper ``generate`` on ``audio`` (16 kHz mono float32). Runs inside an audio job (or
    directly on the device thread). ``on_segments`` hears finished segments while later windows decode."""
    import greenlet
    import mlx.core as mx

    model = loaded.model
    mx.random.seed(options.seed)  # the fallback temperatures sample: the same audio gives the same text
    current = greenlet.getcurrent()
    reporter = _SegmentReporter(on_segments) if on_segments is not None else None
    current.flow_reporter = reporter
    try:
        output = model.generate(audio, **options.generate_kwargs(model))
    finally:
        current.flow_reporter = None
    if reporter is not None:
        reporter.report(list(output.segments))
    segments = tuple(segment_of(s) for s in output.segments)
    return TranscriptResult(output.text, output.language or options.language or "en", segments)


def _segments_so_far() -> list[dict[str, Any]]:
    """The segments mlx-audio's Whisper ``generate`` has finished, read from its frame while it asks for the
    next window's decode (its windows' segments are final once the next window starts). Whisper's loop keeps
    them in a local list; if a later mlx-audio names it otherwise, the stream sends the text at the end."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_name != "generate":
        frame = frame.f_back  # type: ignore[assignment]
    found = frame.f_locals.get("all_segments") if frame is not None else None
    return list(found) if isinstance(found, list) else []


def segment_of(raw: dict[str, Any]) -> TranscriptSegment:
    words = tuple(TranscriptWord(str(w["word"]), float(w["start"]), float(w["end"])) for w in raw.get("words") or ())
    return TranscriptSegment(
        id=int(raw.get("id", 0)), seek=int(raw.get("seek", 0)), start=float(raw["start"]), end=float(raw["end"]),
        text=str(raw["text"]), tokens=tuple(int(t) for t in raw.get("tokens") or ()),
        temperature=float(raw.get("temperature") or 0.0), avg_logprob=float(raw.get("avg_logprob", 0.0)),
        compression_ratio=float(raw.get("compression_ratio", 0.0)),
        no_speech_prob=float(raw.get("no_speech_prob", 0.0)), words=words)


def whisper_languages() -> dict[str, str]:
    """Whisper's language codes and the names it also accepts (lower case) → code."""
    from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES, TO_LANGUAGE_CODE

    return {**{code: code for code in LANGUAGES}, **TO_LANGUAGE_CODE}


@dataclass(frozen=True)
class SpeechOptions:
    voice: str | None = None  # None: the model's one voice
    speed: float = 1.0
    instructions: str | None = None
    max_tokens: int | None = None  # per piece, for models that generate tokens (None: the model's default)
    seed: int = 0

    def generate_kwargs(self, model: Any) -> dict[str, Any]:
        """The keyword arguments of the model's ``generate`` for these options (shared with reference calls);
        each only where the model's ``generate`` takes it."""
        accepted = speech_parameters(model)
        kwargs: dict[str, Any] = {"verbose": False}
        if self.voice is not None:
            kwargs["voice"] = self.voice
        if "speed" in accepted:
            kwargs["speed"] = self.speed
        if self.instructions is not None:
            kwargs["instruct"] = self.instructions
        if self.max_tokens is not None and "max_tokens" in accepted:
            kwargs["max_tokens"] = self.max_tokens
        return kwargs


def speech_parameters(model: Any) -> frozenset[str]:
    """The named parameters of a text-to-speech model's ``generate``."""
    import inspect

    return frozenset(inspect.signature(model.generate).parameters)


AudioSink = Callable[[Any], None]


def synthesize(loaded: LoadedAudio, pieces: list[str], options: SpeechOptions, on_audio: AudioSink) -> int:
    """Speak ``pieces`` in order with mlx-audio, handing each piece's samples (float32 numpy) to ``on_audio``
    as soon as they are synthesized; the number of samples. Runs inside an audio job."""
    import mlx.core as mx
    import numpy as np

    mx.random.seed(options.seed)  # sampling models: the same text gives the same speech
    kwargs = options.generate_kwargs(loaded.model)
    total = 0
    for piece in pieces:
        for result in loaded.model.generate(piece, **kwargs):
            samples = np.array(result.audio, dtype=np.float32).reshape(-1)
            total += len(samples)
            on_audio(samples)
    return total


async def speak(loaded: LoadedAudio, pieces: list[str], options: SpeechOptions,
                deliver: Callable[[Any], Awaitable[None]]) -> int:
    """Speak ``pieces`` in order, handing each piece's samples (float32 numpy) to ``deliver`` in trio as soon as
    they are synthesized; the number of samples. In the model's speech batch where it batches this request,
    else as an audio job of its own."""
    batcher = loaded.batcher
    if batcher is None or not batcher.accepts(options.voice, options.instructions, options.speed):
        return await run_reporting(loaded.worker, lambda report: synthesize(loaded, pieces, options, report), deliver)
    speech = BatchSpeech(tuple(pieces), options.voice, options.instructions, batcher.options(options.max_tokens))
    return await wait_reporting(lambda report: batcher.submit(speech, report), batcher.cancel, deliver)
