"""Batching engines on the MLX thread: the shared batch core, the text (and native-VLM) and encoder
engines, admission under the KV budget, prefill pacing, per-request channels, stop strings, and the
native VLM's vision-feature cache."""
