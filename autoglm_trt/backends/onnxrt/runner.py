"""The ONNX Runtime runner: one step of the engine contract on the CPU (``base.StepRunner``).

The pools are numpy arrays wrapped once as ``OrtValue`` (no copy on the CPU) and
bound with I/O binding, so a step passes only the small per-step inputs; a prefill step's new
K/V are scattered into the pools in place with numpy fancy indexing, all layers at once: the new
K/V outputs are bound to views of one stacked buffer. Outputs go into buffers we own. A decode
step's new K/V are stored by the native attention operator, where it runs, at the slots the
runner feeds (``native.slots``): after the step their cache lines are cold, and the scatter was a
measurable share of a decode step, at batch 1 and at 16 sequences (SmolLM2 INT8).
For decode steps the binding (pools and output buffers bound) is kept per batch size, so a
decode step only rebinds its small inputs (six, and the slots); a prefill step's outputs (new K/V of up to
max_batch x max_input_len tokens) are bound afresh, to views of buffers kept from one prefill to the
next (as large as the largest prefill so far).

The engine holds two graphs (``loader.py``): the native graph, rewritten at build time by the
passes of ``passes/`` (native operators for attention, rope, the linears and what follows them,
one branch per step), and the plain graph. ``open_session`` takes the native one where this
machine's native library loads and has what that graph requires (and the graph was made by
this version's passes), else the plain one; ``attention`` says which attention decode steps run
and why. Nothing is rewritten when an engine is loaded: its packed weights are read from
``model.native.bin`` (``loader.read_packed``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx

from ...graph import names
from ...kvcache.host_pools import KVPools, SlotMap
from ...model.spec import ModelSpec
from ...record_schema import OrtGraphs
from . import loader, passes
from .passes.common import SLOTS
from .session import make_session


def native_graph_here(graphs: OrtGraphs, target: passes.Target) -> str:
    """Why this machine cannot run an engine's saved native graph ("" when it can)."""
    if graphs.native_graph is None:
        return graphs.why or "the engine has no native graph"
    if graphs.packed_at_load is not None:  # what an older build wrote for packed weights over 1 GiB
        return ("the engine saved no packed weights for its native graph (an older autoglm-trt left them to be made "
                "at load); rebuild the engine for the native operators")
    if graphs.passes_version != passes.PASSES_VERSION:
        return (f"the engine's native graph was made by passes version {graphs.passes_version}, this autoglm-trt "
                f"has version {passes.PASSES_VERSION}; rebuild the engine for the native operators")
    if target.library is None:
        return target.why
    if lacks := target.lacks(graphs.requires):
        return (f"the engine's native graph needs {', '.join(lacks)}, which this machine's native library lacks; "
                "rebuild the engine on this machine for the native operators")
    return ""


def open_session(engine_dir: Path, graphs: OrtGraphs, threads: int, rewritten: passes.Rewritten | None = None,
                 spinning: bool = True) -> tuple[Any, str]:
    """A session over the engine's native graph where it can run here (``native_graph_here``), else
    over its plain graph; and which attention decode steps run: "native" or "graph (<why>)".
    ``rewritten``: run that graph instead of the saved native one (tests comparing sets of passes).
    ``spinning``: whether its threads spin waiting for work (``backends.onnxrt.session.session_options``)."""
    target = passes.Target.here()
    if rewritten is not None:
        why = target.why if target.library is None else "" if rewritten.native else "the graph has no native operator"
    else:
        why = native_graph_here(graphs, target)
    if not why:
        try:
            if rewritten is not None:
                session = make_session(rewritten.model.SerializeToString(), threads=threads,
                                       external_data_dir=engine_dir, custom_ops=target.library,
                                       initializers=rewritten.packed, spinning=spinning)
                return session, rewritten.attention
            native = engine_dir / str(graphs.native_graph)
            model = onnx.load(str(native), load_external_data=False)
            packed = loader.read_packed(model, engine_dir)
            session = make_session(native, threads=threads, custom_ops=target.library,
                                   initializers=packed, spinning=spinning)
            return session, graphs.attention
        except Exception as exc:  # noqa: BLE001 - the native library is an optimization: fall back, say why
            why = f"the native library {target.library} did not load: {exc}"
    return make_session(engine_dir / graphs.plain_graph, threads=threads, spinning=spinning), f"graph ({why})"


class OrtRunner:
    MAX_BINDINGS = 64  # decode batch sizes kept bound

    def __init__(self, engine_dir: Path, graphs: OrtGraphs, spec: ModelSpec, num_blocks: int, block_size: int,
                 kv_dtype: str, threads: int = 0, rewritten: passes.Rewritten | None = None, spinning: bool = True):
        import onnxruntime as ort

        self._ort = ort
        self.session, self.attention = open_session(Path(engine_dir), graphs, threads, rewritten, spinning)
        self.spec, self.kv_dtype = spec, np.dtype(kv_dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        inputs = {i.name for i in self.session.get_inputs()}
        self.token_scales = names.scale_of(names.past_key(0)) in inputs  # an INT8 KV cache with per-token scales
        self.pools = KVPools(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, kv_dtype,
                             self.token_scales)
        self._pool_values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in self.pools.feeds().items()}
        self._bindings: dict[tuple[int, int, int], tuple[Any, dict[str, np.ndarray], list[Any]]] = {}
        self._prefill: dict[str, np.ndarray] = {}  # a prefill's output buffers, by what they hold
        # where the graph has ``native.slots`` (``passes/attention.py``), decode steps' attention operator
        # stores their new K/V; with ``stores_kv`` False (tests) it is fed -1s and the runner scatters them
        self._slots = SLOTS if SLOTS in inputs else None
        self.stores_kv = self._slots is not None

    def _binding(self, batch: int, tokens: int, num_logits: int) -> tuple[Any, dict[str, np.ndarray], list[Any]]:
        """An I/O binding for this shape, the output buffers by name (``kv``: the stacked new K/V
        that ``new_key.<i>`` and ``new_value.<i>`` are views of) and their ``OrtValue``s."""
        key = (batch, tokens, num_logits)
        if key in self._bindings:
            return self._bindings[key]
        binding = self.session.io_binding()
        for name, value in self._pool_values.items():
            binding.bind_ortvalue_input(name, value)
        s = self.spec
        # a prefill's outputs are views of buffers kept for the next prefill (as large as the
        # largest so far): new arrays of its size (35 MB for 16 x 48 tokens of SmolLM2) came with
        # fresh pages to zero as ONNX Runtime wrote them, a measurable share of that prefill
        shapes = {"logits": ((batch, num_logits, s.vocab_size), np.dtype(np.float32)),
                  "kv": ((2, s.num_layers, batch, tokens, s.num_kv_heads, s.head_dim), self.kv_dtype)}
        if self.token_scales:
            shapes["kv_scale"] = ((2, s.num_layers, batch, tokens, s.num_kv_heads), np.dtype(np.float32))
        made = {name: np.empty(*shape) if tokens == 1 else self._scratch(name, *shape) for name, shape in shapes.items()}
        outs = {"logits": made["logits"]}
        for i in range(s.num_layers):
            for kind, name in enumerate((names.new_key(i), names.new_value(i))):
                outs[name] = made["kv"][kind, i]
                if self.token_scales:
                    outs[names.scale_of(name)] = made["kv_scale"][kind, i]
        values = [self._ort.OrtValue.ortvalue_from_numpy(arr) for arr in outs.values()]
        for name, value in zip(outs, values):
            binding.bind_ortvalue_output(name, value)
        outs.update((k, made[k]) for k in ("kv", "kv_scale") if k in made)
        if tokens == 1:  # decode: small, and the same shapes recur every step
            if len(self._bindings) >= self.MAX_BINDINGS:
                self._bindings.pop(next(iter(self._bindings)))
            self._bindings[key] = (binding, outs, values)
        return binding, outs, values

    def _scratch(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """An array of this shape and dtype in the prefill buffer ``name``, replaced by a larger one
        when it is too small."""
        size = int(np.prod(shape)) * dtype.itemsize
        if name not in self._prefill or self._prefill[name].size < size:
            self._prefill[name] = np.empty(size, np.uint8)
        return self._prefill[name][:size].view(dtype).reshape(shape)

    def step(self, feeds: dict[str, np.ndarray], slots: SlotMap) -> np.ndarray:
        batch, tokens = feeds["input_ids"].shape
        binding, outs, _ = self._binding(batch, tokens, feeds["logits_indices"].shape[1])
        for name, arr in feeds.items():
            binding.bind_cpu_input(name, arr)
        stored = self.stores_kv and tokens == 1
        if self._slots is not None:  # a decode step's attention operator stores its new K/V at these slots
            where = np.full(batch, -1, np.int64)
            if stored:
                where[slots.batch] = slots.block * self.block_size + slots.offset
            binding.bind_cpu_input(self._slots, where)
        self.session.run_with_iobinding(binding)
        if not stored:
            self.pools.write_stacked(outs["kv"], slots, outs.get("kv_scale"))
        # not a copy: a decode step's buffer is bound again by the next step of its shape (the
        # contract allows it); a new 3 MB array a 16-sequence step came with fresh pages to zero,
        # a measurable share of the fp32 engine's 16-request generate
        return outs["logits"][:, 0]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.pools.copy_blocks(pairs)  # in place: the bound OrtValues alias these arrays

    def close(self) -> None:
        self._bindings.clear()
        self._prefill.clear()
        self._pool_values.clear()
