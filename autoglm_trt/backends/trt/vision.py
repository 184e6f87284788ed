"""The vision encoder as a TensorRT engine (``vision.plan``, built from ``vision.onnx`` in TensorRT's
form, ``graph.vision_trt``, with one optimization profile over the patch count,
``builder.profiles.vision_profile``; float32 in and out whatever type it computes in).

Same contract as ``backends.onnxrt.vision_encoder.VisionEncoder``: ``encode(pixel rows, grid)`` -> the image
tokens' embeddings, with the per-grid inputs from the host (``grid_inputs``). Device buffers are
sized once for the profile's largest image; one image a run, under a lock (callers' threads share
the engine). Imported only for a TensorRT engine; type-checked against ``tensorrt-stubs``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from ...artifacts import EngineError
from ...model.vision import VisionSpec
from ..onnxrt.vision_encoder import GridInputs

VISION_PLAN = "vision.plan"
INPUTS = ("pixel_values", "pos_embed", "rope_cos", "rope_sin")


class TrtVisionEncoder:
    def __init__(self, engine_dir: Path, vision: VisionSpec, max_pixels: int):
        from . import cuda as cu
        from .probe import require_tensorrt

        require_tensorrt()
        import tensorrt as trt

        self.vision, self.cu = vision, cu
        self.grids = GridInputs(engine_dir, vision)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine((Path(engine_dir) / VISION_PLAN).read_bytes())
        if self.engine is None:
            raise EngineError(f"TensorRT could not deserialize {VISION_PLAN}; rebuild the engine with this TensorRT")
        self.context = self.engine.create_execution_context()
        self.stream = cu.Stream()
        self.max_patches = vision.max_patches(max_pixels)
        row = 3 * vision.temporal_patch_size * vision.patch_size ** 2
        widths = {"pixel_values": row, "pos_embed": vision.hidden_size, "rope_cos": vision.head_dim,
                  "rope_sin": vision.head_dim}
        f32 = np.dtype(np.float32)
        self.device = {name: cu.DeviceArray.empty((self.max_patches, w), f32) for name, w in widths.items()}
        tokens = self.max_patches // vision.merge_size ** 2
        self.device["image_embeds"] = cu.DeviceArray.empty((tokens, vision.out_hidden), f32)
        self.host = cu.PinnedArray((tokens, vision.out_hidden), f32)
        self._lock = threading.Lock()

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        _, h, w = grid
        if h * w > self.max_patches:
            raise EngineError(f"an image of {h} x {w} patches exceeds the vision engine's profile "
                              f"({self.max_patches} patches); rebuild it with a larger max_pixels")
        feeds = {"pixel_values": np.ascontiguousarray(pixels, np.float32), **self.grids(h, w)}
        tokens = h * w // self.vision.merge_size ** 2
        with self._lock:
            for name in INPUTS:
                arr = feeds[name]
                self.device[name].copy_from_host(arr, self.stream)
                if not self.context.set_input_shape(name, arr.shape):
                    raise EngineError(f"TensorRT refused {name} of shape {arr.shape} (the vision profile)")
                self.context.set_tensor_address(name, self.device[name].ptr)
            self.context.set_tensor_address("image_embeds", self.device["image_embeds"].ptr)
            if not self.context.execute_async_v3(self.stream.handle):
                raise EngineError("TensorRT execute_async_v3 failed on the vision engine; see TensorRT's log above")
            self.device["image_embeds"].copy_to_host(self.host, tokens, self.stream)
            self.stream.synchronize()
            return self.host.array[:tokens].copy()

    def close(self) -> None:
        for arr in self.device.values():
            arr.free()
        self.host.free()
