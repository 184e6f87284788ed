"""Calibration windows with images, for a vision family (GLM-4.1V): the decoder's INT8 ranges
must cover the image tokens' hidden states as well as text's.

Input: the export (its vision encoder, preprocessor settings and tokenizer ids), the text
windows ``[n, T]`` and the images: those in the calibration folder (``*.png``, ``*.jpg``,
``*.jpeg``, ``*.webp``) or, without any, ``DEFAULT_IMAGES`` synthetic UI screenshots
(``model.screens.ui_screenshot``). Output: one window per image, ``T`` tokens long: the start of a text
window, ``<|begin_of_image|>``, the image's tokens (resized so that they take at most half the
window), ``<|end_of_image|>``, then text again; its embeddings from the export's encoder and its
3-D positions (``WindowImages``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from ..backends.onnxrt.offline import WindowImages
from ..backends.onnxrt.vision_encoder import VisionEncoder
from ..graph.exported_weights import OpenedExport
from ..model.image import ImageConfig, open_image, pixel_rows, rgb
from ..model.multimodal import ImageSpan, mrope_positions, tokens_of
from ..model.screens import ui_screenshot

DEFAULT_IMAGES = 4
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


def calibration_images(data: Path) -> list[object]:
    """The calibration folder's images (sorted by name), or the synthetic screenshots."""
    found = sorted(p for p in Path(data).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES) if Path(data).is_dir() else []
    return list(found) if found else [ui_screenshot(seed) for seed in range(DEFAULT_IMAGES)]


def image_windows(export: OpenedExport, text: np.ndarray, images: list[object]) -> tuple[np.ndarray, WindowImages]:
    """``len(images)`` windows as long as the text windows, each with one image, and their images."""
    export_dir, vision = export.dir, export.record.vision()
    assert vision is not None, "image windows need an export with a vision encoder"
    length = text.shape[1]
    merge = vision.merge_size
    # at most half the window in image tokens: each covers (patch * merge)^2 pixels, counted
    # temporal_patch_size times, as smart_resize counts them
    per_token = (vision.patch_size * merge) ** 2 * vision.temporal_patch_size
    base = ImageConfig.from_dir(export_dir)
    most = max(per_token, per_token * (length // 2))
    cfg = dataclasses.replace(base, max_pixels=most, min_pixels=min(base.min_pixels, most))
    encoder = VisionEncoder(export_dir, vision)
    rows, positions = [], []
    items: list[tuple[int, np.ndarray] | None] = []
    for k, source in enumerate(images):
        arr = rgb(open_image(source, cfg.max_decode_pixels))
        grid = cfg.grid(*arr.shape[:2])
        n = tokens_of(grid, merge)
        embeds = encoder.encode(pixel_rows(arr, cfg), grid)
        words = text[k % len(text)]
        lead = (length - n - 2) // 2
        ids = np.concatenate([words[:lead], [vision.image_start_token_id], np.full(n, vision.image_token_id),
                              [vision.image_end_token_id], words[lead : length - n - 2]]).astype(np.int64)
        span = ImageSpan(lead + 1, lead + 1 + n, grid, b"")
        rows.append(ids)
        items.append((span.start, embeds))
        positions.append(mrope_positions(length, [span], merge)[0])
    return np.stack(rows), WindowImages(items, np.stack(positions, axis=1))


def with_image_windows(export: OpenedExport, text: np.ndarray, images: list[object]) -> tuple[np.ndarray, WindowImages]:
    """The text windows ``[n, T]`` followed by one window per image (``image_windows``), and the
    images of all of them (None for the text windows, whose positions are 0 .. T - 1)."""
    shown, with_images = image_windows(export, text, images)
    return _joined(text, _text_items(text), shown, with_images)


def then_text(rows: np.ndarray, shown: WindowImages | None, text: np.ndarray) -> tuple[np.ndarray, WindowImages | None]:
    """``rows`` (and their images, if any) followed by the text windows ``text``."""
    if shown is None:
        return np.concatenate([rows, text]), None
    return _joined(rows, shown, text, _text_items(text))


def _text_items(text: np.ndarray) -> WindowImages:
    """Text windows ``[n, T]`` as ``WindowImages``: no image, positions 0 .. T - 1."""
    n, length = text.shape
    return WindowImages([None] * n, np.broadcast_to(np.arange(length), (3, n, length)))


def _joined(a: np.ndarray, a_images: WindowImages, b: np.ndarray, b_images: WindowImages) -> tuple[np.ndarray, WindowImages]:
    return np.concatenate([a, b]), WindowImages(a_images.items + b_images.items,
                                                np.concatenate([a_images.positions, b_images.positions], axis=1))


def image_digest(image: object) -> str:
    """What identifies a calibration image: a file's content, or a synthetic screenshot's pixels."""
    if isinstance(image, Path):
        return hashlib.sha256(image.read_bytes()).hexdigest()
    return hashlib.sha256(np.asarray(image).tobytes()).hexdigest()
