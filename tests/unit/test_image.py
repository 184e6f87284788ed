"""GLM-4.1V's image preprocessing against transformers' Glm4vImageProcessor, and decoding limits."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest

from autoglm_trt.errors import RequestError
from autoglm_trt.model.image import (
    ImageConfig,
    ImageError,
    decode_rgb,
    open_header,
    open_image,
    preprocess,
    smart_resize,
)


def _reference():
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm4v.image_processing_pil_glm4v import Glm4vImageProcessorPil
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as ref

    assert transformers.__version__
    return Glm4vImageProcessorPil(), ref


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0):
    from PIL import Image

    rng = np.random.default_rng(seed + width * 7 + height)
    bands = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    data = rng.integers(0, 256, (height, width, bands), dtype=np.uint8)
    return Image.fromarray(data[..., 0] if bands == 1 else data, mode)


@pytest.mark.parametrize("size", [(1080, 2400), (333, 517), (29, 31), (17, 45), (900, 60), (2001, 1999), (56, 56)])
def test_pixel_values_equal_transformers_within_1e_5(size):
    processor, _ = _reference()
    image = _image(*size)
    want = processor(images=[image], return_tensors="np")
    pixels, grids = preprocess([image], ImageConfig())
    assert pixels.dtype == np.float32 and pixels.shape == want["pixel_values"].shape
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["RGBA", "L"])
def test_transparency_and_grey_images_are_converted_as_transformers_does(mode):
    processor, _ = _reference()
    image = _image(123, 77, mode)
    pixels, _ = preprocess([image], ImageConfig())
    np.testing.assert_allclose(pixels, processor(images=[image], return_tensors="np")["pixel_values"], atol=1e-5, rtol=0)


def test_two_images_are_concatenated_in_order():
    processor, _ = _reference()
    images = [_image(100, 300), _image(640, 200, seed=3)]
    want = processor(images=images, return_tensors="np")
    pixels, grids = preprocess(images, ImageConfig())
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_allclose(pixels, want["pixel_values"], atol=1e-5, rtol=0)


def test_smart_resize_equals_transformers_over_many_sizes():
    _, ref = _reference()
    rng = np.random.default_rng(5)
    cfg = ImageConfig(max_pixels=5_000_000)
    for height, width in rng.integers(28, 6000, (300, 2)):
        want = ref(2, int(height), int(width), 2, 28, cfg.min_pixels, cfg.max_pixels)
        assert cfg.resized(int(height), int(width)) == want, (height, width)


def test_a_phone_screenshots_tokens():
    """1080 x 2400: 2408 x 1092 after the resize, 3,354 tokens, under transformers' default max_pixels;
    Open-AutoGLM's max_pixels of 5,000,000 counts the frame twice (the temporal patch) and so
    shrinks it to 3,108 tokens, as transformers does."""
    _, ref = _reference()
    assert ImageConfig().tokens(2400, 1080) == (2408 // 28) * (1092 // 28) == 3354
    assert ImageConfig().grid(2400, 1080) == (1, 2408 // 14, 1092 // 14)
    h, w = ref(2, 2400, 1080, 2, 28, 112 * 112, 5_000_000)
    assert ImageConfig(max_pixels=5_000_000).tokens(2400, 1080) == h * w // 28 ** 2 == 3108


def test_the_checkpoint_config_is_read_and_checked(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"size": {"shortest_edge": 12544, "longest_edge": 9633792}, "patch_size": 14, "merge_size": 2,'
        ' "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]}')
    cfg = ImageConfig.from_dir(tmp_path, max_pixels=5_000_000)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean, cfg.image_std) == (12544, 5_000_000, (0.5,) * 3, (0.25,) * 3)
    (tmp_path / "preprocessor_config.json").write_text('{"patch_size": "14"}')
    with pytest.raises(RequestError, match="patch_size must be a positive integer"):
        ImageConfig.from_dir(tmp_path)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and whose pixel data are one empty chunk."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_bad_images_are_refused_with_a_reason():
    with pytest.raises(ImageError, match="not an image"):
        open_image(b"plain text, not an image")
    with pytest.raises(ImageError, match="10000 x 10000 = 100,000,000 pixels; at most 64,000,000"):
        open_image(_png_header(10_000, 10_000))  # refused from its header: nothing is decoded
    with pytest.raises(ImageError, match="too many pixels; at most 64,000,000"):
        open_image(_png_header(100_000, 100_000))  # past Pillow's own limit too
    buf = io.BytesIO()
    _image(64, 64).save(buf, "PNG")
    with pytest.raises(ImageError, match="truncated or corrupt"):
        open_image(buf.getvalue()[: len(buf.getvalue()) // 2])
    with pytest.raises(ImageError, match="must be base64"):
        open_image("data:image/png,abc")
    with pytest.raises(ImageError, match="base64 is malformed"):
        open_image("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="aspect ratio must be at most 200"):
        smart_resize(28, 28 * 300)
    good = open_image("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    assert good.size == (64, 64)


def _encoded(image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["TIFF", "DDS", "ICO", "TGA", "PCX", "QOI", "SGI", "PPM", "EPS"])
def test_only_the_formats_a_phone_or_browser_sends_are_read(fmt):
    """Pillow reads some forty formats, and its rarer decoders raise what they like on crafted data
    (TypeError, OverflowError, NotImplementedError: a 500 each, before); only PNG, JPEG, WebP, GIF
    and BMP are opened, anything else is refused from its first bytes."""
    with pytest.raises(ImageError, match="PNG, JPEG, WEBP, GIF, BMP"):
        open_header(_encoded(_image(16, 16), fmt))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_formats_a_phone_sends_decode_and_corrupt_ones_are_refused(fmt):
    data = _encoded(_image(40, 30, seed=3), fmt)
    assert decode_rgb(open_header(data)).shape == (30, 40, 3)
    rng = np.random.default_rng(len(data))
    for k in range(40):  # truncated, or bytes flipped after the first few: an ImageError or an image, nothing else
        cut = bytearray(data[: len(data) * (k + 1) // 41])
        if k % 2:
            cut = bytearray(data)
            for i in rng.integers(8, len(data), 6):
                cut[i] ^= int(rng.integers(1, 256))
        try:
            decode_rgb(open_header(bytes(cut)))
        except ImageError:
            pass


def test_decoders_raising_anything_is_an_image_error(monkeypatch):
    """What Pillow raised outside OSError/ValueError on corrupt data (TypeError from BLP, OverflowError
    from DDS, NotImplementedError) reached the server as a 500."""
    from PIL import ImageFile

    image = open_header(_encoded(_image(8, 8), "PNG"))
    for exc in (TypeError("x"), OverflowError("x"), NotImplementedError("x"), IndexError("x")):
        def broken(self, exc=exc):
            raise exc

        monkeypatch.setattr(ImageFile.ImageFile, "load", broken)
        with pytest.raises(ImageError, match=type(exc).__name__):
            decode_rgb(image)


def test_the_header_is_read_without_decoding_pixels(monkeypatch):
    from PIL import Image, ImageFile

    loads = []
    real = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(1) or real(self))
    big = _encoded(Image.new("1", (8000, 8000)), "PNG")  # 64 Mpx of one bit: ~8 KB compressed
    image = open_header(big)
    assert image.size == (8000, 8000) and loads == []
    assert decode_rgb(open_header(_encoded(_image(20, 10), "PNG"))).shape == (10, 20, 3) and loads


def test_pixels_decoded_at_once_across_requests_stay_within_the_budget():
    import threading
    import time

    from autoglm_trt.runtime.images import Cancelled, PixelBudget

    budget = PixelBudget(100)
    peak, lock = [0], threading.Lock()

    def decode(pixels: int) -> None:
        with budget.hold(pixels):
            with lock:
                peak[0] = max(peak[0], budget.used)
            time.sleep(0.01)

    threads = [threading.Thread(target=decode, args=(p,)) for p in [60, 50, 40, 30, 70, 20, 100, 10] * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert 0 < peak[0] <= 100 and budget.used == 0
    cancel = threading.Event()
    with budget.hold(90):
        cancel.set()
        with pytest.raises(Cancelled):  # a request whose client left stops waiting
            with budget.hold(20, cancel):
                pass
    assert budget.used == 0


def test_a_jpeg_of_many_scans_is_refused_from_its_bytes(monkeypatch):
    """Each scan of a progressive JPEG is a pass over the whole image, and libjpeg decodes a scan
    repeated thousands of times with only a warning (a 1.3 MB JPEG of 30,000 scans of 8000 x 8000
    took 36 s, the decode budget held all along): more than 64 scans are refused before decoding."""
    from PIL import Image, ImageFile

    data = _encoded(Image.new("RGB", (64, 64), (120, 130, 140)), "JPEG", progressive=True, quality=90)
    assert 1 < data.count(b"\xff\xda") <= 64  # Pillow's progressive JPEG: a few scans
    assert open_header(data).size == (64, 64)  # taken as it is
    last = data.rindex(b"\xff\xda")
    scan = data[last:-2]  # the last scan: its header and entropy-coded data, up to EOI
    many = data[:-2] + scan * 100 + b"\xff\xd9"
    loads = []
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(1))
    with pytest.raises(ImageError, match="scans; at most 64"):
        open_header(many)
    # the same data with an MPO's APP2 "MPF" segment after SOI: Pillow calls it an MPO, still JPEG data
    buf = io.BytesIO()
    Image.new("RGB", (16, 16)).save(buf, "MPO", save_all=True, append_images=[Image.new("RGB", (16, 16))])
    mpo = buf.getvalue()
    at = mpo.index(b"\xff\xe2")
    app2 = mpo[at:at + 2 + int.from_bytes(mpo[at + 2:at + 4], "big")]
    assert app2[4:8] == b"MPF\0"
    with pytest.raises(ImageError, match="scans; at most 64"):
        open_header(many[:2] + app2 + many[2:])
    assert loads == []


def test_transparency_is_composited_onto_white_in_strips_exactly():
    """The strips (so that other threads run in between) give the pixels one composite of the whole
    image gives."""
    from PIL import Image

    from autoglm_trt.model.image import ALPHA_STRIP_ROWS, rgb

    rgba = _image(37, ALPHA_STRIP_ROWS * 2 + 41, "RGBA", seed=5)
    whole = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    np.testing.assert_array_equal(rgb(rgba), np.asarray(whole))
