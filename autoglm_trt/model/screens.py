"""Synthetic phone screenshots for calibration, benchmarks and load tests: flat panels, bars,
buttons and a little noise on a light background (what an agent's UI screenshots look like to an
encoder: large uniform areas and sharp edges), from a seed, in numpy + Pillow; and the chat
message that carries one, as the phone agent sends it."""

from __future__ import annotations

import numpy as np

PHONE = (1080, 2400)  # (width, height) of a typical phone screenshot


def ui_screenshot(seed: int, size: tuple[int, int] = PHONE):
    """A PIL RGB image of ``size`` (width, height), the same for the same seed."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    width, height = size
    image = Image.new("RGB", size, tuple(int(c) for c in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, 0, width, height // 30], fill=tuple(int(c) for c in rng.integers(0, 80, 3)))  # status bar
    for _ in range(40):  # panels and buttons
        x, y = int(rng.integers(0, max(1, width - width // 10))), int(rng.integers(0, max(1, height - height // 40)))
        w, h = int(rng.integers(width // 18, width * 5 // 6)), int(rng.integers(height // 80, height // 10))
        draw.rectangle([x, y, x + w, y + h], fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
    for _ in range(60):  # text-like strokes
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        draw.line([x, y, x + int(rng.integers(10, width // 3)), y], fill=tuple(int(c) for c in rng.integers(0, 90, 3)),
                  width=int(rng.integers(2, 6)))
    arr = np.asarray(image).copy()
    arr[::7, ::5] ^= rng.integers(0, 16, arr[::7, ::5].shape, dtype=np.uint8)
    return Image.fromarray(arr)


def ui_screenshot_png(seed: int, size: tuple[int, int] = PHONE) -> bytes:
    """``ui_screenshot`` PNG-encoded, as the agent sends a screenshot."""
    import io

    buf = io.BytesIO()
    ui_screenshot(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def screenshot_message(seed: int, size: tuple[int, int], text: str) -> list[dict]:
    """One user message: a synthetic screenshot of ``size`` as a PNG ``data:`` URL, then ``text``
    (the phone agent's request shape)."""
    import base64

    url = "data:image/png;base64," + base64.b64encode(ui_screenshot_png(seed, size)).decode()
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}]
