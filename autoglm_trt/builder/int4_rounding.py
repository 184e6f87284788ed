"""The INT4 model's search and rounding: AWQ's scales per linear, and GPTQ's rounding layer by layer.

Input: the statistics pass's sampled input rows (AWQ) and summed Gram matrices (GPTQ) per linear,
the export's weights, ``Int4Settings``. Output: each linear's AWQ scales (``AwqSearch``; the
graph writer folds them in through ``calib.smooth.SmoothedWeights``) and, on the layer by layer
pass, each linear's GPTQ-rounded INT4 weights (``LayerRounding``): rounded as soon as a group of
layers has all its windows through, saved in a scratch folder until the graph is written
(``QuantPlan.rounded``), the group's sampled rows and Gram matrices then dropped. So a model
whose Gram matrices could never be held together (GLM-4-9B: 35 GiB) holds one layer's (0.94 GB)
and one layer's AWQ rows at a time. The whole-model pass keeps its Gram matrices, and the graph
writer rounds by them as it writes (``QuantPlan.gram``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from ..calib.collect import ActivationStats
from ..calib.smooth import SmoothedWeights
from ..graph.exported_weights import OpenedExport
from ..model.spec import ModelSpec
from ..quant.gptq import gptq_int4_blocks
from ..quant.int4 import Int4Blocks, pack_nibbles, quantize_int4_blocks


class AwqSearch:
    """AWQ's scales of the linears given to ``add``, with what the search found."""

    def __init__(self, spec: ModelSpec, block: int, symmetric: bool, total: int, log: Callable[[str], None]):
        self.spec, self.block, self.symmetric, self.total, self.log = spec, block, symmetric, total, log
        self.scales: dict[str, np.ndarray] = {}
        self.alphas: dict[str, float] = {}
        self.gains: list[float] = []
        self.t0 = time.perf_counter()

    def _dequantized(self, w: np.ndarray) -> np.ndarray:
        return quantize_int4_blocks(w, self.block, self.symmetric).dequantized()

    def _kv_shared(self, m: np.ndarray) -> np.ndarray:
        from ..calib.smooth import expand_groups, group_shared

        return expand_groups(group_shared(m, self.spec), self.spec)

    def add(self, samples: dict[str, np.ndarray], weights: SmoothedWeights, names: list[str]) -> None:
        """The scales of ``names`` on their rows in ``samples``, from the unscaled ``weights``."""
        from ..calib.awq import awq_scale
        from ..calib.thresholds import linear_matrix

        for name in names:
            choice = awq_scale(samples[name], linear_matrix(weights, name, {}), self._dequantized,
                               self._kv_shared if name.endswith(".o_proj") else None)
            self.scales[name], self.alphas[name] = choice.scale, choice.alpha
            self.gains.append(choice.rtn_error / max(choice.error, 1e-30))
            k = len(self.scales)
            if k % max(1, self.total // 10) == 0 or k == self.total:
                self.log(f"  AWQ search: {k}/{self.total} linears ({time.perf_counter() - self.t0:.1f} s)")

    def report(self) -> dict:
        if self.gains:
            self.log(f"AWQ: output error of plain rounding / with the scales, median {np.median(self.gains):.2f}x "
                     f"over {len(self.gains)} linears")
        return {"alpha": self.alphas, "median_error_ratio": float(np.median(self.gains)) if self.gains else None}


class LayerRounding:
    """``gather``'s ``on_group`` on the layer by layer pass: the group's AWQ scales (``awq``, if
    any), then each of its linears with a Gram matrix rounded by GPTQ on it (as the AWQ-scaled
    graph feeds the linear) and saved in ``folder``; the group's rows and Gram matrices dropped."""

    def __init__(self, opened: OpenedExport, awq: AwqSearch | None, block: int, symmetric: bool, folder: Path):
        self.base, self.spec, self.awq = opened.weights, opened.spec, awq
        self.block, self.symmetric, self.folder = block, symmetric, folder
        self.files: dict[str, Path] = {}
        self.seconds = 0.0

    def __call__(self, names: list[str], stats: ActivationStats) -> None:
        t0 = time.perf_counter()
        if self.awq is not None:
            self.awq.add(stats.sample, SmoothedWeights(self.base, self.spec, {}), names)
        scales = self.awq.scales if self.awq is not None else {}
        weights = SmoothedWeights(self.base, self.spec, scales)
        from ..calib.thresholds import linear_matrix

        for name in names:
            stats.sample.pop(name, None)
            if name not in stats.gram:
                continue
            # the scaled sums to a file, read as float64 when GPTQ asks (again if it damps more): the
            # float32 matrix is let go before the float64 one is made
            gram = scaled(stats.gram.pop(name), scales.get(name))
            kept = self.folder / f"{name}.gram.npy"
            np.save(kept, gram)
            del gram
            rounded = gptq_int4_blocks(linear_matrix(weights, name, {}), partial(_read64, kept), self.block,
                                       self.symmetric)
            kept.unlink()
            self.files[name] = save_blocks(self.folder / f"{name}.npz", rounded)
        self.seconds += time.perf_counter() - t0

    def loaders(self) -> dict[str, Callable[[], Int4Blocks]]:
        """Each rounded linear's weights, read from its file when the graph writer asks."""
        return {name: partial(load_blocks, path) for name, path in self.files.items()}


def scaled(gram: np.ndarray, scale: np.ndarray | None) -> np.ndarray:
    """A Gram matrix X^T X as the AWQ-scaled graph feeds its linear: X^T X / s s^T (in place)."""
    if scale is not None:
        inv = (1.0 / scale).astype(np.float32)
        gram *= inv[:, None]
        gram *= inv[None, :]
    return gram


def _read64(path: Path) -> np.ndarray:
    return np.load(path, mmap_mode="r").astype(np.float64)


def save_blocks(path: Path, blocks: Int4Blocks) -> Path:
    """``blocks`` as an ``.npz`` of plain arrays (its values two to a byte)."""
    np.savez(path, q=pack_nibbles(blocks.q), shape=np.array(blocks.q.shape, np.int64), scale=blocks.scale,
             zero=blocks.zero if blocks.zero is not None else np.zeros(0, np.uint8), block=np.int64(blocks.block))
    return path


def load_blocks(path: Path) -> Int4Blocks:
    """What ``save_blocks`` wrote (no pickles)."""
    with np.load(path, allow_pickle=False) as f:
        shape = tuple(int(d) for d in f["shape"])
        packed, zero = f["q"], f["zero"]
        nibbles = np.empty(packed.size * 2, np.int8)
        nibbles[0::2], nibbles[1::2] = packed & 0xF, packed >> 4
        q = nibbles[: int(np.prod(shape))].reshape(shape)
        symmetric = zero.size == 0
        if symmetric:  # -7..7 stored as their low nibbles
            q = np.where(q > 7, q - 16, q).astype(np.int8)
        return Int4Blocks(q, f["scale"].copy(), None if symmetric else zero.copy(), int(f["block"]))
