"""Decisions (``POST /v1/decisions``): typed questions about an input, answered from a chat
model's distribution. ``request``: the typed request, its answers and the rules that make
them (probability, confidence, score, refusal); ``reading``: the prompts, the rows the engine
scores, and the answers read from their scores. ``Pipeline.decide`` runs them."""
