"""Batching engines on the MLX thread: the shared batch core, the text, native-VLM and encoder engines,
admission under the KV budget, per-request channels, samplers and stop strings."""
