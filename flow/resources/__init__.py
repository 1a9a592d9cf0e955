"""The ``[resources.*]`` types a graph declares: long-lived things requests never own.

Lives here: the model resource with its engine (``model``), the model pool, the prefix cache resource
(``prefix_cache``), the Responses and agents stores, downloads, LoRA adapters, the mlx.distributed
cluster, and the heap freeze after a load (``heap``).

Never imports: ``stages``, ``viz``, ``flow.serve``, ``flow.builtins``, ``flow.cli``. May import
``flow.catalog``, ``flow.graph``, ``runtime`` and ``protocols``.
"""
