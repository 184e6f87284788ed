"""An INT8 KV cache's scales: from calibrated ranges per KV head, or made per token as the
rewritten graph (``graph.kv_int8``) makes them. Pure numpy."""

from __future__ import annotations

import numpy as np

AMAX_FLOOR = np.float32(1e-6)  # an all-zero row still gets a finite scale


def kv_scale(amax: np.ndarray) -> np.ndarray:
    return (np.maximum(np.asarray(amax, np.float32), AMAX_FLOOR) / np.float32(127.0)).astype(np.float32)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-token quantization of K or V ``[..., head_dim]`` as the rewritten graph does it: (int8
    rows, float32 scales ``[...]``), x ~ q * scale; half-way values round to even."""
    x = np.asarray(x, np.float32)
    scale = kv_scale(np.abs(x).max(axis=-1))
    return np.clip(np.rint(x / scale[..., None]), -128, 127).astype(np.int8), scale
