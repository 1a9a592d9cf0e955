"""Finding model weights and loading them on the device thread.

A model reference is one of:

* a local directory (``./models/my-model``, ``/abs/path``, ``~/models/x``);
* a GGUF file (``~/models/x.Q4_K_M.gguf``, or any part of a split one): imported once into the
  model cache as an MLX directory (see :mod:`runtime.gguf_import`), then served from there;
* ``tiny:PRESET``: a random-weight smoke-test model built locally on first use
  (see :mod:`runtime.tiny`);
* a Hugging Face Hub repository id (``mlx-community/Qwen3-0.6B-4bit``): the
  local hub cache is tried first, then a download with a progress bar.

Anything that cannot be found raises :class:`~runtime.errors.ModelNotAvailable` with a message
that tells the user what to do instead — never a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runtime.device import DeviceThread
from runtime.engine_config import EngineConfig
from runtime.errors import ModelNotAvailable
from runtime.model_memory import context_length

if TYPE_CHECKING:  # MLX is imported when a model loads, not when a graph is compiled or checked
    from runtime.constrained import GrammarCompiler
    from runtime.engine import Engine
    from runtime.prefix_cache import PrefixCache

log = logging.getLogger("flow.models")

# What mlx-lm needs from a repository; skips other formats (gguf, pytorch bins, onnx).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]


def _advice(ref: str) -> str:
    return (
        f"Point flow at a local MLX model directory instead, e.g. "
        f"`flow serve graphs/default.toml --model /path/to/model`, or download it on a machine "
        f"with network (`huggingface-cli download {ref}`) and copy the hub cache. To see the "
        f"server work without any download, run the smoke-test graph: `flow serve graphs/demo.toml`."
    )


def resolve_model_path(ref: str, *, offline: bool | None = None) -> Path:
    """Turn a model reference into a local directory, downloading if needed and allowed."""
    if ref.startswith("tiny:"):
        # The smoke-test builders (and the MLX they import) load only for a tiny: reference.
        from runtime.tiny import PRESETS, ensure_tiny_model

        preset = ref.removeprefix("tiny:")
        if preset not in PRESETS:
            raise ModelNotAvailable(
                f"Unknown smoke-test model preset {preset!r}; known presets: {', '.join(sorted(PRESETS))}."
            )
        return ensure_tiny_model(preset)
    local = Path(ref).expanduser()
    if not local.is_dir() and ref.lower().endswith(".gguf"):
        from runtime.gguf_import import import_gguf  # numpy and gguf: only when a GGUF is named

        return import_gguf(local).path  # imported once into the model cache, reused after
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotAvailable(f"{local} is a directory but has no config.json; it is not an MLX model.")
        return local.resolve()
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise ModelNotAvailable(
            f"Model {ref!r} is neither an existing directory nor a Hugging Face repository id "
            f"(owner/name). " + _advice(ref)
        )
    return _from_hub(ref, offline=offline)


def _from_hub(repo: str, *, offline: bool | None) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError):
        pass
    if offline if offline is not None else os.environ.get("HF_HUB_OFFLINE") == "1":
        raise ModelNotAvailable(f"Model {repo!r} is not in the local Hugging Face cache and downloads are off. " + _advice(repo))
    log.info("downloading %s from the Hugging Face Hub …", repo)
    try:
        return Path(snapshot_download(repo, allow_patterns=HUB_PATTERNS))
    except Exception as exc:  # network errors come in many types; all mean the same here
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelNotAvailable(
            f"Could not download {repo!r} from the Hugging Face Hub ({type(exc).__name__}: {reason[:200]}) "
            f"and it is not in the local cache. " + _advice(repo)
        ) from None


@dataclass
class LoadedModel:
    """A model with its tokenizer and engine, living on the device thread."""

    name: str
    path: Path
    model: Any
    tokenizer: Any  # mlx_lm TokenizerWrapper
    engine: Engine
    config: dict[str, Any]
    load_seconds: float
    weight_bytes: int = 0  # device memory the weights take
    processor: Any = None  # a vision model's processor (images to pixel arrays, image tokens expanded)

    @property
    def context_length(self) -> int:
        return context_length(self.config)

    @property
    def vocab_size(self) -> int:
        size = self.config.get("vocab_size") or self.config.get("text_config", {}).get("vocab_size")
        return int(size) if size else len(self.tokenizer.get_vocab())

    @property
    def smoke_test(self) -> bool:
        return bool(self.config.get("flow_smoke_test"))

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """Structured output's compiler for this model (its vocabulary data is built on first use)."""
        from runtime.constrained import GrammarCompiler

        ends = getattr(self.tokenizer, "eos_token_ids", None) or [self.tokenizer.eos_token_id]
        return GrammarCompiler(self.tokenizer, self.vocab_size, tuple(sorted(int(t) for t in ends if t is not None)))


def load_model(name: str, path: Path, device: DeviceThread, engine_config: EngineConfig,
               prefix: PrefixCache | None = None, *, vision: bool = False, vision_share: float = 0.15,
               draft_model: Any = None, progress: Callable[[int, int], None] | None = None) -> LoadedModel:
    """Load weights and tokenizer on the device thread (blocking the caller); a ``vision`` model through
    mlx-vlm, its language model served by the same engine (see :mod:`runtime.vision`). ``progress(done, total)``
    hears the weight bytes read so far (called on the device thread). With speculative kind ``mtp`` the
    checkpoint's own MTP layers are loaded beside it as its drafter (runtime/mtp.py)."""
    processor: Any = None

    def _load() -> tuple[Any, Any, int]:
        nonlocal processor
        from mlx.utils import tree_flatten
        from mlx_lm.utils import load, load_tokenizer

        from runtime.detokenizers import use_exact_detokenizer

        if vision:
            from runtime.vision import load_vision_model

            model: Any
            model, processor = load_vision_model(path, device, vision_share, lazy=True)
            # The processor's files, with the end tokens of generation_config.json as mlx-lm's and mlx-vlm's loads
            # take them (Qwen-VL's config.json names <|im_end|> only, its generation config <|endoftext|> too).
            from mlx_lm.utils import load_config

            ends = load_config(path).get("eos_token_id")
            tokenizer = load_tokenizer(path, eos_token_ids=ends)  # type: ignore[no-untyped-call]
            inner = getattr(tokenizer, "_tokenizer", tokenizer)
            if not getattr(inner, "chat_template", None) and getattr(processor, "chat_template", None):
                inner.chat_template = processor.chat_template  # repositories ship it beside the processor
        else:
            model, tokenizer = load(str(path), lazy=True)[:2]
        use_exact_detokenizer(tokenizer)
        leaves: Any = tree_flatten(model.parameters())
        return model, tokenizer, _read_weights([v for _, v in leaves], progress)

    log.info("loading model %s from %s …", name, path)
    start = time.perf_counter()
    model, tokenizer, weight_bytes = device.call(_load)
    if engine_config.speculative.kind == "mtp":
        draft_model = _mtp_drafter(name, path, None if vision else model, device)
    seconds = time.perf_counter() - start
    config = json.loads((path / "config.json").read_text())
    log.info("loaded model %s in %.1f s", name, seconds)
    from runtime.engine import Engine
    from runtime.prefix_cache import namespace_of

    from runtime.quantized_kv import KVQuantizationUnsupported

    try:
        engine = Engine(model, device, engine_config, prefix, namespace_of(model_identity(path)),
                        draft_model=draft_model)
    except KVQuantizationUnsupported as exc:  # a setting this model's layers cannot take: said at load
        raise ModelNotAvailable(f"model {name} ({path.name}): {exc}") from None
    loaded = LoadedModel(name, path, model, tokenizer, engine, config, seconds, weight_bytes, processor)
    _allow_context_length(tokenizer, loaded.context_length)
    return loaded


def _mtp_drafter(name: str, path: Path, model: Any, device: DeviceThread) -> Any:
    """The model's own MTP layers as its drafter (speculative kind "mtp"; ``model`` None: a vision model, which
    they do not draft for); ModelNotAvailable saying why not."""
    from runtime.mtp import load_mtp_drafter

    if model is None:
        raise ModelNotAvailable(f"{name}: speculative kind \"mtp\" drafts for text models (mlx-lm); this one "
                                "loads as a vision model: set kind = \"text\" on its model resource to serve it "
                                "as text with MTP drafting.")
    try:
        return device.call(lambda: load_mtp_drafter(path, model))
    except ValueError as exc:
        raise ModelNotAvailable(f"{name}: speculative kind \"mtp\" needs the model's MTP layers, but {exc}; "
                                "use kind \"ngram\" or \"draft\" instead.") from None


def _read_weights(arrays: list[Any], progress: Callable[[int, int], None] | None,
                  chunk_bytes: int = 64 * 2**20) -> int:
    """Read a lazily loaded model's weights in pieces of about ``chunk_bytes``, telling ``progress`` the bytes
    read so far (a large model takes seconds to minutes: the console shows how far it is). Returns the total."""
    import mlx.core as mx

    total = sum(int(a.nbytes) for a in arrays)
    done = 0
    piece: list[Any] = []
    size = 0
    for array in [*arrays, None]:
        if array is not None:
            piece.append(array)
            size += int(array.nbytes)
        if piece and (array is None or size >= chunk_bytes):
            mx.eval(piece)
            done += size
            piece, size = [], 0
            if progress is not None:
                progress(done, total)
    return total


def _allow_context_length(tokenizer: Any, context_length: int) -> None:
    """A tokenizer_config's model_max_length below the model's context (Qwen3 ships 32,768 for a 40,960
    context) makes transformers warn on every long prompt the model can take: raise it to the context; the
    server checks prompt lengths itself."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    limit = getattr(inner, "model_max_length", None)
    if isinstance(limit, int) and limit < context_length:
        inner.model_max_length = context_length


def unload_model(loaded: LoadedModel, device: DeviceThread) -> None:
    """Stop the model's engine and give its memory back (blocking the caller)."""
    import mlx.core as mx

    loaded.engine.close()
    worker = getattr(loaded.model, "worker", None)
    if worker is not None:
        worker.close()  # a vision model's tower jobs
    loaded.model = None
    device.call(mx.clear_cache)


def model_identity(path: Path) -> str:
    """What makes two loads the same weights: the directory and its weight files' sizes and times.

    Prefix-cache keys start from it, so KV blocks never cross models (or a model's re-download)."""
    files = sorted(path.glob("*.safetensors"))
    return "|".join([str(path.resolve()), *(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)])


def weight_bytes_on_disk(path: Path) -> int:
    """What loading ``path`` will roughly cost: the size of its weight files."""
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def tokenizer_mismatch(target: Path, draft: Path) -> str | None:
    """Why ``draft``'s tokenizer is not ``target``'s (None: the same vocabulary, ids and added tokens), read
    from their files (tokenizer.json, else vocab files) without loading either model."""
    def vocabulary(path: Path) -> Any:
        tokenizer = path / "tokenizer.json"
        if tokenizer.is_file():
            data = json.loads(tokenizer.read_text())
            model = data.get("model", {})
            return (model.get("type"), model.get("vocab"), model.get("merges"),
                    sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", [])))
        files = sorted(p for p in path.iterdir() if p.name.startswith(("vocab", "tokenizer.model", "merges")))
        return [(p.name, p.read_bytes()) for p in files] or None

    mine, theirs = vocabulary(target), vocabulary(draft)
    if mine is None or theirs is None:
        return "has no tokenizer files to compare" if theirs is None else None
    return None if mine == theirs else "has another tokenizer (its vocabulary or ids differ)"


def local_model_dir(ref: str) -> Path | None:
    """The directory ``ref`` names when it is on this machine already — a local directory, or a smoke-test preset
    built before — without downloading, importing or building anything (None otherwise)."""
    expanded = os.path.expanduser(os.path.expandvars(ref))
    if expanded.startswith("tiny:"):
        from runtime.tiny import PRESETS, tiny_models_dir  # only for a tiny: reference, as above

        spec = PRESETS.get(expanded.removeprefix("tiny:"))
        if spec is None:
            return None
        built = tiny_models_dir() / f"{expanded.removeprefix('tiny:')}-{spec.cache_key()}"
        return built if (built / "config.json").is_file() else None
    local = Path(expanded)
    return local if (local / "config.json").is_file() else None
