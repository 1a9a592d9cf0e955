"""Built-in stage types (registered by :mod:`flow.builtins`)."""
