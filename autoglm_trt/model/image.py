"""GLM-4.1V's image input: decoding with limits, and the preprocessing of transformers'
``Glm4vImageProcessor`` (its PIL backend) in numpy + Pillow, no torch.

Input: images (a PIL image, encoded bytes, a file path, or a ``data:`` URL) and the checkpoint's
``preprocessor_config.json`` (``ImageConfig``). Output: ``pixel_values`` float32
``[patches, 3 * temporal_patch * patch * patch]`` (all images' patches, one after another) and each
image's grid ``(t, h, w)`` in patches; after the vision encoder's ``merge x merge`` merge an image
is ``h * w / merge**2`` tokens (``ImageConfig.tokens``).

Per image, as transformers does it: convert to RGB (transparency composited onto white);
``smart_resize`` to multiples of ``patch * merge`` (28) whose area lies within ``min_pixels`` and
``max_pixels``; a bicubic resize by Pillow; rescale by 1/255 (in float64, then float32); normalize
by the CLIP mean and std in float32; the one frame repeated ``temporal_patch`` times; patches in
the order the encoder's merge expects (each 2 x 2 block of patches consecutive).

Decoding is bounded before any pixel is decoded: ``open_header`` reads an image's header only
(its size and format), refusing an image of more than ``max_decode_pixels`` (a decompression bomb
never allocates), a format a phone or a browser does not send (``IMAGE_FORMATS``: Pillow's other
decoders are rarely exercised and raise what they like on corrupt data), data that are not an
image, and a data URL that is not base64; ``decode_rgb`` then decodes it, and anything Pillow
raises on a truncated or corrupt image becomes an ``ImageError``.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import RequestError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OpenAI CLIP's (transformers' OPENAI_CLIP_MEAN)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_CONFIG = "preprocessor_config.json"


IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's names of what a phone or a browser sends
MAX_JPEG_SCANS = 64  # a progressive JPEG has about ten; each scan is another pass over the whole image
ALPHA_STRIP_ROWS = 256  # rows composited at a time: Pillow holds the GIL while it composites
MAX_IMAGE_FILE_BYTES = 64 << 20  # a file:// image, at most (a data: URL is bounded by the request body)


class ImageError(RequestError):
    """An image a request carries cannot be used (not an image, truncated, too large)."""


@dataclass(frozen=True)
class ImageConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 112 * 112  # the resized image's area, at least
    max_pixels: int = 28 * 28 * 15000  # and at most (transformers' default; Open-AutoGLM serves 5,000,000)
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    max_decode_pixels: int = 64_000_000  # a source image's area, at most (checked before decoding)

    @property
    def factor(self) -> int:
        """What resized sides are multiples of: one merged patch."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, model_dir: Path, **overrides: int) -> ImageConfig:
        """The settings of a checkpoint's (or engine's) ``preprocessor_config.json``; ``overrides``
        (e.g. ``max_pixels``) win. ``RequestError`` if the file is malformed."""
        path = Path(model_dir) / PREPROCESSOR_CONFIG
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        if not isinstance(raw, dict):
            raise RequestError(f"{path} must hold a JSON object")
        size: dict = raw["size"] if isinstance(raw.get("size"), dict) else {}
        fields = {
            "patch_size": raw.get("patch_size", cls.patch_size),
            "temporal_patch_size": raw.get("temporal_patch_size", cls.temporal_patch_size),
            "merge_size": raw.get("merge_size", cls.merge_size),
            "min_pixels": size.get("shortest_edge", raw.get("min_pixels", cls.min_pixels)),
            "max_pixels": size.get("longest_edge", raw.get("max_pixels", cls.max_pixels)),
            **overrides,
        }
        for key, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RequestError(f"{path}: {key} must be a positive integer, got {value!r}")
        if fields["min_pixels"] > fields["max_pixels"]:
            raise RequestError(f"{path}: min_pixels {fields['min_pixels']} exceeds max_pixels {fields['max_pixels']}")
        stats = []
        for key, default in (("image_mean", CLIP_MEAN), ("image_std", CLIP_STD)):
            value = raw.get(key, default)
            if not isinstance(value, list | tuple) or len(value) != 3 or \
                    not all(isinstance(v, int | float) and not isinstance(v, bool) for v in value):
                raise RequestError(f"{path}: {key} must be three numbers, got {value!r}")
            stats.append(tuple(float(v) for v in value))
        if not all(s > 0 for s in stats[1]):
            raise RequestError(f"{path}: image_std must be positive, got {stats[1]}")
        return cls(**fields, image_mean=stats[0], image_std=stats[1])  # type: ignore[arg-type]

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """``smart_resize``: the (height, width) an image is resized to."""
        return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels, self.temporal_patch_size)

    def grid(self, height: int, width: int) -> tuple[int, int, int]:
        """The (t, h, w) patch grid of an image of this size."""
        h, w = self.resized(height, width)
        return 1, h // self.patch_size, w // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """The image tokens an image of this size becomes (patches after the merge)."""
        t, h, w = self.grid(height, width)
        return t * h * w // (self.merge_size * self.merge_size)


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = 112 * 112,
                 max_pixels: int = 28 * 28 * 15000, temporal: int = 2) -> tuple[int, int]:
    """Sides that are multiples of ``factor``, near the image's, whose area (times the temporal
    patch, one frame counted ``temporal`` times, as transformers counts it) is within
    ``[min_pixels, max_pixels]``; an image smaller than ``factor`` on a side is first scaled up."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"an image's aspect ratio must be at most 200, got {max(height, width) / min(height, width):.0f} "
                         f"({width} x {height})")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if temporal * h * w > max_pixels:
        beta = math.sqrt(temporal * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif temporal * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (temporal * height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def open_image(source: object, max_decode_pixels: int = ImageConfig.max_decode_pixels):
    """A decoded PIL image from a PIL image, bytes, a path or a ``data:`` URL (``open_header``,
    then its pixels decoded); ``ImageError`` as those say."""
    image = open_header(source, max_decode_pixels)
    _decoding(image, image.load)
    return image


def open_header(source: object, max_decode_pixels: int = ImageConfig.max_decode_pixels):
    """A PIL image from a PIL image, bytes, a path or a ``data:`` URL, with only its header read:
    ``ImageError`` for data that are not an image of ``IMAGE_FORMATS``, or one of more than
    ``max_decode_pixels`` pixels (refused before any is decoded)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, str) and source.startswith("data:"):
            data = decode_data_url(source)
        elif isinstance(source, bytes | bytearray | memoryview):
            data = bytes(source)
        elif isinstance(source, str | Path):
            data = _read_file(Path(source))
        else:
            raise ImageError(f"an image must be a PIL image, bytes, a path or a data: URL, got {type(source).__name__}")
        try:
            with warnings.catch_warnings():  # Pillow warns past its own limit; ours is checked below
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except Image.DecompressionBombError as exc:  # Pillow's own limit, past ours
            raise ImageError(f"the image has too many pixels; at most {max_decode_pixels:,} are accepted "
                             f"({str(exc)[:200]})") from exc
        except Exception as exc:  # noqa: BLE001 - whatever a header parser raises, the data are not a usable image
            raise ImageError(f"the data are not an image of a format this server reads ({', '.join(IMAGE_FORMATS)}) "
                             f"({str(exc)[:200]})") from exc
        # a scan starts at an SOS marker, FF DA, which entropy-coded data cannot hold (FF is stuffed there);
        # whatever Pillow calls it (an MPO is JPEG data), data that start as a JPEG are counted
        if data.startswith(b"\xff\xd8") and (scans := data.count(b"\xff\xda")) > MAX_JPEG_SCANS:
            raise ImageError(f"the JPEG has {scans:,} scans; at most {MAX_JPEG_SCANS} are decoded (a progressive JPEG "
                             "has about ten)")
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError(f"the image is empty ({width} x {height})")
    if width * height > max_decode_pixels:
        raise ImageError(f"the image is {width} x {height} = {width * height:,} pixels; at most {max_decode_pixels:,} "
                         "are accepted (resize it before sending)")
    return image


def decode_rgb(image) -> np.ndarray:
    """An image opened by ``open_header``, decoded: uint8 ``[height, width, 3]`` (``rgb``);
    ``ImageError`` if it is truncated or corrupt."""
    arr = _decoding(image, lambda: rgb(image))
    if arr.shape[:2] != (image.height, image.width):
        raise ImageError(f"the image decoded to {arr.shape[1]} x {arr.shape[0]} pixels where its header says "
                         f"{image.width} x {image.height}")
    return arr


def _decoding(image, work):
    """``work()`` (decoding ``image``), with whatever Pillow raises on corrupt data as an ``ImageError``."""
    try:
        return work()
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a decoder's failure on a client's data is that image's fault
        raise ImageError(f"the image is truncated or corrupt ({type(exc).__name__}: {str(exc)[:200]})") from exc


def _read_file(path: Path) -> bytes:
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_FILE_BYTES:
            raise ImageError(f"the image file is {size:,} bytes; at most {MAX_IMAGE_FILE_BYTES:,} are read")
        return path.read_bytes()
    except (OSError, ValueError) as exc:
        raise ImageError(f"cannot read the image {str(path)[:200]!r}: {getattr(exc, 'strerror', None) or exc}") from exc


def decode_data_url(url: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL (``ImageError`` otherwise)."""
    head, sep, payload = url.partition(",")
    if not sep or not head.endswith(";base64"):
        raise ImageError("a data: URL must be base64: data:image/png;base64,...")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data: URL's base64 is malformed ({exc})") from exc


def rgb(image) -> np.ndarray:
    """uint8 ``[height, width, 3]``: the image in RGB, any transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        out = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        for top in range(0, rgba.height, ALPHA_STRIP_ROWS):  # the same pixels; other threads run in between
            box = (0, top, rgba.width, min(rgba.height, top + ALPHA_STRIP_ROWS))
            out.paste(Image.alpha_composite(out.crop(box), rgba.crop(box)), box)
        image = out.convert("RGB")
    else:
        image = image.convert("RGB")
    return np.asarray(image)


def preprocess(images: Sequence[object], cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """``pixel_values`` float32 ``[patches, 3 * T * P * P]`` of every image and their grids int64
    ``[images, 3]`` (t, h, w), as transformers' ``Glm4vImageProcessor`` gives them."""
    arrays = [decode_rgb(open_header(source, cfg.max_decode_pixels)) for source in images]
    grids = [cfg.grid(*a.shape[:2]) for a in arrays]
    return (np.concatenate([pixel_rows(a, cfg) for a in arrays], axis=0),
            np.asarray(grids, np.int64).reshape(len(grids), 3))


def pixel_rows(arr: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """One RGB image (``rgb``) as its ``pixel_values`` rows: resized (``smart_resize``, bicubic),
    rescaled and normalized (``(v / 255 - mean) / std`` as one multiply-add in float32, within
    1e-6 of the two steps), and cut into patches (``patchify``)."""
    from PIL import Image

    height, width = arr.shape[:2]
    h, w = cfg.resized(height, width)
    resized = np.asarray(Image.fromarray(arr).resize((w, h), resample=Image.Resampling.BICUBIC))
    std = np.asarray(cfg.image_std, np.float32)
    scale = (1 / (std * 255)).astype(np.float32)
    shift = (np.asarray(cfg.image_mean, np.float32) / std).astype(np.float32)
    return patchify((resized.astype(np.float32) * scale - shift).transpose(2, 0, 1), cfg)


def patchify(x: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """A ``[3, H, W]`` image as rows of ``3 * T * P * P``: patches in the order (block row, block
    column, row in the block, column in the block) with blocks of ``merge x merge`` patches, each
    patch's channels, then its one frame repeated ``T`` times, then its ``P x P`` pixels."""
    c, height, width = x.shape
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = height // p, width // p
    blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))
    return frames.reshape(gh * gw, c * t * p * p)
