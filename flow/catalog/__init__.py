"""What flow knows about a model before loading it.

Lives here: families (``families``, ``bundled``), capabilities (tools, thinking) and data paths
(``capabilities``, ``data_files``), the models on this machine (``local_models``), and whether one fits
(``fit``).

Never imports: ``flow.resources``, ``stages``, ``viz``, ``flow.serve``, ``flow.builtins``, ``flow.cli``.
May import ``flow.graph``, ``runtime`` and ``protocols``.
"""
