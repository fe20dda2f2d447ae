"""Anthropic's Messages API: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

``protocol`` holds the pydantic request models and their mapping onto the
pipeline's typed request; ``messages`` holds the routes, the rendering of the
pipeline's results as Anthropic's content blocks and stream events, and the
error renderer that gives every error on these routes Anthropic's shape.
"""
