"""The KV cache's tiers and forms: the prefix cache in memory and on disk (file format, snapshots),
and the quantized KV cache mlx-lm's batch generator can batch."""
