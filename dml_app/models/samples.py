"""How shards and the global test set store samples: images read from bytes (every value
k/255) are kept as uint8, a quarter of float32's size, and scaled back when a node loads them.
Any other samples stay as they are."""
from __future__ import annotations

import numpy as np

SCALE = 255.0


def pack(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) as stored: uint8 when every value is exactly k/255 for an integer k in
    0..255 (``unpack`` gives back the same float32 values), else ``x`` unchanged."""
    if x.dtype != np.float32 or x.size == 0:
        return x
    scaled = np.rint(x.astype(np.float64) * SCALE)
    if scaled.min() < 0 or scaled.max() > SCALE:
        return x
    packed = scaled.astype(np.uint8)
    return packed if np.array_equal(unpack(packed), x) else x


def unpack(x: np.ndarray) -> np.ndarray:
    """Stored samples as a model takes them: uint8 scaled to float32 in [0, 1], others as they are."""
    return (x / SCALE).astype(np.float32) if x.dtype == np.uint8 else x
