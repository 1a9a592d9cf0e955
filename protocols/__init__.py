"""The wire formats, sans-IO: each protocol's request decoded into the IR and the IR encoded as its responses.

Lives here: the IR every stage speaks (``ir``), one module per protocol (OpenAI chat, completions, Responses,
embeddings, audio and speech; Anthropic Messages; Ollama; rerank), their shared pieces (``sse``, ``errors``,
``validation``, ``limits``, ``stops``, ``images``, ``documents``, ``output_format``, ``cache_fields``,
``codec``), and the tool-call and reasoning parsers (``parsers``).

Never imports any other flow package (``flow``, ``stages``, ``runtime``, ``viz``), MLX or trio: bytes and
dicts in, IR out, and back — testable without a server or a model.
"""
