"""What an embedding model gives, read from its files without loading weights.

* **task** — ``embed`` (a vector per input) or ``score`` (a cross-encoder: a relevance score per
  query–document pair, from a sequence-classification head);
* **pooling** — how token states become one vector: sentence-transformers' ``1_Pooling/config.json``
  when the model ships one (BGE pools the [CLS] token, MiniLM the mean), else the architecture's own
  (mlx-embeddings: mean for encoders, the last token for Qwen3-style decoders);
* **normalized** — vectors are L2-normalised (flow always serves unit vectors, as OpenAI does);
* **max_length** — tokens per input the model was trained to read;
* **Matryoshka dimensions** — the shorter sizes the model was trained to be cut to (a graph's
  ``dimensions`` on the model resource, ``matryoshka_dimensions`` in config.json, the ``matryoshka_dims``
  a sentence-transformers model card records, or what the model's series is published with). A request's
  ``dimensions`` is served by keeping the first components and renormalising.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

Pooling = Literal["mean", "cls", "last_token", "max"]
POOLINGS: tuple[Pooling, ...] = ("mean", "cls", "last_token", "max")

# sentence-transformers' pooling flags, in the order it applies them.
_ST_POOLING: tuple[tuple[str, Pooling], ...] = (
    ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last_token"),
    ("pooling_mode_mean_tokens", "mean"), ("pooling_mode_max_tokens", "max"))

# Series published as Matryoshka models, by model_type: (sizes, or the smallest of any size up to the native one).
_KNOWN_MATRYOSHKA: dict[str, tuple[tuple[int, ...], int | None]] = {
    "qwen3": ((), 32),  # Qwen3-Embedding: "user-defined output dimensions from 32 to" the hidden size
    "gemma3_text": ((128, 256, 512), None),  # EmbeddingGemma: 768 → 512, 256, 128
}
_CARD_DIMS = re.compile(r"[\"']?matryoshka_dim(?:ension)?s[\"']?\s*[:=]\s*\[([0-9,\s]+)\]")


@dataclass(frozen=True)
class Matryoshka:
    """The sizes a vector may be cut to: listed ``sizes``, or any size from ``smallest`` up."""

    sizes: tuple[int, ...] = ()
    smallest: int | None = None

    def accepts(self, dimensions: int, native: int) -> bool:
        if dimensions == native:
            return True
        if not 0 < dimensions < native:
            return False
        return dimensions in self.sizes or (self.smallest is not None and dimensions >= self.smallest)

    def describe(self, native: int) -> str:
        """The accepted values, for an error message."""
        if self.smallest is not None:
            return f"any value from {self.smallest} to {native}"
        return "one of " + ", ".join(str(n) for n in sorted({*self.sizes, native}) if n <= native)

    @property
    def declared(self) -> bool:
        return bool(self.sizes) or self.smallest is not None


@dataclass(frozen=True)
class EmbeddingProfile:
    task: Literal["embed", "score"]
    pooling: Pooling
    builtin_pooling: Pooling  # what the mlx-embeddings model computes itself (flow pools when they differ)
    normalized: bool
    max_length: int
    matryoshka: Matryoshka
    dims: int | None = None  # the native size, once the model is loaded (or from the config)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["matryoshka"] = ({"sizes": list(self.matryoshka.sizes), "smallest": self.matryoshka.smallest}
                             if self.matryoshka.declared else None)
        return out


class ProfileError(ValueError):
    """The model's files ask for something flow cannot serve (an unknown pooling)."""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def is_cross_encoder(config: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in config.get("architectures") or [])


def builtin_pooling(config: dict[str, Any]) -> Pooling:
    """The pooling mlx-embeddings' model for this config computes into ``text_embeds``."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type == "qwen3":
        return "last_token"
    if model_type == "modernbert" and config.get("classifier_pooling") == "cls":
        return "cls"
    return "mean"


def sentence_transformers_pooling(path: Path) -> Pooling | None:
    """The pooling a sentence-transformers checkout declares (``modules.json`` → its Pooling module's config)."""
    modules = _read_json_list(path / "modules.json")
    folders = [str(m.get("path", "")) for m in modules if str(m.get("type", "")).endswith(".Pooling")]
    for folder in folders or ["1_Pooling"]:
        config = _read_json(path / folder / "config.json")
        if not config:
            continue
        for flag, pooling in _ST_POOLING:
            if config.get(flag):
                return pooling
        modes = [k for k, v in config.items() if k.startswith("pooling_mode") and v]
        if modes:
            raise ProfileError(f"the model pools with {', '.join(modes)}; flow pools with "
                               f"{', '.join(POOLINGS)}")
    return None


def _read_json_list(path: Path) -> list[dict[str, Any]]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return [m for m in found if isinstance(m, dict)] if isinstance(found, list) else []


def _dims_list(value: Any) -> tuple[int, ...]:
    if isinstance(value, list) and all(isinstance(v, int) and v > 0 for v in value):
        return tuple(sorted(set(value)))
    return ()


def matryoshka_of(path: Path, config: dict[str, Any], configured: tuple[int, ...] = ()) -> Matryoshka:
    """The Matryoshka sizes, most explicit source first: the graph, config.json, the model card, the series."""
    if configured:
        return Matryoshka(tuple(sorted(set(configured))))
    for key in ("matryoshka_dimensions", "matryoshka_dims"):
        if sizes := _dims_list(config.get(key)):
            return Matryoshka(sizes)
    try:
        card = (path / "README.md").read_text(errors="replace")
    except OSError:
        card = ""
    if found := _CARD_DIMS.search(card):
        return Matryoshka(tuple(sorted({int(n) for n in found.group(1).replace(" ", "").split(",") if n})))
    if config.get("flow_smoke_test"):
        return Matryoshka()  # random weights: trained for nothing
    sizes, smallest = _KNOWN_MATRYOSHKA.get(str(config.get("model_type", "")).lower(), ((), None))
    return Matryoshka(sizes, smallest)


def max_length_of(path: Path, config: dict[str, Any], tokenizer_limit: int | None = None) -> int:
    """What the model was trained to read: sentence-transformers' max_seq_length, else the smaller of the
    position embeddings and the tokenizer's model_max_length (when that is a real number)."""
    declared = _read_json(path / "sentence_bert_config.json").get("max_seq_length")
    if isinstance(declared, int) and declared > 0:
        return declared
    limits = [int(config.get("max_position_embeddings") or 512)]
    if tokenizer_limit is None:
        tokenizer_limit = _read_json(path / "tokenizer_config.json").get("model_max_length")
    if isinstance(tokenizer_limit, int) and 0 < tokenizer_limit < 1_000_000:
        limits.append(tokenizer_limit)
    return min(limits)


def read_profile(path: Path, configured_dims: tuple[int, ...] = (),
                 tokenizer_limit: int | None = None) -> EmbeddingProfile:
    """The profile of the embedding model in ``path`` (reads small files only)."""
    config = _read_json(path / "config.json")
    cross = is_cross_encoder(config)
    own = builtin_pooling(config)
    pooling = own if cross else (sentence_transformers_pooling(path) or own)
    native = config.get("hidden_size")
    return EmbeddingProfile(
        task="score" if cross else "embed", pooling=pooling, builtin_pooling=own, normalized=not cross,
        max_length=max_length_of(path, config, tokenizer_limit),
        matryoshka=Matryoshka() if cross else matryoshka_of(path, config, configured_dims),
        dims=int(native) if isinstance(native, int) and not cross else None)
