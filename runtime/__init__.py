"""Everything that owns the device: the one device thread and what runs on it.

Lives here, by job:

- the device thread (``device``, ``sliced_jobs``, ``blas_threads``, ``cpu_activations``);
- finding and loading models (``models``, ``model_kinds``, ``model_memory``, ``gguf_*``, ``errors``);
- the generation engine, one step at a time in phases (``engine``; the schedule ``step_phases``; the phases'
  collaborators ``prefill``, ``decode``, ``speculative_step``, ``outbox``; the state they share ``sequence``;
  the model's passes ``passes``; settings and counters ``engine_config``, ``engine_stats``);
- sampling and structured output (``sampling``, ``constrained``, ``detokenizers``);
- speculative decoding (``speculative``, ``mtp``, ``mtp_checkpoint``, ``recurrent_rollback``, ``pass_cost``);
- the prefix cache and its disk tier (``prefix_cache``, ``kv_disk``, ``prefix_keeper`` — the engine's side —,
  ``cache_surgery`` — the one place that knows mlx-lm's cache classes —, ``quantized_kv``, ``private_files``);
- the other model kinds (``vision``, ``image_spans``, ``embeddings``, ``embedding_profile``, ``audio``,
  ``speech_batch``), LoRA (``adapters``), mlx.distributed (``distributed``, ``replication``, ``rank``);
- ``runtime.tiny``: the smoke-test model builders (tests and demos), which the engine, its collaborators, the
  device thread and the caches never import (an import-linter contract).

Never imports ``flow``, ``stages`` or ``viz``: the layers above reach the device through the model resource.
May import ``protocols`` (the IR types).
"""
