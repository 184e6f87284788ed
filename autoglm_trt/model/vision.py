"""What GLM-4.1V's vision encoder needs per image grid, computed on the host in numpy: the patches'
(row, column) coordinates, the learned position embedding resampled to the grid, and the 2-D
rotary tables. They depend on the grid alone (not on the pixels), so a runtime computes them once
per grid size and the encoder graph takes them as inputs.

Input: a grid of ``h x w`` patches (``image.ImageConfig.grid``), the merge size, and the encoder's
position-embedding table ``[S * S, hidden]`` (``S`` = image_size / patch_size) or its head size and
rope theta. Output, for the patches in the processor's order (blocks of ``merge x merge``):

- ``patch_coords``: each patch's (row, column);
- ``resampled_positions``: the table resampled bicubically at each patch's centre, as transformers'
  ``Glm4vVisionEmbeddings`` does with ``grid_sample`` (bicubic, A = -0.75, ``align_corners=False``,
  border padding: each of the 16 taps clamped into the table);
- ``rope_tables``: cos and sin ``[patches, head_dim]`` of the axial 2-D rope (the first quarter of
  the frequencies turned by the row, the second by the column, both halves repeated, as
  ``Glm4vVisionRotaryEmbedding`` lays them out for its non-interleaved ``rotate_half``).
"""

from __future__ import annotations

import numpy as np

CUBIC_A = -0.75  # PyTorch's bicubic convolution constant


def patch_coords(h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """int64 row and column of each patch, in the order the processor emits them."""
    rows = np.arange(h).reshape(h // merge, merge, 1, 1).repeat(w // merge, 2).repeat(merge, 3)
    cols = np.arange(w).reshape(1, 1, w // merge, merge).repeat(h // merge, 0).repeat(merge, 1)
    return rows.transpose(0, 2, 1, 3).reshape(-1), cols.transpose(0, 2, 1, 3).reshape(-1)


def _cubic_weights(t: np.ndarray) -> np.ndarray:
    """The four taps' weights ``[..., 4]`` of a bicubic convolution at fraction ``t``."""
    a = CUBIC_A

    def near(x):  # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):  # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a

    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def resampled_positions(table: np.ndarray, h: int, w: int, merge: int) -> np.ndarray:
    """float32 ``[h * w, hidden]``: the ``[S * S, hidden]`` position table resampled to an ``h x w`` grid."""
    side = int(round(table.shape[0] ** 0.5))
    if side * side != table.shape[0]:
        raise ValueError(f"the position table has {table.shape[0]} rows, not a square number")
    grid = table.reshape(side, side, -1).astype(np.float64)
    rows, cols = patch_coords(h, w, merge)
    y = (rows + 0.5) / h * side - 0.5  # the unnormalized sample point (align_corners=False)
    x = (cols + 0.5) / w * side - 0.5
    y0, x0 = np.floor(y), np.floor(x)
    wy, wx = _cubic_weights(y - y0), _cubic_weights(x - x0)  # [N, 4]
    iy = np.clip(y0[:, None].astype(np.int64) + np.arange(-1, 3), 0, side - 1)  # border padding, per tap
    ix = np.clip(x0[:, None].astype(np.int64) + np.arange(-1, 3), 0, side - 1)
    taps = grid[iy[:, :, None], ix[:, None, :]]  # [N, 4, 4, hidden]
    out = np.einsum("nijd,ni,nj->nd", taps, wy, wx)
    return out.astype(np.float32)


def rope_tables(head_dim: int, theta: float, h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin ``[h * w, head_dim]`` of the encoder's 2-D rope at each patch."""
    spatial = head_dim // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial))))
    rows, cols = patch_coords(h, w, merge)
    freqs = np.concatenate([rows[:, None].astype(np.float32) * inv_freq.astype(np.float32),
                            cols[:, None].astype(np.float32) * inv_freq.astype(np.float32)], axis=1)
    angles = np.concatenate([freqs, freqs], axis=1).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
