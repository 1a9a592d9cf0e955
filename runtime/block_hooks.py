"""A callback after each of a model's repeated blocks: a long forward pass computed block by block, with work run
between two blocks (the embedder serves a one-sentence request that arrived during a 2,000-input job's pass
there, instead of after the pass).

MLX builds a forward pass lazily and computes it at the end; the callback may evaluate the block's output to
compute the pass so far. The blocks are found as the model's longest list of modules (a BERT encoder's
``encoder.layer``, a decoder's ``model.layers``), and each is given a subclass of its own class whose call runs
the callback after the block: the parameter tree, the checkpoint's names and ``isinstance`` stay as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx.nn.layers.base import Module

AfterBlock = Callable[[Any], None]  # the block's output (an array, or a tuple of them)

_HOOKED: dict[type[Module], type[Module]] = {}


def model_blocks(model: Module) -> list[Module]:
    """The model's repeated blocks: its longest list of modules (none if it has no list of two or more)."""
    best: list[Module] = []

    def walk(value: Any) -> None:
        nonlocal best
        if isinstance(value, Module):
            for child in value.values():
                walk(child)
        elif isinstance(value, (list, tuple)):
            modules = [item for item in value if isinstance(item, Module)]
            if len(modules) == len(value) and len(modules) > max(1, len(best)):
                best = modules
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    walk(model)
    return best


def _hooked(cls: type[Module]) -> type[Module]:
    """``cls`` with a call that runs the instance's ``_after_block`` on the output (one subclass per class)."""
    if cls not in _HOOKED:
        class Hooked(cls):  # type: ignore[valid-type,misc]  # a class known at run time
            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                out = super().__call__(*args, **kwargs)
                self._after_block(out)
                return out

        Hooked.__name__, Hooked.__qualname__, Hooked.__module__ = cls.__name__, cls.__qualname__, cls.__module__
        _HOOKED[cls] = Hooked
    return _HOOKED[cls]


def after_each_block(model: Module, callback: AfterBlock) -> int:
    """Run ``callback(output)`` after each of the model's blocks from now on; the number of blocks hooked."""
    blocks = model_blocks(model)
    for block in blocks:
        if type(block) not in _HOOKED.values():
            block.__class__ = _hooked(type(block))
        block._after_block = callback  # an attribute, not a parameter (Module keeps arrays and modules apart)
    return len(blocks)
