"""ONNX Runtime "build": optimize the graph once, apply the rewrite passes, save both graphs.

Input: an ONNX graph of the engine contract. Output, in the engine directory:
``model.opt.onnx`` (+ its weights file), ONNX Runtime's optimized graph (the engine file);
``model.plain.onnx``, that graph with the passes that need no native code (it runs anywhere);
where this machine's native library loads, ``model.native.onnx`` with the native operators
(``passes/``) and its packed weights in ``model.native.bin`` (both graphs read the other weights
from ``model.opt.onnx.data``); a fusion report (operator counts before and after, the fusions
ONNX Runtime made); and the manifest's record of the graphs (``write_graphs``). ``read_packed`` is
the runner's side: the packed weights read back into one huge-page buffer. Loading runs no pass,
at any size: a 9B's packed weights are saved like a 135M's, beside the original weights that the
plain graph reads (docs/native.md says what that costs on disk).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import numpy as np
import onnx

from ...model.spec import ModelSpec
from ...record_schema import OrtGraphs
from . import passes, weights_arena
from .session import make_session

OPT_GRAPH, PLAIN_GRAPH = "model.opt.onnx", "model.plain.onnx"
NATIVE_GRAPH, NATIVE_WEIGHTS = "model.native.onnx", "model.native.bin"

# Operators that only appear when an ONNX Runtime fusion fired, and what that fusion is.
FUSED_OPS = {
    "SimplifiedLayerNormalization": "RMSNorm (Pow/ReduceMean/Add/Sqrt/Div/Mul -> one kernel)",
    "SkipSimplifiedLayerNormalization": "residual Add + RMSNorm",
    "FusedMatMul": "MatMul with a folded Transpose/scale",
    "MatMulIntegerToFloat": "INT8 Q/DQ + MatMul -> integer GEMM with float output",
    "QLinearMatMul": "Q/DQ + MatMul -> quantized GEMM",
    "DynamicQuantizeMatMul": "dynamic activation quantization + integer GEMM",
    "RotaryEmbedding": "rotary embedding",
    "GroupQueryAttention": "attention",
    "MultiHeadAttention": "attention",
    "BiasGelu": "bias + GELU",
    "QuickGelu": "x * sigmoid(alpha * x): SiLU when alpha = 1",
    "Gelu": "GELU",
    "FusedConv": "conv + activation",
}


def op_counts(model_path: Path) -> Counter:
    model = onnx.load(str(model_path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def optimize(model_path: Path, out_dir: Path, threads: int = 0, rewritten: onnx.ModelProto | None = None) -> dict:
    """Optimize ``model_path`` (or ``rewritten``, a changed copy of its graph whose weights are
    still beside ``model_path``) into ``out_dir/model.opt.onnx``; return the fusion report."""
    source: Path | bytes = model_path if rewritten is None else rewritten.SerializeToString()
    make_session(source, threads=threads, save_optimized=out_dir / "model.opt.onnx",
                 external_data_dir=None if rewritten is None else model_path.parent, prepacking=False)
    before = Counter(n.op_type for n in rewritten.graph.node) if rewritten is not None else op_counts(model_path)
    after = op_counts(out_dir / "model.opt.onnx")
    fired = {op: {"count": after[op], "what": what} for op, what in FUSED_OPS.items() if after[op] > before[op]}
    return {
        "backend": "onnxruntime",
        "optimization_level": "ORT_ENABLE_ALL",
        "execution_provider": "CPUExecutionProvider",
        "nodes_before": sum(before.values()),
        "nodes_after": sum(after.values()),
        "ops_before": dict(sorted(before.items())),
        "ops_after": dict(sorted(after.items())),
        "fusions": fired,
    }


def write_graphs(out_dir: Path, spec: ModelSpec, kv_dtype: str, target: passes.Target | None = None,
                 dynamic_int8: bool = False, bf16_attention: bool = False) -> OrtGraphs:
    """After ``optimize``: the plain graph, and the native graph and its packed weights where
    ``target`` (this machine's library by default) has one; the manifest's record of them.
    ``dynamic_int8`` (``int8-dyn``): blocked INT8 weights run with activations quantized per block;
    ``bf16_attention``: a prefill's attention in bfloat16 where AMX has it."""
    target = target or passes.Target.here()
    plain = passes.rewrite(out_dir / OPT_GRAPH, spec, kv_dtype, target, only=passes.PLAIN)
    native = passes.rewrite(out_dir / OPT_GRAPH, spec, kv_dtype, target, dynamic_int8=dynamic_int8,
                            bf16_attention=bf16_attention)
    onnx.save(plain.model, str(out_dir / PLAIN_GRAPH))  # its weights stay in model.opt.onnx.data
    record = OrtGraphs(passes.PASSES_VERSION, [r.as_dict() for r in native.results], [], native.attention,
                       native.attention_why, "", PLAIN_GRAPH)
    if not native.native:
        return dataclasses.replace(record, why=target.why or "no pass found anything to rewrite")
    save_native(native, out_dir)
    return dataclasses.replace(record, native_graph=NATIVE_GRAPH, requires=native.requires(),
                               native_weights=NATIVE_WEIGHTS if native.packed else None)


def save_native(rewritten: passes.Rewritten, out_dir: Path) -> None:
    """``model.native.onnx`` and its packed weights: the arrays of one buffer (``weights_arena``)
    written as ``model.native.bin``, each initializer naming its offset and length there."""
    import os

    arrays = rewritten.packed
    graph = rewritten.model.graph
    if arrays:
        first = next(iter(arrays.values()))
        owner = (first.base if first.base is not None else first).reshape(-1).view(np.uint8)  # the arena's memory
        start = min(a.ctypes.data for a in arrays.values())  # the arena's first array: 2 MiB aligned
        end = max(a.ctypes.data + a.nbytes for a in arrays.values()) - start
        for t in graph.initializer:
            if t.name in arrays:
                entries = {e.key: e for e in t.external_data}
                entries["location"].value = NATIVE_WEIGHTS
                entries["offset"].value = str(arrays[t.name].ctypes.data - start)
        tmp = out_dir / (NATIVE_WEIGHTS + ".partial")
        with open(tmp, "wb") as f:
            lo = start - owner.ctypes.data
            f.write(owner[lo:lo + end].data)
        os.replace(tmp, out_dir / NATIVE_WEIGHTS)
    onnx.save(rewritten.model, str(out_dir / NATIVE_GRAPH))


def read_packed(model: onnx.ModelProto, engine_dir: Path) -> dict[str, np.ndarray]:
    """The packed weights a native graph names in ``model.native.bin``, read into one buffer aligned
    to 2 MiB and advised for huge pages, as arrays by initializer name (the session reads them in
    place)."""
    specs: list[tuple[str, tuple[int, ...], np.dtype, int]] = []
    for t in model.graph.initializer:
        entries = {e.key: e.value for e in t.external_data}
        if entries.get("location") == NATIVE_WEIGHTS:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
            specs.append((t.name, tuple(int(d) for d in t.dims), dtype, int(entries.get("offset", 0))))
    if not specs:
        return {}
    path = engine_dir / NATIVE_WEIGHTS
    size = path.stat().st_size
    buf = weights_arena.allocate(-(-size // weights_arena.HUGE_PAGE) * weights_arena.HUGE_PAGE)
    with open(path, "rb") as f:
        if f.readinto(buf[:size].data) != size:
            raise OSError(f"{path} is shorter than its graph says")
    weights_arena.settle(buf)
    out = {}
    for name, shape, dtype, offset in specs:
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if offset < 0 or offset + n > size:
            raise OSError(f"{path}: {name} lies outside the file")
        out[name] = buf[offset:offset + n].view(dtype).reshape(shape)
    return out
