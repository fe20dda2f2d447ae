"""One model across ranks (mlx.launch): the shard loader, rank 0's control channel, and the batch and
prompt-cache operations mirrored on every rank."""
