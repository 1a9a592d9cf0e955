"""Built-in stage types: the boxes a graph wires (registered by :mod:`flow.builtins`).

Lives here: each protocol's entry and exit stages (on ``protocol``), the chat and templating stages, generate
(and its echo stand-in), embeddings, rerank, audio, images, the agents API, model listing and adapters; the base
for stages that use a model (``model_stage``).

Never imports ``viz``, ``flow.serve``, ``flow.builtins`` or ``flow.cli`` (all above it), nor MLX directly: a
stage reaches the device through a model resource. May import ``flow.resources``, ``flow.catalog``,
``flow.graph``, ``runtime`` types and ``protocols``.
"""
