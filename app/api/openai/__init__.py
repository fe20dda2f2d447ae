"""OpenAI's wire formats: chat completions and text completions.

``protocol`` holds the pydantic request models; each endpoint module parses its
body into the pipeline's typed request and renders the pipeline's results as
OpenAI's chunks and responses.
"""
