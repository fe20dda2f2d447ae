"""The engine: everything that runs on MLX, behind one thread.

    worker.py         the one thread that makes every MLX call
    registry.py       every served model by name, loaded on demand under one memory budget; typed leases
    roles.py          the table of roles: each role's handle class, loader and memory rule
    params.py         the frozen parameters config maps models.yaml into
    types.py          what passes between the pipeline and the engine (requests, deltas, records)
    prompt.py         the one prompt type: TokenPrompt | MultimodalPrompt, and the completion budget
    mlx_internals.py  every private mlx-lm / mlx-vlm / mlx-embeddings API, in one place
    batch/            the batching engines (text, native VLM, encoders), admission, channels, sampling
    kv/               the prefix cache's memory and disk tiers, and the quantized KV cache
    models/           where weights come from and how each kind of model loads
    distributed/      one model across ranks: shards, rank 0's control channel, mirrored batch steps
    constrain/        constrained decoding: grammars and their per-sequence matchers

Nothing here imports the API layer, the pipeline, Litestar or pydantic (tests/test_layering.py).
"""
