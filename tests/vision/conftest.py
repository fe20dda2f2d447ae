"""Vision tests run offline: mlx-vlm and transformers must never reach the Hub."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
