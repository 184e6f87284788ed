"""Parity of a GLM-4.1V export's image path with transformers.

Two seeded random images of odd sizes and aspect ratios, preprocessed as the runtime does
(``model.image``), go through the exported encoder (``backends.onnxrt.vision_encoder``) and through
transformers' vision tower (features compared); then one prompt with both images, expanded and
given its 3-D positions as the runtime gives them (``model.multimodal``), through the decoder in
one prefill and in chunks of ``CHUNK`` tokens through a paged pool (so a chunk boundary cuts an
image), against transformers' logits for ``input_ids`` + ``pixel_values`` + ``image_grid_thw``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends.onnxrt.session import make_session, run
from ..backends.onnxrt.vision_encoder import VisionEncoder
from ..errors import ValidationError
from ..kvcache.host_pools import KVPools
from ..kvcache.layout import blocks_needed
from ..kvcache.step_inputs import MRope, PromptImages, SeqState, StepImages, step_inputs
from ..model.image import ImageConfig, preprocess
from ..model.multimodal import expand, image_digest, mrope_positions
from ..model.spec import ModelSpec
from ..model.vision import VisionSpec
from .validate import BLOCK_SIZE, compare

IMAGE_SIZES = ((61, 45), (30, 97))  # (width, height): odd sides, one wide and one tall
CHUNK = 7


def validation_images(seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in IMAGE_SIZES]


def validate_vision(export_dir: Path, checkpoint: Path, spec: ModelSpec, vspec: VisionSpec, kv_dtype: str,
                    tolerance: float, log=print) -> dict:
    """The report; ``ValidationError`` when features or logits differ beyond ``tolerance``."""
    import torch
    import transformers
    from PIL import Image

    cfg = ImageConfig.from_dir(checkpoint)
    pixels, grids = preprocess([Image.fromarray(a) for a in validation_images()], cfg)
    sizes = [int(t * h * w) for t, h, w in grids]
    parts = np.split(pixels, np.cumsum(sizes)[:-1])
    encoder = VisionEncoder(export_dir, vspec)
    embeds = [encoder.encode(p, (int(g[0]), int(g[1]), int(g[2]))) for p, g in zip(parts, grids)]
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.from_numpy(grids)).pooler_output.numpy()
    features = float(np.max(np.abs(np.concatenate(embeds) - want)))

    text = np.random.default_rng(1).integers(0, min(vspec.image_token_id, vspec.image_start_token_id), 12).tolist()
    image = [vspec.image_start_token_id, vspec.image_token_id, vspec.image_end_token_id]
    ids = text[:5] + image + text[5:9] + image + text[9:]
    digests = [image_digest(p, g) for p, g in zip(parts, grids)]
    ids, spans = expand(ids, vspec.image_token_id, grids.tolist(), digests, vspec.merge_size)
    positions, delta = mrope_positions(len(ids), spans, vspec.merge_size)
    with torch.no_grad():
        types = torch.tensor([[int(t == vspec.image_token_id) for t in ids]])  # as the processor marks them
        ref = model(input_ids=torch.tensor([ids]), pixel_values=torch.from_numpy(pixels), mm_token_type_ids=types,
                    image_grid_thw=torch.from_numpy(grids)).logits[0].float().numpy()
    images = PromptImages(tuple(s.start for s in spans), tuple(embeds))
    session = make_session(export_dir / "model.onnx")
    got = {name: _logits(session, spec, ids, MRope(positions, delta), images, kv_dtype, chunk)
           for name, chunk in (("prefill", len(ids)), ("chunked", CHUNK))}
    report = {"tolerance": tolerance, "image_grids": grids.tolist(), "prompt_tokens": len(ids),
              "features_max_abs_diff": features, **{k: compare(ref, v, tolerance) for k, v in got.items()}}
    worst = max(features, *(report[k]["max_abs_diff"] for k in got))
    bad = sum(report[k]["argmax_mismatch_not_near_tie"] for k in got)
    report["passed"] = bool(worst <= tolerance and bad == 0)
    log(f"image parity: features max |Δ| {features:.3g}, logits with {len(spans)} images max |Δ| "
        f"{max(report[k]['max_abs_diff'] for k in got):.3g} (tolerance {tolerance:g})")
    if not report["passed"]:
        raise ValidationError(f"the exported image path does not match transformers: max |Δ| {worst:.4g} > "
                              f"tolerance {tolerance:g} or {bad} argmax mismatches. Report: {report}")
    return report


def _logits(session, spec: ModelSpec, ids: list[int], mrope: MRope, images: PromptImages, kv_dtype: str,
            chunk: int) -> np.ndarray:
    """Logits at every position of one prompt with images, ``chunk`` tokens a step through a pool."""
    n = blocks_needed(len(ids), BLOCK_SIZE)
    pools = KVPools(spec.num_layers, n + 1, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype)
    state = SeqState(0, list(range(1, n + 1)))  # block 0 unused: a wrong table reads zeros
    out = []
    for start in range(0, len(ids), chunk):
        new = [ids[start : start + chunk]]
        feeds, slots = step_inputs(new, [state], BLOCK_SIZE, all_logits=True, mrope=[mrope],
                                   images=StepImages(spec.hidden_size, [images]))
        res = run(session, {**feeds, **pools.feeds()})
        pools.write(res, slots)
        out.append(res["logits"][0, : len(new[0])])
        state.num_computed_tokens += len(new[0])
    return np.concatenate(out)
