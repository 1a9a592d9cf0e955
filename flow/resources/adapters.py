"""A model resource's LoRA adapters: the ones its graph mounts, the ones clients mount at run time, and the
adapters a request's ``adapter`` field and model id select.

The adapters themselves live on the model's engine (:mod:`runtime.adapters`), so they go when the model
unloads; this registry outlives loads: each mounted id's directory is remembered, and every adapter is
mounted again when the model loads again (a model pool evicted it, or it is lazy). Mounting reads and hashes
the files on a worker thread, then checks and mounts the adapter on the device thread between engine steps.

Paths come from two places and are treated differently. The graph's (the operator's own TOML: ``adapters`` on a
model resource, ``roots`` on the ``adapters.manage`` stage) expand ``~`` and ``$VARS``. A client's (``POST
/v1/adapters``) is taken as written, but for a leading ``~`` (the server's own user's home): no environment
variable is expanded, and the directory must be an adapter under the adapter roots (:func:`default_roots`: the
Hugging Face hub cache and flow's own ``<data dir>/adapters``, widened by the stage's ``roots``), its files too once
symlinks are followed. Whatever the reason a path is refused (missing, not a directory, not an adapter, outside the
roots, a symlink out of them), the answer is the same (:func:`not_an_adapter`), so it tells a client nothing about
which paths exist.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from protocols.adapter_spec import parse_adapter_spec
from protocols.errors import ApiError

if TYPE_CHECKING:
    from runtime.adapters import Adapter
    from runtime.models import LoadedModel

log = logging.getLogger("flow.resources.adapters")


@dataclass(frozen=True)
class AdapterMount:
    """An adapter id and where its files are, as mounted (by the graph or a client)."""

    id: str
    path: Path
    check_base_model: bool = True
    configured: bool = False  # named by the graph: a failure to mount it is a failure to load the model


def expand_path(text: str) -> Path:
    """A path from the graph (the operator's own config): ``$VARS`` and ``~`` expand. Never for a request's."""
    return Path(os.path.expandvars(text)).expanduser()


def request_path(text: str) -> Path:
    """A path from a request, as written: a leading ``~`` is the server's own user's home (``~user`` is not
    expanded), nothing else changes — no environment variable, which would let any client read any of them."""
    if text == "~" or text.startswith("~/"):
        return Path.home() / text[2:]
    return Path(text)


def default_roots() -> list[Path]:
    """Where clients may mount adapters from when the graph names no other place: the Hugging Face hub cache (as
    the server resolves it: ``HF_HUB_CACHE``, ``HF_HOME``, huggingface_hub's default) and ``<data dir>/adapters``
    (``$FLOW_DATA_DIR``, else the platform's data directory for flow)."""
    from flow.catalog.capabilities import data_dir
    from flow.catalog.local_models import hub_cache_dir

    return [hub_cache_dir(), data_dir() / "adapters"]


def _within(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def find_request_adapter(path: Path, roots: list[Path]) -> Path | None:
    """The adapter directory ``path`` names, with every symlink resolved, if it is one under ``roots`` (each
    resolved too), and its config and weights files also resolve under them; else None, whatever the reason.
    Blocking (it reads the file system): run it on a worker thread."""
    from runtime.adapters import CONFIG_FILE, MLX_LM_WEIGHTS, PEFT_WEIGHTS

    real_roots = [os.path.realpath(root) for root in roots]
    real = os.path.realpath(path)
    if not _within(real, real_roots) or not os.path.isdir(real):
        return None
    config = os.path.join(real, CONFIG_FILE)
    weights = [w for w in (os.path.join(real, MLX_LM_WEIGHTS), os.path.join(real, PEFT_WEIGHTS)) if os.path.isfile(w)]
    if not os.path.isfile(config) or not weights:
        return None
    # A file of the directory may be a symlink (the hub cache's snapshots are): where it leads must be inside too.
    if not all(_within(os.path.realpath(f), real_roots) for f in (config, weights[0])):
        return None
    return Path(real)


def not_an_adapter(text: str, roots: list[Path]) -> ApiError:
    """The one answer for a client's path that is not an adapter here, whatever the reason: it echoes only what
    the client sent, and says the same for a missing path, a directory that is not an adapter, and one outside
    the roots (so it reveals nothing about which paths exist)."""
    return ApiError("invalid_request", f"No adapter this server can mount at the path {text!r}: give a directory "
                    "with adapter_config.json and adapters.safetensors (mlx-lm) or adapter_model.safetensors (PEFT), "
                    f"under one of the adapter roots ({', '.join(map(str, roots))}).", param="path",
                    code="adapter_path_refused")


class AdapterRegistry:
    """The adapters of one model resource, by id."""

    def __init__(self, model_name: str, configured: dict[str, str], aliases: dict[str, str]) -> None:
        self.model_name = model_name
        self.mounts: dict[str, AdapterMount] = {
            adapter_id: AdapterMount(adapter_id, expand_path(path), configured=True)
            for adapter_id, path in configured.items()}
        self.aliases = {model_id: parse_adapter_spec(spec) for model_id, spec in aliases.items()}
        self.live: dict[str, Adapter] = {}  # mounted on the loaded model now
        self.last_mounted: dict[str, dict[str, Any]] = {}  # each id's figures when it was last mounted

    async def mount_all(self, loaded: LoadedModel, served_names: list[str]) -> None:
        """Mount every remembered adapter on a model that has just loaded. A configured adapter that does not
        mount fails the load (``ValueError``); one a client mounted is dropped, with a log line saying why."""
        self.live = {}
        for mount in list(self.mounts.values()):
            try:
                await self._mount_on(loaded, mount, served_names)
            except ApiError as exc:
                if mount.configured:
                    raise ValueError(f"adapter {mount.id!r} ({mount.path}): {exc.message}") from None
                log.error("model %s: adapter %s no longer mounts (%s); dropped", self.model_name, mount.id,
                          exc.message)
                del self.mounts[mount.id]
                self.last_mounted.pop(mount.id, None)

    async def mount(self, loaded: LoadedModel, mount: AdapterMount, served_names: list[str]) -> Adapter:
        """Mount a client's adapter: all of it fits, or a 400 says what does not and nothing is mounted."""
        if mount.id in self.mounts:
            raise ApiError("conflict", f"An adapter {mount.id!r} is already mounted on {self.model_name!r}; "
                           f"DELETE /v1/adapters/{mount.id} first, or choose another id.", param="id")
        if loaded.engine.distributed:  # every rank would need the adapter's weights: not rank-consistent yet
            raise ApiError("invalid_request", f"The model {self.model_name!r} is served across processes "
                           "(distributed); LoRA adapters are not supported there yet.", param="model")
        adapter = await self._mount_on(loaded, mount, served_names)
        self.mounts[mount.id] = mount
        return adapter

    async def _mount_on(self, loaded: LoadedModel, mount: AdapterMount, served_names: list[str]) -> Adapter:
        from runtime.adapters import AdapterError, base_model_name, load_adapter, read_adapter_files, same_base

        try:
            files = await trio.to_thread.run_sync(read_adapter_files, mount.path)
            trained_on = base_model_name(files.config)
            if mount.check_base_model and trained_on is not None and not same_base(trained_on, served_names):
                raise AdapterError(f"Adapter {mount.id!r} was trained on {trained_on!r}, not on this model "
                                   f"({', '.join(served_names)}); send \"check_base_model\": false to mount it anyway")
            engine = loaded.engine

            def load_and_mount() -> Adapter:
                adapter = load_adapter(mount.id, files, loaded.model)
                engine.mount_adapter(adapter)
                return adapter

            adapter = await engine.device.run(load_and_mount)
        except (AdapterError, OSError) as exc:
            raise ApiError("invalid_request", str(exc), param="path") from None
        self.live[mount.id] = adapter
        self.last_mounted[mount.id] = adapter.describe()
        log.info("model %s: adapter %s mounted (%s, rank %d, %d layers)", self.model_name, mount.id,
                 files.layout, adapter.rank, len(adapter.factors))
        return adapter

    async def unmount(self, loaded: LoadedModel | None, adapter_id: str) -> int:
        """Forget an adapter; requests that use it finish with it. Returns how many sequences still do."""
        if adapter_id not in self.mounts:
            raise self.not_mounted(adapter_id)
        del self.mounts[adapter_id]
        self.last_mounted.pop(adapter_id, None)
        adapter = self.live.pop(adapter_id, None)
        if adapter is None or loaded is None:
            return 0
        engine = loaded.engine
        return await engine.device.run(lambda: engine.unmount_adapter(adapter))

    def select(self, model_id: str, spec: tuple[str, ...] | None) -> tuple[Adapter, ...]:
        """The adapters a request uses: its ``adapter`` field, else the model id's configured default."""
        ids = spec if spec is not None else self.aliases.get(model_id, ())
        missing = [i for i in ids if i not in self.live]
        if missing:
            raise self.not_mounted(missing[0])
        return tuple(self.live[i] for i in ids)

    def not_mounted(self, adapter_id: str) -> ApiError:
        return ApiError("not_found", f"No adapter {adapter_id!r} is mounted on {self.model_name!r}. Mounted: "
                        f"{', '.join(sorted(self.mounts)) or '(none)'}; mount one with POST /v1/adapters.",
                        param="adapter", code="adapter_not_found")

    def describe(self) -> list[dict[str, Any]]:
        """Each adapter: ``id, path, rank, scale, size_bytes, mounted_layers`` (the reference API's fields), its
        ``format`` and ``digest``, and flow's ``model, source, state``. One that is not on the model now (the
        model is unloaded) shows the figures of its last mount; one never mounted yet (a lazy model's configured
        adapter) shows null for what only mounting finds out."""
        out = []
        for adapter_id, mount in self.mounts.items():
            adapter = self.live.get(adapter_id)
            entry: dict[str, Any] = (adapter.describe() if adapter is not None else dict(self.last_mounted.get(
                adapter_id) or {"id": adapter_id, "path": str(mount.path), "format": None, "rank": None,
                                "scale": None, "size_bytes": None, "mounted_layers": None, "digest": None}))
            entry.update(object="adapter", model=self.model_name, source="graph" if mount.configured else "api",
                         state="mounted" if adapter is not None else "not loaded")
            out.append(entry)
        return out
