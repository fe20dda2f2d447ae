"""Batching engines on the MLX thread: the shared batch core, the text, native-VLM and encoder engines,
admission under the KV budget, prefill pacing, per-request channels, samplers, stop strings, reasoning
budgets, and the native VLM's vision-feature cache."""
