"""Running a graph offline, on ONNX Runtime: whole-sequence logits, and a batch's tensors.

``GraphRunner``: a model directory with ``export.json`` (its ``graph.file`` names the ONNX file)
and token windows in, logits at every position out, from a prefill with an empty paged cache
(``eval``, the accuracy gate, export's validation). ``BoundSession``: any graph's session run
with chosen outputs written into buffers kept between batches (calibration's statistics passes,
whole-graph and layer by layer). ``prefill_feeds`` makes a prefill's inputs for either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ...artifacts import ExportRecord, inside
from ...errors import AutoGLMError
from ...graph import names
from ...kvcache.host_pools import KVPools
from ...kvcache.layout import blocks_needed
from ...kvcache.step_inputs import MRope, PromptImages, SeqState, StepImages, step_inputs
from ...model.spec import ModelSpec
from ...precisions import Form, precision
from .session import make_session, run


@dataclass(frozen=True)
class WindowImages:
    """The images of a batch of equal-length windows (calibration's image windows): for each
    window its image's first token and embeddings ``[tokens, hidden]`` (None: a text window), and
    every window's 3-D positions ``[3, windows, tokens]``."""

    items: list[tuple[int, np.ndarray] | None]
    positions: np.ndarray

    def take(self, a: int, b: int) -> WindowImages:
        return WindowImages(self.items[a:b], self.positions[:, a:b])

    def step_args(self, hidden: int) -> dict:
        """``step_inputs``' ``mrope`` and ``images`` for these windows, prefilled from position 0."""
        return {"mrope": [MRope(self.positions[:, k]) for k in range(len(self.items))],
                "images": StepImages(hidden, [None if it is None else PromptImages((it[0],), (it[1],))
                                              for it in self.items])}

    def substitute(self, hidden: np.ndarray) -> None:
        """Put the image rows into ``hidden`` ``[windows, tokens, width]`` (the embedding of the windows)."""
        for k, it in enumerate(self.items):
            if it is not None:
                hidden[k, it[0] : it[0] + len(it[1])] = it[1]


def text_only(spec: ModelSpec, batch: int) -> dict:
    """``step_inputs``' ``mrope`` and ``images`` for a batch of text-only sequences of this model."""
    return {"mrope": [None] * batch if spec.mrope else None,
            "images": StepImages.text(spec.hidden_size, batch) if spec.vision else None}


def prefill_feeds(spec: ModelSpec, windows: np.ndarray, kv_dtype: str, all_logits: bool = False,
                  images: WindowImages | None = None, token_scales: bool = False) -> dict[str, np.ndarray]:
    """Graph inputs for a prefill of equal-length windows with nothing cached (``images``: theirs,
    for a vision family; ``token_scales``: the graph's INT8 KV cache has per-token scale pools).

    One pool block (masked out by ``context_lens`` 0) suffices, and the new K/V outputs are not
    written back.
    """
    batch, seq_len = windows.shape
    block = 16
    pools = KVPools(spec.num_layers, 1, block, spec.num_kv_heads, spec.head_dim, kv_dtype, token_scales)
    states = [SeqState(0, [0] * -(-seq_len // block)) for _ in range(batch)]
    extra = text_only(spec, batch) if images is None else images.step_args(spec.hidden_size)
    feeds, _ = step_inputs([list(map(int, w)) for w in windows], states, block, all_logits=all_logits, **extra)
    return {**feeds, **pools.feeds()}


class GraphRunner:
    """One ONNX Runtime session over a model directory's graph."""

    def __init__(self, model_dir: Path, onnx_file: str | None = None, threads: int | None = None,
                 session: Any = None, no_store: str | None = None):
        """``session``: one already open over the directory's graph (an engine's native graph);
        ``no_store``: its input that says where each sequence's new K/V is stored, fed -1 (nowhere:
        the K/V outputs are written back here)."""
        self.record = ExportRecord.read(model_dir)
        self.dir = self.record.dir
        self.spec: ModelSpec = self.record.spec
        self.kv_dtype = self.record.kv_dtype
        self.no_store = no_store
        if session is None:
            path = inside(self.dir, onnx_file, "the ONNX file") if onnx_file else self.record.graph_file
            if not path.is_file():
                raise AutoGLMError(f"{path} is missing")
            # an INT8 Q/DQ graph as the engines compute it (exact integer products), on any CPU
            session = make_session(path, threads=threads, float_qdq=precision(self.record.precision).model is Form.INT8)
        self.session = session
        self.token_scales = names.scale_of(names.past_key(0)) in {i.name for i in session.get_inputs()}

    def logits(self, windows: np.ndarray) -> np.ndarray:
        """float32 logits ``[batch, seq_len, vocab]`` of a batch of equal-length windows."""
        return run(self.session, self._stored_nowhere(prefill_feeds(self.spec, windows, self.kv_dtype, all_logits=True,
                                                                    token_scales=self.token_scales),
                                                      len(windows)))["logits"]

    def _stored_nowhere(self, feeds: dict, batch: int) -> dict:
        return feeds if self.no_store is None else {**feeds, self.no_store: np.full(batch, -1, np.int64)}

    def paged_logits(self, windows: np.ndarray, step_tokens: int, block_size: int = 16) -> np.ndarray:
        """The same logits, computed ``step_tokens`` tokens per step through a paged pool, so that
        every step attends to a past read back from the pool (as stored: int8 in an INT8 KV cache).
        ``step_tokens`` 1 is pure decode."""
        batch, seq_len = windows.shape
        per_seq = blocks_needed(seq_len, block_size)
        pools = KVPools(self.spec.num_layers, batch * per_seq, block_size, self.spec.num_kv_heads,
                        self.spec.head_dim, self.kv_dtype, self.token_scales)
        # block ids interleaved between the sequences, so a wrong block table reads another's past
        states = [SeqState(0, [b + batch * k for k in range(per_seq)]) for b in range(batch)]
        out = np.empty((batch, seq_len, self.spec.vocab_size), np.float32)
        for start in range(0, seq_len, step_tokens):
            chunk = [list(map(int, w[start : start + step_tokens])) for w in windows]
            feeds, slots = step_inputs(chunk, states, block_size, all_logits=True, **text_only(self.spec, batch))
            res = run(self.session, self._stored_nowhere({**feeds, **pools.feeds()}, batch))
            pools.write(res, slots)
            out[:, start : start + len(chunk[0])] = res["logits"]
            for st in states:
                st.num_computed_tokens += len(chunk[0])
        return out


class BoundSession:
    """A session run with its ``outputs`` written straight into buffers kept from one batch to the
    next (no allocation and copy of every requested tensor per batch), made again when a batch's
    (rows, tokens) changes; ``shapes`` make each buffer's shape of those, ``dtypes`` its type
    (float32 by default). Feeds the session has no input for are left out."""

    def __init__(self, session: Any, outputs: list[str], shapes: list[Callable[[int, int], tuple[int, ...]]],
                 dtypes: list[np.dtype] | None = None):
        self.session, self.outputs, self.shapes = session, outputs, shapes
        self.dtypes = dtypes or [np.dtype(np.float32)] * len(outputs)
        self.wanted = {i.name for i in session.get_inputs()}
        self.buffers: list[np.ndarray] = []
        self.key: tuple[int, int] | None = None

    def run(self, feeds: dict[str, np.ndarray], rows: int, tokens: int,
            into: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """The buffers of ``outputs`` after one run on ``feeds``; ``into``: more outputs, written into
        the caller's arrays (a group's residual stream, into the next group's input)."""
        if (rows, tokens) != self.key:
            self.buffers = [np.empty(shape(rows, tokens), dtype) for shape, dtype in zip(self.shapes, self.dtypes)]
            self.key = (rows, tokens)
        binding = self.session.io_binding()
        for name, arr in feeds.items():
            if name in self.wanted:
                binding.bind_cpu_input(name, arr)
        for name, arr in [*zip(self.outputs, self.buffers), *(into or {}).items()]:
            binding.bind_output(name, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
        self.session.run_with_iobinding(binding)
        return self.buffers
