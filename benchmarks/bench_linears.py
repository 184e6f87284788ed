#!/usr/bin/env python3
"""One linear, every way this project could run it on the CPU, in one run on this machine.

    python -m benchmarks.bench_linears [--rows 1,16,256] [--shapes smollm2,glm4-9b] [--repeats 20]

The measurement issues 36 (INT4) and 37 (weight-only INT8) ask for before a kernel is written:
for SmolLM2-135M's and GLM-4-9B's linear shapes (qkv, gate_up, down), a single-node ONNX Runtime
session per method, weights as constant initializers, 2 intra-op threads: ONNX Runtime's own
``MatMul`` (float32); our ``FloatLinear``; our ``Int8Linear`` (W8A8, static per-tensor
activations); ONNX Runtime's ``MatMulNBits`` with 8-bit and 4-bit blocked weights (block 32 and
128; ``accuracy_level`` 4 quantizes activations per block to INT8 at run time and uses integer dot
products, 0 dequantizes to float; 8-bit weights only at 4: at 0 they took 100-270x
Int8Linear's time on SmolLM2's shapes); our ``Int4WeightLinear`` (4-bit blocks of 32 with
zero points, activations per block to INT8, as MatMulNBits at level 4); our ``Int8WeightLinear``
(8-bit blocks of 32, activations per block to 16 bits) and ``Int8BlockLinear`` (the same weights,
activations to INT8). Prints, per shape and
row count, the median microseconds of each and its time relative to ``Int8Linear``; for one row
also the weight bytes read per second.
Weights are random (timing does not depend on their values).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from .common import machine

SHAPES = {  # name: [(linear, K, N)]
    "smollm2": [("qkv", 576, 960), ("gate_up", 576, 3072), ("down", 1536, 576)],
    "glm4-9b": [("qkv", 4096, 4608), ("gate_up", 4096, 27392), ("down", 13696, 4096)],
}
BLOCK = 64  # Int8Linear's Hadamard block


def _session(nodes, inits, k: int, library):
    from onnx import TensorProto, helper

    from autoglm_trt.backends.onnxrt.session import make_session

    graph = helper.make_graph(nodes, "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1),
                                                    helper.make_opsetid("autoglm.trt", 1)])
    return make_session(model.SerializeToString(), threads=2, custom_ops=library)


def sessions(k: int, n: int, library) -> dict[str, tuple[object, int]]:
    """Each method's session over random weights [k, n], with the bytes of weights it reads."""
    from onnx import helper, numpy_helper

    from autoglm_trt.backends.onnxrt.passes.linears import pack_weights
    from autoglm_trt.quant.hadamard import hadamard

    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n), dtype=np.float32) * 0.02
    out = {"ort_matmul_fp32": (_session([helper.make_node("MatMul", ["x", "w"], ["y"])],
                                        [numpy_helper.from_array(w, "w")], k, None), w.nbytes)}
    for bits in (8, 4):
        for block in (32, 128):
            for level in (4, 0) if bits == 4 else (4,):  # 8-bit at level 0 ran 100-250x slower than Int8Linear
                blocks = -(-k // block)
                packed = rng.integers(0, 256, (n, blocks, block * bits // 8), dtype=np.uint8)
                scales = rng.uniform(1e-3, 1e-2, n * blocks).astype(np.float32)
                node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n,
                                        bits=bits, block_size=block, accuracy_level=level)
                out[f"nbits{bits}_b{block}_acc{level}"] = (
                    _session([node], [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")],
                             k, None), packed.nbytes + scales.nbytes)
    if library is not None:
        tiles = np.ascontiguousarray(w.reshape(k, n // 16, 16).transpose(1, 0, 2))
        out["float_linear"] = (_session([helper.make_node("FloatLinear", ["x", "w"], ["y"], domain="autoglm.trt")],
                                        [numpy_helper.from_array(tiles, "w")], k, library), tiles.nbytes)
        wq = rng.integers(-127, 128, (k, n)).astype(np.int8)
        packed8, sums = pack_weights(wq)
        inits = [numpy_helper.from_array(np.array(hadamard(BLOCK)), "h"), numpy_helper.from_array(np.float32(0.05), "s"),
                 numpy_helper.from_array(np.uint8(128), "z"), numpy_helper.from_array(packed8, "wp"),
                 numpy_helper.from_array(sums, "cs"), numpy_helper.from_array(rng.uniform(1e-3, 1e-2, n).astype(
                     np.float32), "ws")]
        node = helper.make_node("Int8Linear", ["x", "h", "s", "z", "wp", "cs", "ws"], ["y"], domain="autoglm.trt")
        out["int8_linear"] = (_session([node], inits, k, library), packed8.nbytes)
        kb = -(-k // 32)
        parts = [rng.integers(0, 256, (n // 16, kb, 8, 32), dtype=np.uint8),
                 rng.uniform(1e-3, 1e-2, (n // 16, kb, 16)).astype(np.float16),
                 rng.integers(0, 256, (n // 16, kb, 8), dtype=np.uint8)]
        node = helper.make_node("Int4WeightLinear", ["x", "t4", "s4", "z4"], ["y"], domain="autoglm.trt")
        out["int4_weight_linear"] = (_session([node], [numpy_helper.from_array(a, name) for a, name in
                                                       zip(parts, ("t4", "s4", "z4"))], k, library),
                                     sum(a.nbytes for a in parts))
        parts = [rng.integers(-127, 128, (n // 16, kb, 16, 32), dtype=np.int8), parts[1]]
        for op in ("Int8WeightLinear", "Int8BlockLinear"):
            node = helper.make_node(op, ["x", "t8", "s8"], ["y"], domain="autoglm.trt")
            key = "int8_weight_linear" if op == "Int8WeightLinear" else "int8_block_linear"
            out[key] = (_session([node], [numpy_helper.from_array(a, name) for a, name in zip(parts, ("t8", "s8"))],
                                 k, library), sum(a.nbytes for a in parts))
    return out


def median_us(session, x: np.ndarray, repeats: int) -> float:
    session.run(None, {"x": x})
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        session.run(None, {"x": x})
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,256")
    ap.add_argument("--shapes", default="smollm2,glm4-9b")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from autoglm_trt.native import library as native_library

    library, why = native_library()
    rows = [int(r) for r in args.rows.split(",")]
    print(json.dumps({"machine": machine(), "native": str(library.name) if library else why,
                      "threads": 2, "repeats": args.repeats}))
    for shape in args.shapes.split(","):
        for name, k, n in SHAPES[shape]:
            made = sessions(k, n, library)
            for m in rows:
                x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
                reps = max(3, args.repeats if k * n * m < 2e9 else args.repeats // 5)
                us = {method: median_us(s, x, reps) for method, (s, _) in made.items()}
                row = {"shape": shape, "linear": name, "K": k, "N": n, "rows": m,
                       "us": {key: round(v, 1) for key, v in us.items()}}
                if "int8_linear" in us:
                    row["time_vs_int8_linear"] = {key: round(v / us["int8_linear"], 2) for key, v in us.items()}
                if m == 1:
                    row["weight_GB_per_s"] = {key: round(made[key][1] / (v * 1e-6) / 1e9, 1) for key, v in us.items()}
                print(json.dumps(row), flush=True)
            del made


if __name__ == "__main__":
    main()
