"""Rotary position embedding tables, in numpy.

Input: the model's rope parameters. Output: ``cos`` and ``sin`` tables of shape
``[max_positions, rotary_dim // 2]``, computed in float32 the way transformers computes them,
so the exported graph and the reference agree. Supported rope types: ``default``, ``linear``
and ``llama3``.

The graph applies half-split rope to a whole head in four nodes,
``x * cos_full + (x @ P) * sin_full``: the tables widened to ``head_dim`` (cos and sin
repeated for the two halves, then 1 and 0 on the pass-through dimensions) and ``P`` the
signed permutation with ``(x @ P) = [-x2, x1, 0]``. Every product in ``x @ P`` is by 0 or
+-1, so it is exact, and the result equals ``[x1 cos - x2 sin, x2 cos + x1 sin, x3]`` bit
for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    rotary_dim: int
    rope_type: str = "default"
    scaling: dict = field(default_factory=dict)


def inverse_frequencies(rope: RopeSpec, max_position_embeddings: int) -> np.ndarray:
    """Inverse frequencies, one per rotated pair, float32."""
    exponent = np.arange(0, rope.rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rope.rotary_dim)
    inv_freq = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.scaling["factor"])).astype(np.float32)
    if rope.rope_type == "llama3":
        s = rope.scaling
        factor = float(s["factor"])
        low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s.get("original_max_position_embeddings", max_position_embeddings))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise UnsupportedModelError(
        f"rope type '{rope.rope_type}' is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


def cos_sin_tables(rope: RopeSpec, max_positions: int, max_position_embeddings: int) -> tuple[np.ndarray, np.ndarray]:
    """``cos`` and ``sin`` of ``position * inv_freq`` for positions ``0..max_positions-1``."""
    inv_freq = inverse_frequencies(rope, max_position_embeddings)
    positions = np.arange(max_positions, dtype=np.float32)
    angles = np.outer(positions, inv_freq).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def full_width_tables(cos: np.ndarray, sin: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """``[P, rotary_dim // 2]`` tables -> ``[P, head_dim]``: each repeated for both halves, then 1 / 0."""
    rest = head_dim - 2 * cos.shape[1]
    ones, zeros = np.ones((cos.shape[0], rest), np.float32), np.zeros((cos.shape[0], rest), np.float32)
    return np.concatenate([cos, cos, ones], axis=1), np.concatenate([sin, sin, zeros], axis=1)


def rotate_half_matrix(head_dim: int, rotary_dim: int) -> np.ndarray:
    """``P`` with ``x @ P = [-x[r/2:r], x[:r/2], 0...]`` (r = rotary_dim), float32 entries 0 / +-1."""
    half = rotary_dim // 2
    p = np.zeros((head_dim, head_dim), np.float32)
    for j in range(half):
        p[j + half, j] = -1.0
        p[j, j + half] = 1.0
    return p


def interleaved_to_half_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """Permutation of one head's dimensions that turns interleaved-pair rope into half rope.

    GLM rotates pairs ``(0,1), (2,3), ...`` of the first ``rotary_dim`` dimensions; Llama rotates
    pairs ``(i, i + rotary_dim/2)``. Reordering the rows of W_q and W_k by this permutation
    (evens first, then odds, then the pass-through dimensions) makes the two identical, and
    leaves q·k unchanged because both sides are permuted alike.
    """
    order = list(range(0, rotary_dim, 2)) + list(range(1, rotary_dim, 2)) + list(range(rotary_dim, head_dim))
    return np.asarray(order, dtype=np.int64)
