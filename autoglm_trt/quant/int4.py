"""INT4 weights in blocks along the input: quantization and ONNX's packing (the graph's
DequantizeLinear of them is ``graph.qdq.int4_weight_dq``).

A ``[in, out]`` weight gets one scale (and, asymmetric, one 4-bit zero point) per ``block``
inputs of each output; ``w ≈ (q - zero) * scale``. Symmetric: q in [-7, 7] as ``int4``, no zero
point (TensorRT's block-quantized INT4 takes no other). Asymmetric: q in [0, 15] as ``uint4``
with a zero point per block. Each block's range is clipped by the factor of ``CLIPS`` with the
least squared error. Every block scale (these and ``quant/int8.py``'s 8-bit ones) is a float16
value held in float32 (``half_scales``): the native operators read them as float16 and compute
what the graph does. ONNX stores 4-bit tensors two to a byte, the first element in the low
nibble; ONNX Runtime turns the DequantizeLinear + MatMul into its 4-bit ``MatMulNBits``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)
CHUNK = 1 << 18  # weights of a ``block_params`` chunk (1 MiB of float32)
HALF_RANGE = (2.0 ** -24, 65504.0)  # float16's smallest and largest positive values


def half_scales(scale: np.ndarray) -> np.ndarray:
    """Positive float32 block scales rounded to the nearest float16 value (ties to even), within
    float16's positive range: float32 numbers that float16 holds exactly."""
    return np.clip(np.asarray(scale, np.float32), *HALF_RANGE).astype(np.float16).astype(np.float32)


@dataclass(frozen=True)
class Int4Blocks:
    """A quantized ``[in, out]`` weight: ``q`` int8 values ``[in, out]`` (-7..7, or 0..15 with
    zero points), ``scale`` float32 ``[blocks, out]``, ``zero`` uint8 ``[blocks, out]`` or None."""

    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray | None
    block: int

    def dequantized(self) -> np.ndarray:
        """``(q - zero) * scale`` as float32 ``[in, out]``."""
        n_in, n_out = self.q.shape
        if n_in % self.block:
            zero = 0 if self.zero is None else np.repeat(self.zero.astype(np.float32), self.block, axis=0)[:n_in]
            return ((self.q.astype(np.float32) - zero) * np.repeat(self.scale, self.block, axis=0)[:n_in]).astype(
                np.float32)
        out = self.q.astype(np.float32).reshape(-1, self.block, n_out)  # whole blocks: broadcast, no repeat
        if self.zero is not None:
            out -= self.zero.astype(np.float32)[:, None, :]
        out *= self.scale[:, None, :]
        return out.reshape(n_in, n_out)


def quantize_int4_blocks(w: np.ndarray, block: int, symmetric: bool) -> Int4Blocks:
    """``w`` ``[in, out]`` to INT4 in blocks of ``block`` inputs (the last block may be shorter)."""
    n_in, n_out = w.shape
    blocks = -(-n_in // block)
    padded = np.zeros((blocks * block, n_out), np.float32)
    padded[:n_in] = w
    grouped = padded.reshape(blocks, block, n_out)
    if n_in % block:  # padding rows repeat a real row of the last block, so they widen no range
        grouped[-1, n_in % block:] = grouped[-1, :1]
    scale, zero = block_params(grouped, symmetric)
    q = round_to_grid(grouped, scale, zero, symmetric).astype(np.int8).reshape(-1, n_out)[:n_in]
    return Int4Blocks(q, scale, None if symmetric else zero.astype(np.uint8), block)


def _scale_zero(lo: np.ndarray, hi: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    if symmetric:
        amax = np.maximum(np.abs(lo), np.abs(hi))
        return half_scales(np.where(amax > 0, amax / np.float32(7.0), np.float32(1.0))), np.zeros_like(lo)
    lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)  # the range holds 0, so zero is a level
    scale = half_scales(np.where(hi > lo, (hi - lo) / np.float32(15.0), np.float32(1.0)))
    return scale, np.clip(np.rint(-lo / scale), 0, 15).astype(np.float32)


def round_to_grid(grouped: np.ndarray, scale: np.ndarray, zero: np.ndarray, symmetric: bool) -> np.ndarray:
    """The levels (float32) of weights ``[..., inputs, out]`` on their blocks' grids (``scale``,
    ``zero``: ``[..., out]``), rounded half to even and clipped."""
    q = np.rint(grouped / scale[..., None, :]) + zero[..., None, :]
    return np.clip(q, -7, 7) if symmetric else np.clip(q, 0, 15)


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """ONNX's 4-bit layout of ``values`` (int8 -8..7 or 0..15, any shape, row-major): two to a
    byte, the first in the low nibble, an odd count padded with a zero nibble."""
    flat = (values.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    return (flat[0::2] | (flat[1::2] << 4)).astype(np.uint8)


def block_params(grouped: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each block's scale (``half_scales``) and zero point (0 when symmetric, else 0..15, as float32) for
    float32 weights ``[..., inputs of a block, out]``: the range (holding 0 when asymmetric)
    clipped by the factor of ``CLIPS`` with the least squared error, ties to the larger factor.
    Worked ``CHUNK`` weights at a time, in place: each output's blocks are independent."""
    grouped = np.asarray(grouped, np.float32)
    n_out = grouped.shape[-1]
    scale = np.empty(grouped.shape[:-2] + (n_out,), np.float32)
    zero = np.empty_like(scale)
    cols = max(1, CHUNK // max(1, grouped[..., 0].size))
    for c0 in range(0, n_out, cols):
        part = np.ascontiguousarray(grouped[..., c0:c0 + cols])
        scale[..., c0:c0 + cols], zero[..., c0:c0 + cols] = _block_params(part, symmetric)
    return scale, zero


def _block_params(grouped: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """``block_params`` of a contiguous chunk: per clip, the levels and their squared error in one buffer."""
    lo, hi = grouped.min(axis=-2), grouped.max(axis=-2)
    t = np.empty_like(grouped)
    best: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    bounds = (-7, 7) if symmetric else (0, 15)
    for clip in CLIPS:
        scale, zero = _scale_zero(np.float32(clip) * lo, np.float32(clip) * hi, symmetric)
        s, z = scale[..., None, :], zero[..., None, :]
        np.divide(grouped, s, out=t)
        np.rint(t, out=t)
        np.add(t, z, out=t)
        np.clip(t, *bounds, out=t)
        np.subtract(t, z, out=t)
        np.multiply(t, s, out=t)
        np.subtract(t, grouped, out=t)
        np.square(t, out=t)
        err = np.sum(t, axis=-2)
        if best is None:
            best = (scale, zero, err)
        else:
            better = err < best[2]
            best = (np.where(better, scale, best[0]), np.where(better, zero, best[1]), np.where(better, err, best[2]))
    assert best is not None
    return best[0].astype(np.float32), best[1].astype(np.float32)
