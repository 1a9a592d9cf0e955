"""The resource contract: a config model, declared references, a lifetime.

Theory of operation
-------------------
A resource is a long-lived thing a graph declares under ``[resources.ID]``: a
loaded model, a cache, a store, a pool. Requests never own one; stages and
other resources refer to it by id.

A resource class declares, as class attributes, everything the compiler needs
without building it: its registry ``type_name``, its ``Config`` model (unknown
keys are errors) and its ``references``: which config fields name other
resources, of which type (:class:`Reference`). The compiler resolves every
reference — unknown ids, wrong types, a model claimed by two caches, cycles —
before anything is built; nothing ever discovers another resource at run time.

A reference either **uses** its target (an agent store uses a prefix cache: the
target is built first and handed to the constructor in :class:`Links`) or
**serves** it (a prefix cache serves models: the server is built first, and
when each served resource is built, the server's :meth:`Resource.serve` is
called with it; :meth:`Resource.release` when that resource closes).

Stages declare their references the same way (``Stage.references``); for them
every reference is a use.

Lifetime: built (config validated) → :meth:`start` (load, open files) →
serving, with :meth:`run` as a background duty → :meth:`close` after the last
request that could use it. A live reload keeps a resource whose type, config
and links did not change, so a loaded model or a warm cache survives it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from flow.graph.metrics import Metric
    from runtime.device import DeviceThread

R = TypeVar("R", bound="Resource")


class ResourceConfig(BaseModel):
    """Base for resource config models: unknown keys are errors, values are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Reference:
    """A config field that names other resources.

    With no id written, a ``many`` reference takes every resource of its kind in the graph, a single one
    the graph's only resource of its kind (naming one is required when there are several). ``required``:
    finding none is an error. ``serves``: the referrer serves its targets (built first, see the module
    docstring). ``exclusive``: a target may be named by only one resource of the referrer's type (a model
    has one prefix cache, one pool)."""

    kind: str
    many: bool = False
    required: bool = True
    serves: bool = False
    exclusive: bool = False
    implicit: bool = True  # with no id written, take the default above (False: link nothing)

    def describe(self) -> str:
        ids = f"ids of {self.kind!r} resources" if self.many else f"the id of a {self.kind!r} resource"
        default = "all of them" if self.many else "the graph's only one"
        role = "serves" if self.serves else "uses"
        return f"{role} {ids} (default: {default}{'' if self.required else ', or none'})"


class Links:
    """The resources a graph links to one stage or resource, as the compiler resolved its references."""

    def __init__(self, by_field: Mapping[str, tuple[Resource, ...]] | None = None,
                 served_by: Iterable[Resource] = ()) -> None:
        self._by_field = dict(by_field or {})
        self.served_by = tuple(served_by)  # resources whose ``serves`` reference names this one

    def many(self, field: str, cls: type[R]) -> tuple[R, ...]:
        found = self._by_field.get(field, ())
        for resource in found:
            if not isinstance(resource, cls):  # the compiler checked kinds; this is a programming error
                raise TypeError(f"{field}: {resource!r} is not a {cls.__name__}")
        return found  # type: ignore[return-value]

    def optional(self, field: str, cls: type[R]) -> R | None:
        found = self.many(field, cls)
        return found[0] if found else None

    def one(self, field: str, cls: type[R]) -> R:
        found = self.optional(field, cls)
        if found is None:
            raise LookupError(f"{field}: no resource linked (the compiler requires one)")
        return found

    def ids(self) -> dict[str, tuple[str, ...]]:
        return {name: tuple(r.id for r in found) for name, found in self._by_field.items()}


class Resource:
    """Base of every resource type. Subclasses set ``type_name``, ``Config``, ``description`` and, if
    they name other resources, ``references``; they override the lifetime methods they need."""

    type_name: ClassVar[str]
    Config: ClassVar[type[ResourceConfig]] = ResourceConfig
    references: ClassVar[Mapping[str, Reference]] = {}
    description: ClassVar[str] = ""

    def __init__(self, resource_id: str, config: ResourceConfig, links: Links) -> None:
        self.id = resource_id
        self.config = config
        self.links = links

    @classmethod
    def link_problems(cls, config: ResourceConfig, linked: Mapping[str, tuple[ResourceConfig, ...]]
                      ) -> list[tuple[str, str, str]]:
        """What is wrong between this resource's config and those of the resources it links (by reference
        field): ``(field, problem, hint)`` triples the compiler reports. Nothing, unless a type says otherwise."""
        return []

    async def start(self, device: DeviceThread) -> None:
        """Make it ready (load weights, open files) before requests arrive."""

    async def run(self) -> None:
        """A background duty while it serves (sweeping, idle unloading); cancelled when it closes."""

    def serve(self, target: Resource) -> None:
        """``target`` (named by one of this resource's ``serves`` references) was built; take it in."""

    def release(self, target: Resource) -> None:
        """``target`` (which this resource served) is closing."""

    def close(self) -> None:
        """Give back what it holds (flush files); called once, after its last request, when the server stops."""

    async def retire(self) -> None:
        """Closed by a live reload (the new graph no longer has it, or has it changed): give back
        everything, memory included, since the server goes on."""
        self.close()

    def stats(self) -> dict[str, Any] | None:
        """Numbers for ``/stats`` (None: nothing to show)."""
        return None

    def metrics(self) -> list[Metric]:
        """Extra series for ``/metrics``."""
        return []

    def health(self) -> dict[str, Any] | None:
        """A line for ``/health`` (None: not shown there); must not reveal paths (``/health`` needs no key)."""
        return None
