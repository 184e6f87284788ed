"""The ONNX Runtime runner: one step of the engine contract on the CPU (``base.StepRunner``).

The pools are numpy arrays wrapped once as ``OrtValue`` (no copy on the CPU) and
bound with I/O binding, so a step passes only the small per-step inputs; a prefill step's new
K/V are scattered into the pools in place with numpy fancy indexing, all layers at once: the new
K/V outputs are bound to views of one stacked buffer. Outputs go into buffers we own. A decode
step's new K/V are stored by the native attention operator, where it runs, at the slots the
runner feeds (``native.slots``): after the step their cache lines are cold, and the scatter took
~0.12 ms of a 6-8 ms batch-1 step and ~0.8 ms of a 16-sequence one (ad hoc, SmolLM2 INT8).
For decode steps the binding (pools and output buffers bound) is kept per batch size, so a
decode step only rebinds its small inputs (six, and the slots); a prefill step's outputs (new K/V of up to
max_batch x max_input_len tokens) are bound afresh, to views of buffers kept from one prefill to the
next (as large as the largest prefill so far).

The graph is rewritten for ONNX Runtime as it is loaded. Where an installed build of the native
library runs on this CPU (``autoglm_trt.native``): decode steps' attention runs in the ``PagedAttention`` operator
(``attention_op.py``), reading the pools in place instead of gathering every layer's past into
a new tensor on every step (``attention`` says which form runs and why), and each INT8
linear (its input rotation + quantization, GEMM and scaling) is one ``Int8Linear`` over
weights repacked for the CPU's 8-bit dot products (``linear_op.py``), which the session reads in
place from one buffer on huge pages (``weights_arena.py``), as are the float linears' weights,
repacked for ``FloatLinear`` (MatMul's sums, bit for bit); a step branches once between its
decode and prefill forms (``step_branch.py``). Always: each residual Add + RMSNorm is one node
(``fusions.py``). If the library does not load, the graph's own nodes run and ``attention``
says why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...graph.session import make_session
from ...kvcache.host_pools import KVPools, SlotMap
from ...model.spec import ModelSpec


def load_rewritten(model_path: Path, spec: ModelSpec, kv_dtype: np.dtype,
                   pack: bool = True) -> tuple[Any, dict, Path | None, bool, str]:
    """The engine graph as ONNX Runtime runs it here (without its weights), rewritten where the
    native library builds: decode-step attention, each layer's QKV split + rope, the INT8
    linears; where the library has FMA the float linears, SiLU * up and each residual + RMSNorm
    into the linear before it; and the graph below the decode condition as one ``If``
    (``step_branch.py``); always: residual + RMSNorm fused. Returns (model, packed weights by name, the
    library or None, whether decode steps run the attention operator, why not). ``pack``
    False: the nodes only, for counting (``linear_op.rewrite``)."""
    import onnx

    from ...native import float_kernel, softmax_exact
    from ...native import library as native_library
    from . import linear_epilogues, linear_op, rope_op
    from .attention_op import rewrite
    from .fusions import hadamard_quantize, skip_rms_norm
    from .step_branch import branch_once

    model = onnx.load(str(model_path), load_external_data=False)
    library, why = native_library()
    native_attention, packed, fma = False, {}, False
    if library is not None:
        try:  # what the build can repeat bit for bit: Softmax (the prefill's softmax as one node) and,
            # with FMA, MatMul's sums (without it, FloatLinear's sums would not be MatMul's)
            exact, fma = softmax_exact(library), float_kernel(library) != "portable C"
        except (OSError, AttributeError):  # a library that does not load: the session fails and says so
            exact, fma = False, False
        if kv_dtype in (np.float32, np.int8):
            native_attention, why = rewrite(model, spec.num_layers, exact)
        else:
            why = f"the KV cache is {kv_dtype.name} (the native kernel reads float32 or int8)"
        fused_rope = rope_op.rewrite(model, spec.num_layers, spec.num_heads, spec.num_kv_heads, model_path.parent)
        quantized = hadamard_quantize(model)
        if quantized or fma:
            packed = linear_op.rewrite(model, model_path.parent, pack, fma)
        elif not native_attention and not fused_rope:
            library = None
    skip_rms_norm(model)
    if fma:  # where ONNX Runtime's own float code is what these builds were checked against (x86-64)
        linear_epilogues.fuse_skip_norm(model)  # each residual + RMSNorm into the linear before it
    if native_attention:
        branch_once(model)
    return model, packed, library, native_attention, why


def decode_nodes(model: Any) -> dict[str, int]:
    """Node count by operator of a decode step of a graph from ``load_rewritten``: the decode
    branch of an ``If`` on ``native.decode`` (the step's, or a layer's) in place of the ``If``."""
    from collections import Counter

    from .attention_op import DECODE_CONDITION

    counts: Counter = Counter()
    for node in model.graph.node:
        if node.op_type == "If" and list(node.input) == [DECODE_CONDITION]:
            counts.update(n.op_type for a in node.attribute if a.name == "then_branch" for n in a.g.node)
        else:
            counts[node.op_type] += 1
    return dict(counts)


def _session(model_path: Path, spec: ModelSpec, kv_dtype: np.dtype, threads: int) -> tuple[Any, str]:
    """The engine's session over ``load_rewritten``'s graph, and which attention decode steps
    run: "native" or "graph (<why>)"."""
    import onnx

    from .fusions import skip_rms_norm

    model, packed, library, native_attention, why = load_rewritten(model_path, spec, kv_dtype)
    try:
        session = make_session(model.SerializeToString(), threads=threads, external_data_dir=model_path.parent,
                               custom_ops=library, initializers=packed)
    except Exception as exc:  # noqa: BLE001 - the native library is an optimization: fall back, say why
        if library is None:
            raise
        model = onnx.load(str(model_path), load_external_data=False)
        skip_rms_norm(model)
        session = make_session(model.SerializeToString(), threads=threads, external_data_dir=model_path.parent)
        return session, f"graph (the native library {library} did not load: {exc})"
    return session, "native" if native_attention else f"graph ({why})"


class OrtRunner:
    MAX_BINDINGS = 64  # decode batch sizes kept bound

    def __init__(self, model_path: Path, spec: ModelSpec, num_blocks: int, block_size: int, kv_dtype: str,
                 threads: int = 0):
        import onnxruntime as ort

        from .attention_op import SLOTS

        self._ort = ort
        self.session, self.attention = _session(model_path, spec, np.dtype(kv_dtype), threads)
        self.spec, self.kv_dtype = spec, np.dtype(kv_dtype)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pools = KVPools(spec.num_layers, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, kv_dtype)
        self._pool_values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in self.pools.feeds().items()}
        self._bindings: dict[tuple[int, int, int], tuple[Any, dict[str, np.ndarray], list[Any]]] = {}
        self._prefill: dict[str, np.ndarray] = {}  # a prefill's output buffers, by what they hold
        # where the graph has ``native.slots`` (``attention_op.py``), decode steps' attention operator
        # stores their new K/V; with ``stores_kv`` False (tests) it is fed -1s and the runner scatters them
        self._slots = SLOTS if SLOTS in {i.name for i in self.session.get_inputs()} else None
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
        # fresh pages to zero as ONNX Runtime wrote them, 5% of that prefill (ad hoc)
        shapes = {"logits": ((batch, num_logits, s.vocab_size), np.dtype(np.float32)),
                  "kv": ((2, s.num_layers, batch, tokens, s.num_kv_heads, s.head_dim), self.kv_dtype)}
        made = {name: np.empty(*shape) if tokens == 1 else self._scratch(name, *shape) for name, shape in shapes.items()}
        outs, kv = {"logits": made["logits"]}, made["kv"]
        for i in range(s.num_layers):
            outs[f"new_key.{i}"], outs[f"new_value.{i}"] = kv[0, i], kv[1, i]
        values = [self._ort.OrtValue.ortvalue_from_numpy(arr) for arr in outs.values()]
        for name, value in zip(outs, values):
            binding.bind_ortvalue_output(name, value)
        outs["kv"] = kv
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
            self.pools.write_stacked(outs["kv"], slots)
        # not a copy: a decode step's buffer is bound again by the next step of its shape (the
        # contract allows it); a new 3 MB array a 16-sequence step came with fresh pages to zero,
        # ~3% of the fp32 engine's 16-request generate (ad hoc, alternating calls in one process)
        return outs["logits"][:, 0]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.pools.copy_blocks(pairs)  # in place: the bound OrtValues alias these arrays

    def close(self) -> None:
        self._bindings.clear()
        self._prefill.clear()
        self._pool_values.clear()
