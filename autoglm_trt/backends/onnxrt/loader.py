"""ONNX Runtime "build": apply all graph optimizations once and save the optimized model.

Input: an ONNX graph of the engine contract. Output: ``model.opt.onnx`` (+ its weights file)
in the engine directory, the session options used, and a fusion report (operator counts
before and after, and the fused operators ONNX Runtime introduced).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx

from ...graph.session import make_session

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
                 external_data_dir=None if rewritten is None else model_path.parent)
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
