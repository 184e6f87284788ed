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

from dataclasses import asdict, dataclass, fields

import numpy as np

CUBIC_A = -0.75  # PyTorch's bicubic convolution constant
RESAMPLE_CHUNK = 256  # patches resampled at once (their taps: 256 x 16 x hidden float64, 50 MB at 1536)


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
    out = np.empty((len(rows), grid.shape[2]), np.float32)
    for a in range(0, len(rows), RESAMPLE_CHUNK):  # [N, 4, 4, hidden] float64 at once is GBs for a screenshot
        z = min(a + RESAMPLE_CHUNK, len(rows))
        taps = grid[iy[a:z, :, None], ix[a:z, None, :]]
        out[a:z] = np.einsum("nijd,ni,nj->nd", taps, wy[a:z], wx[a:z])
    return out


def rope_tables(head_dim: int, theta: float, h: int, w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos and sin ``[h * w, head_dim]`` of the encoder's 2-D rope at each patch."""
    spatial = head_dim // 2
    inv_freq = (1.0 / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial))))
    rows, cols = patch_coords(h, w, merge)
    freqs = np.concatenate([rows[:, None].astype(np.float32) * inv_freq.astype(np.float32),
                            cols[:, None].astype(np.float32) * inv_freq.astype(np.float32)], axis=1)
    angles = np.concatenate([freqs, freqs], axis=1).astype(np.float32)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@dataclass(frozen=True)
class VisionSpec:
    """What the runtime needs of a GLM-4.1V vision tower beside its graph: the encoder's head size
    and rope theta (for ``rope_tables``), the merge size, and the image token ids of the prompt."""

    hidden_size: int  # the encoder's width (its position table's)
    head_dim: int
    rope_theta: float
    merge_size: int
    patch_size: int
    temporal_patch_size: int
    out_hidden: int  # the decoder's hidden size: what each image token's embedding is
    image_token_id: int
    image_start_token_id: int
    image_end_token_id: int

    @classmethod
    def from_config(cls, config: dict) -> VisionSpec:
        """From a glm4v ``config.json`` (``UnsupportedModelError`` if a field is missing or malformed)."""
        from ..errors import UnsupportedModelError

        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            raise UnsupportedModelError("a glm4v config.json needs a vision_config object")
        rope = vision["rope_parameters"] if isinstance(vision.get("rope_parameters"), dict) else {}
        raw = {"hidden_size": vision.get("hidden_size"), "num_heads": vision.get("num_heads"),
                  "spatial_merge_size": vision.get("spatial_merge_size", 2), "patch_size": vision.get("patch_size", 14),
                  "temporal_patch_size": vision.get("temporal_patch_size", 2),
                  "out_hidden_size": vision.get("out_hidden_size"),
                  **{k: config.get(k) for k in ("image_token_id", "image_start_token_id", "image_end_token_id")}}
        for key, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UnsupportedModelError(f"config.json {key} must be a non-negative integer, got {value!r}")
        if not raw["num_heads"] or raw["hidden_size"] % raw["num_heads"]:
            raise UnsupportedModelError(f"vision_config hidden_size {raw['hidden_size']} is not a multiple of "
                                        f"num_heads {raw['num_heads']}")
        return cls(raw["hidden_size"], raw["hidden_size"] // raw["num_heads"], float(rope.get("rope_theta", 10000.0)),
                   raw["spatial_merge_size"], raw["patch_size"], raw["temporal_patch_size"],
                   raw["out_hidden_size"], raw["image_token_id"], raw["image_start_token_id"],
                   raw["image_end_token_id"])

    def max_patches(self, max_pixels: int) -> int:
        """The most patches an image resized within ``max_pixels`` has (``image.smart_resize`` counts
        each pixel ``temporal_patch_size`` times)."""
        return max(self.merge_size ** 2, max_pixels // (self.temporal_patch_size * self.patch_size ** 2))

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> VisionSpec:
        """As ``to_json`` wrote it (KeyError: a field is missing; ValueError: one is not an integer
        >= 1, >= 0 for a token id, or for ``rope_theta`` a number > 0)."""
        values = {f.name: data[f.name] for f in fields(cls)}
        for name, v in values.items():
            if name == "rope_theta":
                ok, want = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf"), "a number > 0"
            else:
                least = 0 if name.endswith("_id") else 1
                ok, want = isinstance(v, int) and not isinstance(v, bool) and v >= least, f"an integer >= {least}"
            if not ok:
                raise ValueError(f"{name} must be {want}, got {repr(v)[:80]}")
        return cls(**values)
