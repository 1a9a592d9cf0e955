"""Local models: what ``flow models`` lists.

Theory of operation
-------------------
A *model directory* holds a ``config.json`` and at least one ``*.safetensors``
file, the shape ``mlx_lm.load`` reads. Three places are searched, in order:

* the Hugging Face hub cache (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, read
  when called), scanned with ``huggingface_hub.scan_cache_dir``: for each model
  repository the snapshot ``refs/main`` points at (else the newest one), if it
  is a model directory; its id is the repo id;
* configured directories: ``$FLOW_MODEL_PATH`` (``os.pathsep``-separated) and
  any passed by the caller. Each entry is a model directory itself, or its
  immediate subdirectories are; its id is the directory path;
* the smoke-test models ``runtime.tiny`` has built into the flow cache; a
  build of a current preset gets the id ``tiny:PRESET`` that ``--model`` takes.

A directory found twice (``$FLOW_MODEL_PATH`` naming the hub cache, say) is
listed once, where it was found first. Each model is then described from its
files alone — no weights or tokenizer are loaded, and MLX is only imported
(with ``runtime.tiny``, for its cache location and presets), never used:
``config.json`` facts, sizes, and how it will be served. That is what ``flow probe`` stored in
the :class:`~flow.catalog.capabilities.CapabilityStore` if it was probed ("probed"),
else the family :func:`~flow.catalog.families.resolve_family` detects from the config,
the id and the chat template ("detected") — the same choice serving makes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from flow.catalog.capabilities import Capabilities, CapabilityStore
from flow.catalog.families import Family, builtin_families, model_facts, resolve_family, template_text
from runtime.embedding_profile import ProfileError, read_profile
from runtime.model_kinds import ModelKind, detect_kind_of

Source = Literal["hub", "directory", "smoke-test"]


@dataclass(frozen=True)
class Found:
    """A model directory and where it was found, before it is described."""

    id: str  # what ``flow serve --model`` takes: a repo id, a path, or tiny:PRESET
    path: Path
    source: Source
    size_bytes: int
    store_keys: tuple[Path, ...]  # the paths a probe may have stored it under


@dataclass(frozen=True)
class LocalModel:
    """One local model: its files' facts and how it will be served."""

    id: str
    path: Path
    source: Source
    smoke_test: bool
    kind: ModelKind  # text, vision, embeddings or audio: which loader and stages serve it
    model_type: str | None
    architectures: list[str]
    quantization_bits: int | None
    size_bytes: int
    weight_bytes: int
    family: str
    family_source: Literal["probed", "detected"]
    tool_parser: str
    tool_delivery: str
    reasoning_parser: str
    capabilities: Capabilities | None  # what ``flow probe`` stored, if it ran
    profile: dict[str, Any] | None = None  # an embedding model's: dims, pooling, max length, Matryoshka sizes

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["path"] = str(self.path)
        if self.capabilities is not None:
            data["capabilities"] = {k: v for k, v in data["capabilities"].items() if k != "evidence"}
        return data


# ---------------------------------------------------------------- finding


def served_name(model: str) -> str:
    """The id ``flow serve --model MODEL`` serves it under: the directory's name, a GGUF's name without its
    suffixes."""
    if model.lower().endswith(".gguf"):
        from runtime.gguf_import import gguf_model_name

        return gguf_model_name(model)
    return Path(model.rstrip("/")).name or model


def is_model_dir(path: Path) -> bool:
    """True when ``path`` holds a config.json and at least one safetensors file."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _in_directory(path: Path, source: Source = "directory", ref: str | None = None) -> Found:
    return Found(ref or str(path), path, source, _dir_size(path), (path, path.resolve()))


def hub_cache_dir() -> Path:
    """The hub cache as the environment names it now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def hub_models(cache_dir: Path | None = None) -> Iterator[Found]:
    """Model repositories in the hub cache whose current snapshot is a model directory."""
    from huggingface_hub import scan_cache_dir

    cache = cache_dir or hub_cache_dir()
    if not cache.is_dir():
        return
    for repo in sorted(scan_cache_dir(cache).repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revision = max(repo.revisions, key=lambda r: ("main" in r.refs, r.last_modified))
        if is_model_dir(revision.snapshot_path):
            # A probe stores the path snapshot_download returns: under the unresolved cache dir.
            as_served = cache / repo.repo_path.name / "snapshots" / revision.commit_hash
            yield Found(repo.repo_id, revision.snapshot_path, "hub", revision.size_on_disk,
                        (as_served, revision.snapshot_path))


def model_path_dirs() -> list[Path]:
    """The directories in ``$FLOW_MODEL_PATH``."""
    return [Path(p).expanduser() for p in os.environ.get("FLOW_MODEL_PATH", "").split(os.pathsep) if p]


def directory_models(roots: Iterable[Path]) -> Iterator[Found]:
    """Each root that is a model directory, else its immediate subdirectories that are."""
    for root in roots:
        if is_model_dir(root):
            yield _in_directory(root)
        elif root.is_dir():
            yield from (_in_directory(d) for d in sorted(root.iterdir()) if d.is_dir() and is_model_dir(d))


def smoke_test_root() -> Path:
    """Where ``runtime.tiny.ensure_tiny_model`` builds its models."""
    from runtime.tiny import tiny_models_dir

    return tiny_models_dir()


def _tiny_ref(path: Path) -> str:
    """``tiny:PRESET`` when ``path`` is the current build of a preset, else the path."""
    from runtime.tiny import PRESETS

    names = {f"{name}-{spec.cache_key()}": name for name, spec in PRESETS.items()}
    return f"tiny:{names[path.name]}" if path.name in names else str(path)


def smoke_test_models(root: Path | None = None) -> Iterator[Found]:
    """The tiny random-weight models built in the flow cache (staging dirs skipped)."""
    root = root or smoke_test_root()
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if not path.name.startswith(".") and path.is_dir() and is_model_dir(path):
            yield _in_directory(path, "smoke-test", _tiny_ref(path))


# ---------------------------------------------------------------- describing


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(path: Path) -> str | None:
    """The chat template as text: ``chat_template.jinja``, else tokenizer_config.json's (named templates joined)."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    # Named templates ([{"name": "default", "template": ...}, ...]): all of them, for their markers.
    return template_text(_read_json(path / "tokenizer_config.json").get("chat_template"))


def _quantization_bits(config: dict[str, Any]) -> int | None:
    quant = config.get("quantization")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return bits if isinstance(bits, int) else None


def _stored(store: CapabilityStore, keys: Iterable[Path]) -> Capabilities | None:
    return next((caps for key in dict.fromkeys(keys) if (caps := store.get(key)) is not None), None)


def describe(found: Found, store: CapabilityStore, families: dict[str, Family]) -> LocalModel:
    """A found directory's facts, with its stored capabilities or its detected family."""
    config = _read_json(found.path / "config.json")
    model_type, architectures = model_facts(found.path)
    caps = _stored(store, found.store_keys)
    kind = detect_kind_of(found.path)
    profile = _embedding_profile(found.path, caps) if kind == "embeddings" else None
    if kind != "text":  # tools and reasoning are a text model's
        family, tool_parser, delivery, reasoning = "-", "-", "-", "-"
    elif caps is not None:
        family, tool_parser = caps.family, caps.tool_parser
        delivery, reasoning = caps.tool_delivery, caps.reasoning_parser
    else:
        detected = resolve_family("auto", found.path, found.id, chat_template(found.path), families)
        family, tool_parser = detected.name, detected.tools.parser
        delivery, reasoning = detected.tools.delivery, detected.reasoning.parser
    return LocalModel(
        id=found.id, path=found.path, source=found.source, smoke_test=config.get("flow_smoke_test") is True,
        kind=kind, model_type=model_type, architectures=architectures, quantization_bits=_quantization_bits(config),
        size_bytes=found.size_bytes, weight_bytes=sum(p.stat().st_size for p in found.path.glob("*.safetensors")),
        family=family, family_source="probed" if caps is not None else "detected",
        tool_parser=tool_parser, tool_delivery=delivery, reasoning_parser=reasoning, capabilities=caps,
        profile=profile,
    )


def _embedding_profile(path: Path, caps: Capabilities | None) -> dict[str, Any] | None:
    """What ``flow probe`` measured, else what the files declare (None if they ask for what flow cannot do)."""
    if caps is not None and caps.profile:
        return caps.profile
    try:
        return read_profile(path).as_json()
    except ProfileError:
        return None


def _unique(found: Iterable[Found]) -> Iterator[Found]:
    seen: set[Path] = set()
    for item in found:
        if item.path.resolve() not in seen:
            seen.add(item.path.resolve())
            yield item


def find_local_models(extra_dirs: Iterable[Path] = (), *, store: CapabilityStore | None = None,
                      families: dict[str, Family] | None = None) -> list[LocalModel]:
    """Every local model: hub cache, ``$FLOW_MODEL_PATH`` and ``extra_dirs``, smoke-test builds."""
    store = store or CapabilityStore()
    families = families if families is not None else builtin_families()
    found = [*hub_models(), *directory_models([*model_path_dirs(), *extra_dirs]), *smoke_test_models()]
    return [describe(item, store, families) for item in _unique(found)]
