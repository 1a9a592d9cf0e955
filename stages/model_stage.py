"""The base of every stage that serves requests with the graph's models.

Its ``models`` reference names the model resources it may use (``models = ["qwen", "embedder"]`` in the
graph, checked by the compiler), and ``self.models`` is their :class:`~flow.resources.model.ModelSet`,
looked up once when the stage is made.
"""

from __future__ import annotations

from typing import TypeVar

from flow.graph.stage import Stage
from flow.resources.model import MODEL_REFERENCES, ModelResource, ModelSet

In = TypeVar("In")
Out = TypeVar("Out")


class ModelStage(Stage[In, Out]):
    """A stage with models: ``self.models``."""

    references = MODEL_REFERENCES
    models: ModelSet

    def setup(self) -> None:
        super().setup()
        self.models = ModelSet(self.links.many("models", ModelResource))
