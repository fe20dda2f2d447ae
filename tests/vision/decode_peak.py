"""Peak memory of one image decode, in a fresh interpreter (Linux: it reads /proc).

    python -m tests.vision.decode_peak IMAGE_FILE MAX_PIXELS

Prints ``{"rise_mb": ..., "size": [w, h]}``: how far the decode raised the
process's peak RSS above where it stood, and the size of the pixels kept.
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

from app.vision.images import ImagePolicy, decode_image
from tests.vision.sample_images import image_bytes


def _status_kib(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    assert match, field
    return int(match.group(1))


def main() -> None:
    raw = Path(sys.argv[1]).read_bytes()
    max_pixels = int(sys.argv[2]) or None
    for fmt in ("png", "jpeg"):  # load Pillow's plugins before measuring
        decode_image(image_bytes(fmt=fmt), ImagePolicy(), param="warm-up", max_pixels=max_pixels)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    loaded = decode_image(raw, ImagePolicy(), param="image", max_pixels=max_pixels)
    rise_mb = (_status_kib("VmHWM") - before) / 1024
    print(json.dumps({"rise_mb": round(rise_mb, 1), "size": list(loaded.image.size)}))


if __name__ == "__main__":
    main()
