"""A request's images (GLM-4.1V engines): from the image parts of its chat messages to what its
sequence carries — the prompt with each placeholder expanded, the image tokens' embeddings, the
3-D positions and the prefix cache's per-block image keys.

Where an image may come from (``image_url``): a ``data:`` URL; a ``file://`` URL only under the
engine's ``allowed_local_media_path``; an http(s) URL never (nothing is fetched). Through the
Python API an ``{"type": "image", "image": ...}`` part may also carry a PIL image, bytes or a path.

Budgets come before work. Each image's header is read first (``model.image.open_header``: its
size and format, nothing decoded); from the sizes the image tokens are known (``smart_resize``),
so a prompt too long, or images of more than ``MAX_REQUEST_PIXELS`` in all, is refused before a
pixel is decoded, and a caller's ``reserve`` learns the bytes their embeddings will take (a server
bounds those of its requests in flight). Then the images are taken one at a time: decoded (while the pixels decoded at
once across every request stay within ``DECODE_BUDGET_PIXELS``), hashed (their decoded RGB
pixels and grid), and their embeddings taken from ``EncoderCache`` (by that hash) or preprocessed
as transformers' ``Glm4vImageProcessor`` does and encoded; each image's decoded pixels are let go
before the next is decoded. This runs on the caller's thread, so the engine's loop goes on with
other requests' steps while a screenshot is encoded; the encoder takes one image at a time
(``ImagePipeline._encoded``), and at most ``PREPARED_AT_ONCE`` requests at a time decode and
preprocess their images, the others waiting with their images still compressed (a 1080 x 2400
screenshot is 7.8 MB decoded and 58 MB of float32 patch rows). A caller that gives up sets the
``cancel`` event it passed: the request stops at its next wait or image.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlparse

import numpy as np

from ..artifacts import EngineError, ExportRecord, Manifest
from ..backends.onnxrt.vision_encoder import VisionEncoder
from ..backends.registry import backend
from ..errors import RequestError
from ..kvcache.step_inputs import MRope, PromptImages
from ..model.image import ImageConfig, ImageError, decode_rgb, open_header, pixel_rows
from ..model.multimodal import block_extras, expand, image_digest, mrope_positions, tokens_of
from ..model.vision import VisionSpec

MAX_IMAGES = 10  # per prompt, as Open-AutoGLM's deployment sets it
MAX_REQUEST_PIXELS = 128_000_000  # the images of one request, by their headers (two of the largest)
DECODE_BUDGET_PIXELS = 64_000_000  # decoded at once across requests (docs/security.md: the memory it takes)
WAIT_S = 0.1  # how often a waiting request looks at its cancel event
TRIM_AFTER_PIXELS = 16_000_000  # decoded since the heap was last handed back
ENCODER_CACHE_BYTES = 256 * 1024**2  # encoder outputs kept by image hash
# requests decoding, preprocessing and encoding their images at once: one is encoded while the
# others' next images are decoded and preprocessed
PREPARED_AT_ONCE = 4


def image_url_source(url: object, allowed_dir: Path | None) -> object:
    """What an ``image_url`` names, as ``open_image`` takes it: the ``data:`` URL itself, or the path of
    a ``file://`` URL inside ``allowed_dir``; ``RequestError`` for anything else."""
    if not isinstance(url, str) or not url:
        raise RequestError(f"image_url.url must be a string (a data: URL), got {type(url).__name__}")
    if url.startswith("data:"):
        return url
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https"):
        raise RequestError("image URLs over http(s) are not fetched; send the image inline as a data: URL "
                           "(data:image/png;base64,...)")
    if scheme != "file":
        raise RequestError(f"image_url.url must be a data: URL (or a file:// URL where the server allows local "
                           f"files), got one starting {url[:24]!r}")
    if allowed_dir is None:
        raise RequestError("file:// image URLs are refused: this engine was not given an allowed_local_media_path "
                           "(serve --allowed-local-media-path DIR); send the image as a data: URL")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise RequestError(f"a file:// URL must name a local file, got host {parsed.netloc!r}")
    if "\0" in unquote(parsed.path):
        raise RequestError("a file:// URL's path holds a NUL character")
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(allowed_dir.resolve()):
        raise RequestError(f"the file {unquote(parsed.path)!r} is outside the allowed local media path")
    return path


@dataclass(frozen=True)
class ImageRules:
    """Which images a prompt may carry: how many, and where ``file://`` URLs may point (None: nowhere)."""

    max_images: int = 10
    allowed_local_media_path: Path | None = None


@dataclass(frozen=True)
class ImageOptions:
    """An image-text engine's image settings (GLM-4.1V).

    max_pixels: the most pixels an image is resized to (None: the build config's, else the checkpoint's
        preprocessor config; Open-AutoGLM serves with 5,000,000). max_images: images per prompt (None:
        the build config's, 10 unless it says otherwise). allowed_local_media_path:
        the directory ``file://`` image URLs may point into (None: no file URLs). encoder_cache_bytes:
        encoder outputs kept by image hash. threads: the encoder's ONNX Runtime threads (None: the engine's).
    """

    max_pixels: int | None = None
    max_images: int | None = None  # None: the build config's (10 unless it says otherwise)
    allowed_local_media_path: str | Path | None = None
    encoder_cache_bytes: int = ENCODER_CACHE_BYTES
    threads: int | None = None

    @property
    def rules(self) -> ImageRules:
        where = self.allowed_local_media_path
        return ImageRules(MAX_IMAGES if self.max_images is None else self.max_images,
                          None if where is None else Path(where))


def image_options(manifest: Manifest, options: ImageOptions) -> ImageOptions:
    """``options`` with what it leaves unset taken from the engine's build config."""
    built = manifest.build_config
    max_images = options.max_images if options.max_images is not None else built.max_images
    return dataclasses.replace(options, max_pixels=options.max_pixels or built.max_pixels,
                               max_images=MAX_IMAGES if max_images is None else max_images)


class EncoderCache:
    """Encoder outputs by image hash, least recently used first out, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES):
        self.max_bytes = max_bytes
        self._items: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: bytes, count: bool = True) -> np.ndarray | None:
        """The output kept for ``key``, or None; ``count``: add the lookup to the hits or misses."""
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += count
                return None
            self._items.move_to_end(key)
            self.hits += count
            return found

    def put(self, key: bytes, value: np.ndarray) -> None:
        if value.nbytes > self.max_bytes:
            return
        value.setflags(write=False)  # shared by every sequence with this image
        with self._lock:
            if key in self._items:
                return
            self._items[key] = value
            self._bytes += value.nbytes
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes

    def stats(self) -> dict:
        with self._lock:
            return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                    "encoder_cache_images": len(self._items), "encoder_cache_bytes": self._bytes}


@dataclass
class PreparedPrompt:
    """A prompt's token ids (with its images expanded), and what its sequence carries for the images."""

    ids: list[int]
    images: PromptImages | None = None
    mrope: MRope | None = None
    block_extras: list[bytes] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # decode, preprocess, encoder_wait, encode


class Encoder(Protocol):
    """A vision encoder: ``backends.onnxrt.vision_encoder.VisionEncoder`` or ``backends.trt.vision.TrtVisionEncoder``."""

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray: ...


class Cancelled(RequestError):
    """The caller gave up on the request while its images were being prepared."""


def _wait_for(acquire: Callable[[float], bool], cancel: threading.Event | None) -> None:
    """Call ``acquire(timeout)`` until it succeeds, looking at ``cancel`` before each try."""
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the request was cancelled while its images were prepared")
        if acquire(WAIT_S):
            return


class PixelBudget:
    """Pixels decoded at once, across requests: at most ``capacity`` (an image larger than that, which
    ``max_decode_pixels`` refuses by default, would go alone). When none is held any more after at
    least ``TRIM_AFTER_PIXELS`` were, the freed heap is handed back to the system (glibc keeps freed
    blocks under 32 MB for reuse)."""

    def __init__(self, capacity: int):
        self.capacity, self.used = capacity, 0
        self._since_trim = 0
        self._cv = threading.Condition()

    @contextlib.contextmanager
    def hold(self, pixels: int, cancel: threading.Event | None = None) -> Iterator[None]:
        def take(timeout: float) -> bool:
            with self._cv:
                if self.used and self.used + pixels > self.capacity:
                    self._cv.wait(timeout)
                    if self.used and self.used + pixels > self.capacity:
                        return False
                self.used += pixels
                return True

        _wait_for(take, cancel)
        try:
            yield
        finally:
            with self._cv:
                self.used -= pixels
                self._since_trim += pixels
                trim = self.used == 0 and self._since_trim >= TRIM_AFTER_PIXELS
                if trim:
                    self._since_trim = 0
                self._cv.notify_all()
            if trim:
                _give_back_memory()


def _give_back_memory() -> None:
    """glibc's ``malloc_trim(0)``: free heap pages go back to the system (nothing elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class ImagePipeline:
    def __init__(self, encoder: Encoder, vision: VisionSpec, config: ImageConfig, block_size: int,
                 cache_bytes: int = ENCODER_CACHE_BYTES, decode_budget: int = DECODE_BUDGET_PIXELS):
        self.vision, self.config, self.block_size = vision, config, block_size
        self.encoder = encoder
        self.cache = EncoderCache(cache_bytes)
        self.pixels = PixelBudget(decode_budget)
        self._encoding = threading.Lock()  # one image through the encoder at a time (``_encoded``)
        self._preparing = 0  # requests in ``prepare``
        self._count = threading.Lock()
        self._admitted = threading.BoundedSemaphore(PREPARED_AT_ONCE)

    def stats(self) -> dict:
        """The encoder cache's counts, and how many requests are waiting to decode their images,
        having them decoded, waiting for the encoder or encoded (``images_preparing``)."""
        with self._count:
            return {**self.cache.stats(), "images_preparing": self._preparing}

    def prepare(self, ids: list[int], sources: list[object], check: Callable[[list[int]], None],
                cancel: threading.Event | None = None, reserve: Callable[[int], None] | None = None) -> PreparedPrompt:
        """``ids`` (one placeholder per image) with the images of ``sources`` in place; ``check`` is
        called on the expanded ids, then ``reserve`` with the bytes the images' embeddings will take,
        before any pixel is decoded (either raises to refuse the prompt); ``Cancelled`` once ``cancel``
        is set."""
        with self._count:
            self._preparing += 1
        try:
            _wait_for(lambda timeout: self._admitted.acquire(timeout=timeout), cancel)
            try:
                return self._prepare(ids, sources, check, cancel, reserve)
            finally:
                self._admitted.release()
        finally:
            with self._count:
                self._preparing -= 1

    def _prepare(self, ids: list[int], sources: list[object], check: Callable[[list[int]], None],
                 cancel: threading.Event | None, reserve: Callable[[int], None] | None) -> PreparedPrompt:
        t0 = time.perf_counter()
        heads = [_image(k, open_header, source, self.config.max_decode_pixels) for k, source in enumerate(sources)]
        sizes = [(image.height, image.width) for image in heads]
        grids = [_image(k, self.config.grid, h, w) for k, (h, w) in enumerate(sizes)]
        v = self.vision
        check(expand(ids, v.image_token_id, grids, [b""] * len(grids), v.merge_size)[0])  # before any decoding
        total = sum(h * w for h, w in sizes)
        if total > MAX_REQUEST_PIXELS:
            raise ImageError(f"the request's images have {total:,} pixels in all; at most {MAX_REQUEST_PIXELS:,} are "
                             "accepted (resize them before sending)")
        if reserve is not None:  # the encoder's float32 [tokens, out_hidden] per image
            reserve(sum(tokens_of(g, v.merge_size) for g in grids) * v.out_hidden * 4)
        digests, embeds = [], []
        seconds = {"decode": time.perf_counter() - t0, "preprocess": 0.0, "encoder_wait": 0.0, "encode": 0.0}
        for k, grid in enumerate(grids):
            if cancel is not None and cancel.is_set():
                raise Cancelled("the request was cancelled while its images were prepared")
            t1 = time.perf_counter()
            with self.pixels.hold(sizes[k][0] * sizes[k][1], cancel):
                arr = _image(k, decode_rgb, heads[k])
                heads[k] = None  # Pillow's copy of the pixels goes now
                digest = image_digest(arr, grid)  # of the decoded pixels: cheap
                t2 = time.perf_counter()
                found = self.cache.get(digest)
                rows = pixel_rows(arr, self.config) if found is None else None
                del arr
            t3 = time.perf_counter()
            waited = 0.0
            if found is None:
                assert rows is not None
                found, waited = self._encoded(rows, grid, digest, cancel)
                del rows
            seconds["decode"] += t2 - t1
            seconds["preprocess"] += t3 - t2
            seconds["encoder_wait"] += waited
            seconds["encode"] += time.perf_counter() - t3 - waited
            digests.append(digest)
            embeds.append(found)
        ids, spans = expand(ids, v.image_token_id, grids, digests, v.merge_size)
        positions, delta = mrope_positions(len(ids), spans, v.merge_size)
        return PreparedPrompt(ids, PromptImages(tuple(s.start for s in spans), tuple(embeds)), MRope(positions, delta),
                              block_extras(len(ids), spans, self.block_size), seconds)

    def _encoded(self, rows: np.ndarray, grid: tuple[int, int, int], digest: bytes,
                 cancel: threading.Event | None) -> tuple[np.ndarray, float]:
        """An image's encoder output, and the seconds spent waiting for the encoder. Images are
        encoded one at a time: an encode already runs on every encoder thread, so several at once
        would share the cores and all finish late (measured: ``docs/runtime.md``). Once it is an image's turn the cache is
        read again, as another request may just have encoded the same screenshot."""
        t0 = time.perf_counter()
        _wait_for(lambda timeout: self._encoding.acquire(timeout=timeout), cancel)
        try:
            waited = time.perf_counter() - t0
            found = self.cache.get(digest, count=False)
            if found is None:
                found = self.encoder.encode(rows, grid)
                self.cache.put(digest, found)
        finally:
            self._encoding.release()
        return found, waited


def _image(k: int, work: Callable, *args: object):
    """``work(*args)`` on image ``k``, its ``ImageError`` saying which image it was."""
    try:
        return work(*args)
    except ImageError as exc:
        raise ImageError(f"image {k}: {exc}") from exc


def image_pipeline(manifest: Manifest, block_size: int, options: ImageOptions) -> ImagePipeline:
    """The engine's image front end: its vision encoder and preprocessing settings (``EngineError``
    when the engine lacks them)."""
    vision = ExportRecord.read(manifest.dir).vision()
    if vision is None:
        raise EngineError(f"{manifest.dir} holds a {manifest.spec.family} model but no vision encoder; rebuild it")
    if isinstance(options.max_images, bool) or not isinstance(options.max_images, int) or options.max_images < 0:
        raise EngineError(f"max_images must be a non-negative integer, got {options.max_images!r}")
    where = options.allowed_local_media_path
    if where is not None and not Path(where).is_dir():
        raise EngineError(f"allowed_local_media_path {where} is not a directory")
    try:
        config = ImageConfig.from_dir(manifest.dir, **({} if options.max_pixels is None
                                                       else {"max_pixels": options.max_pixels}))
    except RequestError as exc:
        raise EngineError(str(exc)) from exc
    if backend(manifest.backend).traits.compiled_vision:
        from ..backends.trt.vision import TrtVisionEncoder

        encoder: VisionEncoder | TrtVisionEncoder = TrtVisionEncoder(manifest.dir, vision, config.max_pixels)
    else:
        from ..backends.onnxrt.vision import vision_graph

        graph, _, library = vision_graph(manifest)
        encoder = VisionEncoder(manifest.dir, vision, options.threads, graph, library)
    return ImagePipeline(encoder, vision, config, block_size, options.encoder_cache_bytes)

