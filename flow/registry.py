"""Registries of stage and resource types, by short name.

Graph files name types (``type = "chat.prepare"``); they never import dotted
paths. Built-in stages register themselves when :mod:`stages` is imported;
plugins add theirs through the ``flow.stages`` entry-point group, each entry
pointing at a module that registers its stage classes on import.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points
from typing import Any, TypeVar

from flow.stage import Stage

log = logging.getLogger("flow.registry")

S = TypeVar("S", bound=type[Stage[Any, Any]])

_stages: dict[str, type[Stage[Any, Any]]] = {}
_resources: dict[str, type[Any]] = {}
_loaded = False


def register_stage(cls: S) -> S:
    """Class decorator: make a stage type available to graphs under ``cls.type_name``."""
    existing = _stages.get(cls.type_name)
    if existing is not None and existing is not cls:
        raise ValueError(f"stage type {cls.type_name!r} is registered twice ({existing} and {cls})")
    _stages[cls.type_name] = cls
    return cls


def register_resource(cls: type[Any]) -> type[Any]:
    _resources[cls.type_name] = cls
    return cls


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    importlib.import_module("stages")
    importlib.import_module("flow.resources")
    importlib.import_module("flow.response_store")
    importlib.import_module("flow.pool")
    importlib.import_module("flow.prefix")
    importlib.import_module("flow.agent_store")
    for ep in entry_points(group="flow.stages"):
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not take the server down
            log.warning("could not load stage plugin %s (%s): %s", ep.name, ep.value, exc)


def stage_types() -> dict[str, type[Stage[Any, Any]]]:
    _load()
    return dict(sorted(_stages.items()))


def resource_types() -> dict[str, type[Any]]:
    _load()
    return dict(sorted(_resources.items()))
