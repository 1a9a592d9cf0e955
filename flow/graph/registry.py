"""The registry of stage and resource types, by short name.

Graph files name types (``type = "chat.prepare"``); they never import dotted
paths. A :class:`Registry` is a plain table: it imports no stage or resource
module itself, so nothing imports it back in a cycle. :mod:`flow.builtins`
fills the default one with the built-in types; plugins add theirs through the
``flow.stages`` entry-point group, each entry naming a stage or resource class.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

from flow.graph.resource import Resource
from flow.graph.stage import Stage

log = logging.getLogger("flow.graph.registry")

PLUGIN_GROUP = "flow.stages"


class Registry:
    """Stage and resource types by ``type_name``; a name registered twice is an error."""

    def __init__(self) -> None:
        self._stages: dict[str, type[Stage[Any, Any]]] = {}
        self._resources: dict[str, type[Resource]] = {}

    def add(self, cls: type[Stage[Any, Any]] | type[Resource]) -> None:
        table: dict[str, Any] = self._stages if issubclass(cls, Stage) else self._resources
        existing = table.get(cls.type_name)
        if existing is not None and existing is not cls:
            raise ValueError(f"type {cls.type_name!r} is registered twice ({existing} and {cls})")
        table[cls.type_name] = cls

    def load_plugins(self) -> None:
        """Add the classes the ``flow.stages`` entry points name; a broken plugin is logged, not fatal."""
        for ep in entry_points(group=PLUGIN_GROUP):
            try:
                loaded = ep.load()
                if not (isinstance(loaded, type) and issubclass(loaded, (Stage, Resource))):
                    raise TypeError(f"{ep.value} is not a Stage or Resource class")
                self.add(loaded)
            except Exception as exc:  # a broken plugin must not take the server down
                log.warning("could not load plugin %s (%s): %s", ep.name, ep.value, exc)

    @property
    def stages(self) -> dict[str, type[Stage[Any, Any]]]:
        return dict(sorted(self._stages.items()))

    @property
    def resources(self) -> dict[str, type[Resource]]:
        return dict(sorted(self._resources.items()))
