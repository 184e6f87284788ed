"""Symmetric INT8: activation scales, weights per output channel or in blocks of inputs, and the
token embedding's rows as a weight-only LM head quantizes them. Pure numpy; every block scale is a
float16 value held in float32 (``int4.half_scales``)."""

from __future__ import annotations

import numpy as np

from .int4 import half_scales
from .plan import WEIGHT_BLOCK

# clips of a block's absolute max tried for its scale (least squared error wins): SmolLM2 int8-wo
# answers more chat prompts as fp32 does with the clip than with the max alone (docs/native.md)
CLIPS = (1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.91, 0.90)


def act_scale(amax: float) -> float:
    """Symmetric INT8 scale of an activation whose calibrated absolute max is ``amax``."""
    return max(float(amax), 1e-8) / 127.0


def quantize_weight_per_channel(w: np.ndarray, half_values: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel INT8 of a ``[in, out]`` matrix: (int8 weights, float32 scales).
    ``half_values`` (a weight-only plan's ``int8_channels``): each scale rounded to a float16 value
    first (``int4.half_scales``), so that a float16 graph stores the scales the weights were rounded with."""
    amax = np.max(np.abs(w), axis=0).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    if half_values:
        scale = half_scales(scale)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def quantize_weight_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 of a ``[in, out]`` matrix with one scale per ``block`` inputs of each output
    (the last block may be shorter): (int8 weights ``[in, out]``, float32 scales ``[blocks, out]``).
    Each block's scale is ``c * amax / 127`` rounded to a float16 value (``int4.half_scales``), with
    the clip ``c`` of ``CLIPS`` that gives the least squared error over the block (ties: the larger ``c``)."""
    n_in, n_out = w.shape
    blocks = -(-n_in // block)
    padded = np.zeros((blocks * block, n_out), np.float32)
    padded[:n_in] = w
    grouped = padded.reshape(blocks, block, n_out)
    amax = np.max(np.abs(grouped), axis=1)
    best_scale = best_err = None
    for clip in CLIPS:
        scale = half_scales(np.where(amax > 0, np.float32(clip) * amax / np.float32(127.0), np.float32(1.0)))
        q = np.clip(np.rint(grouped / scale[:, None]), -127, 127)
        err = np.sum(np.square(q * scale[:, None] - grouped, dtype=np.float32), axis=1)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale, best_err = np.where(better, scale, best_scale), np.where(better, err, best_err)
    assert best_scale is not None
    q = np.clip(np.rint(grouped / best_scale[:, None]), -127, 127).astype(np.int8).reshape(-1, n_out)[:n_in]
    return q, best_scale.astype(np.float32)


def embedding_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Embedding rows ``[n, hidden]`` as a weight-only LM head quantizes them (one scale per
    ``WEIGHT_BLOCK`` of a row's values, ``quantize_weight_blocks``): (int8 ``[n, hidden]``, float32
    scales ``[n, hidden / WEIGHT_BLOCK, 1]``). A tied model's embedding and head get the same values."""
    q, scale = quantize_weight_blocks(np.asarray(rows, np.float32).T, WEIGHT_BLOCK)
    return np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)[:, :, None]
