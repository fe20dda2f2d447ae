"""One model across ranks (mlx.launch): the shard loader, rank 0's control channel, and the rank's
engine over the mirrored step (``app.engine.step.mirror``)."""
