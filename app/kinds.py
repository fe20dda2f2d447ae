"""The kinds of value models.yaml and the engine share: dtypes, quantizations, KV bits,
how a model splits over ranks, which prefixes the prefix cache keeps.

A leaf: ``app.config`` (the schema) and ``app.engine`` (its frozen params) both name
these, and neither imports the other (``app/specs.py`` maps one onto the other).
"""

from __future__ import annotations

from typing import Literal

Dtype = Literal["float16", "bfloat16", "float32"]
Quantization = Literal["q4", "q8"]
KVBits = Literal[4, 8]
Distributed = Literal["tensor", "pipeline"]
PromptCacheMode = Literal["off", "system", "first_message", "prefix"]
