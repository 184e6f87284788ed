"""Where images sit in a GLM-4.1V prompt, and the 3-D positions (M-RoPE) of its tokens.

Input: the prompt's token ids with one ``<|image|>`` placeholder per image (as the chat template
renders an image part, between ``<|begin_of_image|>`` and ``<|end_of_image|>``) and each image's
patch grid (``image.ImageConfig.grid``). Output:

- ``expand``: the ids with each placeholder repeated once per image token (``t * h * w / merge**2``,
  as transformers' ``Glm4vProcessor`` does), and each image's span ``[start, end)`` in them;
- ``mrope_positions``: positions ``[3, tokens]`` (temporal, height, width) as transformers'
  ``Glm4vModel.get_rope_index`` computes them for images: text tokens count on from the largest
  position so far + 1 in all three rows; an image's tokens take the position where it starts in the
  temporal row and start + row / start + column of its merged grid in the other two; the text after
  it continues from start + max(merged height, merged width). ``delta`` (the largest position + 1
  minus the prompt's length) carries the positions into decode: generated token i of a prompt of n
  tokens has position ``n + i + delta`` in all three rows.
- ``block_extras``: for each KV block the prompt touches, its last partial block included, the
  digests of the images whose tokens it covers and where they start (the prefix cache's extra keys, as vLLM names them:
  the same tokens over another image must not share a block). The partial block is named only
  once decode fills it, and then it still holds image tokens; every later block chains from it,
  so equal keys mean equal images before and within a block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import RequestError


@dataclass(frozen=True)
class ImageSpan:
    start: int  # the first of the image's tokens in the expanded prompt
    end: int  # one past the last
    grid: tuple[int, int, int]  # (t, h, w) in patches, before the merge
    digest: bytes  # the image's content hash (``image_digest``)


def image_digest(pixels: np.ndarray, grid: Sequence[int]) -> bytes:
    """A content hash of one image (its pixels, their dtype and shape, and its grid), 16 bytes."""
    arr = np.ascontiguousarray(pixels)
    h = hashlib.blake2b(np.asarray([*grid, *arr.shape], np.int64).tobytes() + arr.dtype.str.encode(), digest_size=16)
    h.update(arr.data)
    return h.digest()


def tokens_of(grid: Sequence[int], merge: int) -> int:
    t, h, w = (int(g) for g in grid)
    return t * (h // merge) * (w // merge)


def expand(ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], digests: Sequence[bytes],
           merge: int) -> tuple[list[int], list[ImageSpan]]:
    """``ids`` with the k-th ``image_token_id`` repeated once per token of image k; ``RequestError``
    when the prompt's placeholders and the images do not pair up."""
    places = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(places) != len(grids):
        raise RequestError(f"the prompt has {len(places)} image placeholder(s) but {len(grids)} image(s) came with "
                           "it; each image part of a message becomes one placeholder")
    out: list[int] = []
    spans: list[ImageSpan] = []
    last = 0
    for place, grid, digest in zip(places, grids, digests):
        out.extend(ids[last:place])
        n = tokens_of(grid, merge)
        spans.append(ImageSpan(len(out), len(out) + n, tuple(int(g) for g in grid), digest))  # type: ignore[arg-type]
        out.extend([image_token_id] * n)
        last = place + 1
    out.extend(ids[last:])
    return out, spans


def mrope_positions(num_tokens: int, spans: Sequence[ImageSpan], merge: int) -> tuple[np.ndarray, int]:
    """int64 ``[3, num_tokens]`` positions of a prompt whose images sit at ``spans``, and its delta."""
    out = np.zeros((3, num_tokens), np.int64)
    at = pos = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.start < at:
            raise ValueError("image spans overlap")
        text = span.start - at
        out[:, at:span.start] = pos + np.arange(text)
        pos += text
        t, h, w = span.grid[0], span.grid[1] // merge, span.grid[2] // merge
        if t * h * w != span.end - span.start:
            raise ValueError(f"an image span of {span.end - span.start} tokens for a grid of {t * h * w}")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        out[0, span.start:span.end] = tt.reshape(-1) + pos
        out[1, span.start:span.end] = hh.reshape(-1) + pos
        out[2, span.start:span.end] = ww.reshape(-1) + pos
        pos += max(h, w)
        at = span.end
    out[:, at:] = pos + np.arange(num_tokens - at)
    top = int(out.max()) + 1 if num_tokens else 0
    return out, top - num_tokens


def block_extras(num_tokens: int, spans: Sequence[ImageSpan], block_size: int) -> list[bytes]:
    """For each block of ``num_tokens``, the last partly filled one included: the images it covers,
    each as its digest and where it starts relative to the block, joined (b"" for a block of text
    alone)."""
    extras = []
    for b in range(-(-num_tokens // block_size)):
        lo, hi = b * block_size, (b + 1) * block_size
        extras.append(b"".join(s.digest + (s.start - lo).to_bytes(8, "little", signed=True)
                               for s in spans if s.start < hi and s.end > lo))
    return extras
