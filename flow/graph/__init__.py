"""The framework core: what a graph is and how one request runs through it.

Lives here: the graph spec (``spec``), the stage and resource contracts (``stage``, ``resource``), the
registry of type names, the compiler and the compiled-graph types (``compiler``, ``compiled``), which
stages of a route run inline in their producer's task (``inline``), the per-request runner, the metric types resources report, and bounded child processes for work a request
brings (``isolation``).

Never imports: ``flow.catalog``, ``flow.resources``, ``stages``, ``viz``, ``flow.serve``, ``flow.builtins``,
``flow.cli`` — nor MLX: compiling and checking a graph stays fast. May import ``runtime`` types and
``protocols``.
"""
