"""Optimization-profile shapes of the engine contract (pure; no TensorRT needed).

Two profiles, as TensorRT wants one per regime:

* prefill: 1..max_batch sequences of 1..max_input_len new tokens;
* decode:  1..max_batch sequences of exactly 1 new token.

In both, ``block_tables`` is ``[batch, 1..blocks_per_seq]`` and each pool input is fixed at
``kvcache.layout.pool_shape`` (``[kv_heads, num_blocks, block_size, head_dim]``).
"""

from __future__ import annotations

from ..kvcache.layout import pool_shape
from ..model.spec import ModelSpec
from ..model.vision import VisionSpec
from .config import BuildConfig

Shape = tuple[int, ...]
Profile = dict[str, tuple[Shape, Shape, Shape]]  # input -> (min, opt, max)


def profile_shapes(cfg: BuildConfig, spec: ModelSpec, num_blocks: int) -> dict[str, Profile]:
    b, t, mb = cfg.max_batch_size, cfg.max_input_len, cfg.blocks_per_seq
    assert t is not None, "resolve the config first (BuildConfig.resolved)"
    pool: Shape = pool_shape(num_blocks, cfg.kv_block_size, spec.num_kv_heads, spec.head_dim)

    def make(min_t: int, opt_b: int, opt_t: int, max_t: int, opt_mb: int) -> Profile:
        opt_b, opt_t = min(opt_b, b), min(opt_t, max_t)
        p: Profile = {
            "input_ids": ((1, min_t), (opt_b, opt_t), (b, max_t)),
            "position_ids": ((3, 1, min_t), (3, opt_b, opt_t), (3, b, max_t)) if spec.mrope else
                            ((1, min_t), (opt_b, opt_t), (b, max_t)),
            "context_lens": ((1,), (opt_b,), (b,)),
            "query_lens": ((1,), (opt_b,), (b,)),
            "block_tables": ((1, 1), (opt_b, opt_mb), (b, mb)),
            "logits_indices": ((1, 1), (opt_b, 1), (b, max_t)),
        }
        if spec.vision:  # image rows: one (zeros) in a decode step, up to every new token + 1 in a prefill
            p["image_embeds"] = ((1, spec.hidden_size), (1 + opt_b * opt_t, spec.hidden_size),
                                 (1 + b * max_t, spec.hidden_size))
            p["image_index"] = p["input_ids"]
        for i in range(spec.num_layers):
            p[f"past_key.{i}"] = (pool, pool, pool)
            p[f"past_value.{i}"] = (pool, pool, pool)
        return p

    return {
        "prefill": make(1, cfg.prefill_opt_batch, cfg.prefill_opt_tokens, t, 1),
        "decode": make(1, cfg.decode_opt_batch, 1, 1, max(1, mb // 2)),
    }


def vision_profile(vision: VisionSpec, max_pixels: int) -> dict[str, Profile]:
    """The vision engine's one optimization profile, over an image's patch count: from one merged
    block to what ``max_pixels`` allows, tuned for the largest (a phone screenshot is resized to it)."""
    most = vision.max_patches(max_pixels)
    least = vision.merge_size ** 2
    row = 3 * vision.temporal_patch_size * vision.patch_size ** 2

    def over(width: int) -> tuple[Shape, Shape, Shape]:
        return (least, width), (most, width), (most, width)

    return {"image": {"pixel_values": over(row), "pos_embed": over(vision.hidden_size),
                      "rope_cos": over(vision.head_dim), "rope_sin": over(vision.head_dim)}}
