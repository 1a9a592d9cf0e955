"""flow's framework and its shell: graphs, what it knows of models, the resources, the server, the CLI.

Lives here: ``flow.graph`` (the graph spec, contracts, compiler and runner), ``flow.catalog`` (families,
capabilities, local models, fit), ``flow.resources`` (the model with its engine, the pool, caches, stores,
downloads, adapters, the cluster), ``flow.serve`` (the live graph and the HTTP server), ``flow.builtins`` (the
composition root: the one module that knows every stage and resource type), ``flow.cli`` (the commands).

The layers, top to bottom — each imports only those below it (DESIGN.md's order, checked by
``pyproject.toml``'s import-linter contract): ``flow.cli`` → ``flow.builtins`` → ``flow.serve`` → ``viz`` →
``stages`` → ``flow.resources`` → ``flow.catalog`` → ``flow.graph`` → ``runtime`` → ``protocols``.
"""
