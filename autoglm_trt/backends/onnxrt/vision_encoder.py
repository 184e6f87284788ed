"""GLM-4.1V's vision encoder at run time: one image's pixel rows and grid in, its image-token
embeddings out (``graph.vision``'s graph in an ONNX Runtime session; TensorRT's encoder,
``backends.trt.vision``, shares its per-grid inputs).

The graph's per-grid inputs (the resampled position embedding and the 2-D rope tables,
``model.vision``) depend on the grid alone; phone screenshots of one device share it, so the
last ``GRID_CACHE`` grids' inputs are kept. Images are encoded one a run: each attends to its
own patches only. Thread-safe (ONNX Runtime sessions run concurrently; the grid cache is locked).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from ...graph.vision import VISION_GRAPH, VISION_POSITIONS
from ...model.vision import VisionSpec, resampled_positions, rope_tables
from .session import make_session

GRID_CACHE = 4


class GridInputs:
    """The per-grid inputs of the encoder, the last ``GRID_CACHE`` grids' kept (thread-safe)."""

    def __init__(self, model_dir: Path, spec: VisionSpec):
        self.spec = spec
        self.table = np.load(Path(model_dir) / VISION_POSITIONS, allow_pickle=False)
        if self.table.ndim != 2 or self.table.shape[1] != spec.hidden_size:
            raise ValueError(f"{VISION_POSITIONS} holds a {self.table.shape} table, not [positions, {spec.hidden_size}]")
        self._grids: OrderedDict[tuple[int, int], dict[str, np.ndarray]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, h: int, w: int) -> dict[str, np.ndarray]:
        """``pos_embed``, ``rope_cos`` and ``rope_sin`` of an ``h x w`` patch grid."""
        with self._lock:
            if (h, w) in self._grids:
                self._grids.move_to_end((h, w))
                return self._grids[(h, w)]
        s = self.spec
        cos, sin = rope_tables(s.head_dim, s.rope_theta, h, w, s.merge_size)
        made = {"pos_embed": resampled_positions(self.table, h, w, s.merge_size), "rope_cos": cos, "rope_sin": sin}
        with self._lock:
            self._grids[(h, w)] = made
            while len(self._grids) > GRID_CACHE:
                self._grids.popitem(last=False)
        return made


class VisionEncoder:
    """The encoder graph (``graph``: the float32 one, or another form of it) in an ONNX Runtime
    session (``custom_ops``: the native library a form with native operators needs)."""

    def __init__(self, model_dir: Path, spec: VisionSpec, threads: int | None = None, graph: str = VISION_GRAPH,
                 custom_ops: Path | None = None):
        self.spec, self.graph = spec, graph
        self.session = make_session(Path(model_dir) / graph, threads=threads, custom_ops=custom_ops)
        self.grid_inputs = GridInputs(model_dir, spec)

    def encode(self, pixels: np.ndarray, grid: tuple[int, int, int]) -> np.ndarray:
        """float32 ``[tokens, out_hidden]``: one image's embeddings (``pixels``: its rows of
        ``model.image.preprocess``; ``grid``: its (t, h, w))."""
        _, h, w = grid
        feeds = {"pixel_values": np.ascontiguousarray(pixels, np.float32), **self.grid_inputs(h, w)}
        return self.session.run(["image_embeds"], feeds)[0]

    def close(self) -> None:
        self.session = None
