"""Drives every native operator with random and extreme inputs: ``python fuzz_driver.py LIBRARY
--cases N --seed S``. Run in a process of its own (``test_fuzz_ops.py``), so that a crash, or a
sanitizer's report in a sanitizer build, ends that process and fails the test instead of pytest.

Each case starts from inputs that fit the operator (small random sizes), then changes up to three
things: a dimension (to 0, 1, a random size, or a huge one beside a zero, so the tensor stays
empty), an index or length (to -1, a value just past the end, or +-2**62), a scale (to 0, -1, NaN,
inf), an input's rank, or an optional input left out; a quarter of PagedAttention's cases come
with a pool geometry or lengths that fit each other but not the kernel (a block size or pool of
0, a context near 2**63, a table of blocks past the pool). An operator must either compute or
refuse with an error that starts with its name. It prints each case before running it, one line
per operator (cases run and refused), and exits 1 when an error does not name its operator.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from collections.abc import Callable

import numpy as np

F, I64, I32, I8, U8 = np.float32, np.int64, np.int32, np.int8, np.uint8
ONNX_TYPES = {F: 1, U8: 2, I8: 3, I32: 6, I64: 7, np.float16: 10}  # TensorProto's element types
HUGE = 2**40


def _paged(rng, int8: bool) -> list[np.ndarray]:
    b, t, hkv, g = rng.integers(1, 4), rng.integers(1, 5), rng.integers(1, 3), rng.integers(1, 4)
    d, nb, bs = int(rng.choice([8, 64])), int(rng.integers(1, 7)), int(rng.integers(1, 9))
    ctx = rng.integers(0, nb * bs + 1, b)
    tables = rng.integers(0, nb, (b, max(1, -(-int(ctx.max()) // bs))))
    if rng.integers(4) == 0:  # a pool geometry or lengths that fit each other but not the kernel
        what = int(rng.integers(5))
        if what == 0:
            bs = 0
        elif what == 1:
            nb = 0
        elif what == 2:
            ctx[0] = int(rng.choice([2**63 - 1, 2**62, -(2**62)]))
        elif what == 3:
            tables = np.zeros((b, 0), np.int64)
        else:
            tables = np.full((b, 2**16), int(rng.integers(-1, nb + 1)))
            ctx[:] = 2**16 * bs
    pool = (hkv, nb, bs, d)
    feeds = [rng.standard_normal((b, t, hkv * g, d)).astype(F), rng.standard_normal((b, t, hkv, d)).astype(F),
             rng.standard_normal((b, t, hkv, d)).astype(F),
             *(rng.integers(-127, 128, pool).astype(I8) if int8 else rng.standard_normal(pool).astype(F)
               for _ in range(2)),
             tables.astype(I64), ctx.astype(I64), rng.integers(0, t + 1, b).astype(I64)]
    per_token = int8 and rng.integers(2) == 0  # scale pools [hkv, nb, bs] instead of a scale per head
    if int8:
        feeds += [rng.uniform(0.01, 0.1, (hkv, nb, bs) if per_token else hkv).astype(F) for _ in range(2)]
    feeds.append(rng.integers(-1, max(1, nb * bs), b).astype(I64))  # slots
    if int8:
        feeds += [rng.integers(-127, 128, (b, 1, hkv, d)).astype(I8) for _ in range(2)]
        feeds += [rng.uniform(0.01, 0.1, (b, 1, hkv)).astype(F) for _ in range(2)]  # the new tokens' scales
    return feeds


def _int8_linear(rng, extra: int, halves: bool = False) -> list[np.ndarray]:
    blk = int(rng.choice([1, 2, 16, 64]))
    k, n = blk * int(rng.integers(1, 5)), 32 * int(rng.integers(1, 4)) if halves else int(rng.integers(1, 70))
    n16, k4 = -(-n // 16), -(-k // 4)
    rows = (int(rng.integers(1, 3)), int(rng.integers(1, 6)))
    feeds = [rng.standard_normal((*rows, k)).astype(F), np.zeros((blk, blk), F), np.array(rng.uniform(0.01, 0.1), F),
             np.array(rng.integers(0, 256), U8), rng.integers(-128, 128, (n16, k4, 16, 4)).astype(I8),
             rng.integers(-1000, 1000, 16 * n16).astype(I32), rng.uniform(1e-3, 1e-2, n).astype(F)]
    if extra:  # SkipNorm: skip, gamma, epsilon
        feeds += [rng.standard_normal((*rows, n)).astype(F), rng.standard_normal(n).astype(F), np.array(1e-5, F)]
    return feeds


def _float_linear(rng, extra: int) -> list[np.ndarray]:
    k, n16 = int(rng.integers(1, 300)), int(rng.integers(1, 5)) * 2
    rows = (int(rng.integers(1, 3)), int(rng.integers(1, 6)))
    feeds = [rng.standard_normal((*rows, k)).astype(F), rng.standard_normal((n16, k, 16)).astype(F)]
    if extra:
        n = 16 * n16
        feeds += [rng.standard_normal((*rows, n)).astype(F), rng.standard_normal(n).astype(F), np.array(1e-5, F)]
    return feeds


def _int4_linear(rng, extra: int) -> list[np.ndarray]:
    feeds = _float_linear(rng, extra)
    k, n16 = feeds[1].shape[1], feeds[1].shape[0]
    kb = -(-k // 32)
    feeds[1:2] = [rng.integers(0, 256, (n16, kb, 8, 32)).astype(U8),
                  rng.uniform(1e-3, 1e-2, (n16, kb, 16)).astype(np.float16), rng.integers(0, 256, (n16, kb, 8)).astype(U8)]
    return feeds


def _block_linear(rng, extra: int) -> list[np.ndarray]:
    feeds = _int4_linear(rng, extra)
    n16, kb = feeds[1].shape[:2]
    feeds[1:4] = [rng.integers(-128, 128, (n16, kb, 16, 32)).astype(I8), feeds[2]]
    return feeds


def _hadamard(rng) -> list[np.ndarray]:
    blk = int(rng.choice([1, 4, 64]))
    return [rng.standard_normal((2, 3, blk * int(rng.integers(1, 4)))).astype(F), np.zeros((blk, blk), F),
            np.array(rng.uniform(0.01, 0.1), F), np.array(128, U8)]


def _rope(rng) -> list[np.ndarray]:
    b, t, hq, hkv, d = (int(rng.integers(1, 3)), int(rng.integers(1, 5)), int(rng.integers(1, 4)),
                        int(rng.integers(1, 3)), 2 * int(rng.integers(1, 9)))
    half = d // 2
    index = np.array([[i + half, i] for i in range(half)] + [[i, i + half] for i in range(half)], I32)
    value = np.array([-1.0] * half + [1.0] * half, F)
    return [rng.standard_normal((b, t, (hq + 2 * hkv) * d)).astype(F), rng.standard_normal((b, t, 1, d)).astype(F),
            rng.standard_normal((b, t, 1, d)).astype(F), index, value, np.array([hq, hkv], I64)]


def _softmax(rng) -> list[np.ndarray]:
    h, b, g, t, p, n = (int(rng.integers(1, 3)) for _ in range(6))
    return [rng.standard_normal((h, b, g, t, p)).astype(F), rng.standard_normal((h, b, g, t, n)).astype(F),
            rng.standard_normal((1, b, 1, t, p + n)).astype(F)]


def _prefill_attention(rng) -> list[np.ndarray]:
    hkv, b, g, t, p = (int(rng.integers(1, 3)) for _ in range(5))
    p += int(rng.integers(0, 20))
    d = 64 * int(rng.integers(1, 3))
    bias = np.where(rng.random((1, b, 1, t, p + t)) < 0.7, 0.0, -1.0e9).astype(F)
    return [rng.standard_normal((b, t, hkv, g, d)).astype(F), *(rng.standard_normal((hkv, b, 1, n, d)).astype(F)
                                                               for n in (p, t, p, t)), bias]


def _kv_rows(rng) -> list[np.ndarray]:
    shape = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(1, 4)))] + [int(rng.choice([1, 8, 64, 128]))]
    return [(rng.standard_normal(shape) * rng.choice([1e-9, 1.0, 1e4])).astype(F)]


def _image_attention(rng) -> list[np.ndarray]:
    shape = (int(rng.integers(1, 150)), int(rng.integers(1, 4)), int(rng.choice([16, 32, 64, 128])))
    return [(rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0])).astype(F) for _ in range(3)]


OUTPUT_TYPES = {"HadamardQuantize": [U8], "QuantizeKVRows": [I8, F]}  # float32 for the others
# name: (inputs that fit, outputs, how many trailing inputs are optional)
OPS: dict[str, tuple[Callable, int, int]] = {
    "PagedAttention": (lambda r: _paged(r, False), 1, 1),
    "PagedAttentionInt8KV": (lambda r: _paged(r, True), 1, 5),
    "HadamardQuantize": (_hadamard, 1, 0),
    "Int8Linear": (lambda r: _int8_linear(r, 0), 1, 0),
    "Int8LinearSplit": (lambda r: _int8_linear(r, 0, True), 2, 0),
    "Int8LinearSiluMul": (lambda r: _int8_linear(r, 0, True), 1, 0),
    "Int8LinearSkipNorm": (lambda r: _int8_linear(r, 1), 2, 0),
    "FloatLinear": (lambda r: _float_linear(r, 0), 1, 0),
    "FloatLinearSplit": (lambda r: _float_linear(r, 0), 2, 0),
    "FloatLinearSiluMul": (lambda r: _float_linear(r, 0), 1, 0),
    "FloatLinearSkipNorm": (lambda r: _float_linear(r, 1), 2, 0),
    "Int8WeightLinear": (lambda r: _block_linear(r, 0), 1, 0),
    "Int8WeightLinearSplit": (lambda r: _block_linear(r, 0), 2, 0),
    "Int8WeightLinearSiluMul": (lambda r: _block_linear(r, 0), 1, 0),
    "Int8WeightLinearSkipNorm": (lambda r: _block_linear(r, 1), 2, 0),
    "Int4WeightLinear": (lambda r: _int4_linear(r, 0), 1, 0),
    "Int4WeightLinearSplit": (lambda r: _int4_linear(r, 0), 2, 0),
    "Int4WeightLinearSiluMul": (lambda r: _int4_linear(r, 0), 1, 0),
    "Int4WeightLinearSkipNorm": (lambda r: _int4_linear(r, 1), 2, 0),
    "Int8BlockLinear": (lambda r: _block_linear(r, 0), 1, 0),
    "Int8BlockLinearSplit": (lambda r: _block_linear(r, 0), 2, 0),
    "Int8BlockLinearSiluMul": (lambda r: _block_linear(r, 0), 1, 0),
    "Int8BlockLinearSkipNorm": (lambda r: _block_linear(r, 1), 2, 0),
    "RopeQKV": (_rope, 3, 0),
    "MaskedSoftmax": (_softmax, 2, 0),
    "PrefillAttention": (_prefill_attention, 1, 0),
    "PrefillAttentionBf16": (_prefill_attention, 1, 0),
    "QuantizeKVRows": (_kv_rows, 2, 0),
    "ImageAttentionBf16": (_image_attention, 1, 0),
}


def session(library: str, op: str, types: list, outputs: int):
    import onnxruntime as ort
    from onnx import helper

    names = [f"i{i}" for i in range(len(types))]
    outs = [f"o{i}" for i in range(outputs)]
    graph = helper.make_graph([helper.make_node(op, names, outs, domain="autoglm.trt")], "fuzz",
                              [helper.make_tensor_value_info(n, ONNX_TYPES[t], None) for n, t in zip(names, types)],
                              [helper.make_tensor_value_info(n, ONNX_TYPES[OUTPUT_TYPES.get(op, [F] * outputs)[k]], None)
                               for k, n in enumerate(outs)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    options = ort.SessionOptions()
    options.register_custom_ops_library(library)
    options.intra_op_num_threads = 2
    options.log_severity_level = 4  # the refusals are expected: not on stderr
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def mutate(rng, feeds: list[np.ndarray]) -> tuple[list[np.ndarray], str]:
    """``feeds`` with one thing changed, and what."""
    feeds = list(feeds)
    i = int(rng.integers(len(feeds)))
    a = feeds[i]
    kind = rng.integers(6)
    if kind == 0 and a.ndim:  # a dimension
        shape = [min(d, 64) for d in a.shape]
        d = int(rng.integers(a.ndim))
        shape[d] = int(rng.choice([0, 1, 2, 3, 17, int(rng.integers(1, 200))]))
        feeds[i] = _fill(rng, a.dtype, shape)
        return feeds, f"input {i} reshaped to {shape}"
    if kind == 1 and a.ndim:  # empty, with a huge dimension beside the zero
        shape = [min(d, 64) for d in a.shape]
        zero, huge = rng.choice(a.ndim, 2, replace=a.ndim < 2)
        shape[int(huge)], shape[int(zero)] = HUGE, 0
        feeds[i] = np.zeros(shape, a.dtype)
        return feeds, f"input {i} empty as {shape}"
    if kind == 2 and a.size and a.dtype.kind in "iu":  # an index, length or count
        info = np.iinfo(a.dtype)
        bad = min(max(int(rng.choice([-1, 0, 2**62, -(2**62), int(a.max()) + 1, info.max, info.min])), info.min),
                  info.max)
        b = a.copy().reshape(-1)
        b[int(rng.integers(b.size))] = bad
        feeds[i] = b.reshape(a.shape)
        return feeds, f"input {i} holds {bad}"
    if kind == 3 and a.size and a.dtype.kind == "f":  # a value: scales, epsilon, scores
        b = a.copy().reshape(-1)
        b[int(rng.integers(b.size))] = rng.choice([0.0, -1.0, np.nan, np.inf, -np.inf, float(np.finfo(a.dtype).max)])
        feeds[i] = b.reshape(a.shape)
        return feeds, f"input {i} holds an extreme value"
    if kind == 4 and a.size:  # another rank
        shape = list(a.shape)
        shape = shape[:-1] if shape and rng.integers(2) else [*shape, 1]
        feeds[i] = _fill(rng, a.dtype, shape)
        return feeds, f"input {i} of rank {len(shape)}"
    return feeds, "unchanged"


def _fill(rng, dtype, shape) -> np.ndarray:
    if 0 in shape:
        return np.zeros(shape, dtype)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    info = np.iinfo(dtype)
    return rng.integers(max(info.min, -4), min(info.max, 8), shape, endpoint=True).astype(dtype)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("library")
    parser.add_argument("--cases", type=int, default=100, help="cases per operator")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    # whether MaskedSoftmax runs at all in this build (it needs AVX-512F), asked in this process,
    # where a sanitizer build's runtime is loaded first
    print(f"RESULT softmax exact: {int(ctypes.CDLL(args.library).AutoglmSoftmaxExact())}", flush=True)
    print(f"RESULT image attention: {int(ctypes.CDLL(args.library).AutoglmImageAttentionBf16())}", flush=True)
    kernel = ctypes.CDLL(args.library).AutoglmFloatKernel
    kernel.restype = ctypes.c_char_p
    print(f"RESULT fma: {int(kernel() != b'portable C')}", flush=True)  # PrefillAttention runs only with it
    rng = np.random.default_rng(args.seed)
    wrong = 0
    for op, (make, outputs, optional) in OPS.items():
        full = make(np.random.default_rng(0))
        types = [a.dtype.type for a in full]
        sessions = {n: session(args.library, op, types[:n], outputs) for n in {len(types), len(types) - optional}}
        ran = refused = 0
        for case in range(args.cases):
            feeds, what = make(rng), ["made"]
            if optional and rng.integers(2):
                feeds, what = feeds[: len(feeds) - optional], ["without its optional inputs"]
            for _ in range(int(rng.integers(0, 4)) if case % 4 else 0):  # every fourth case as made
                feeds, change = mutate(rng, feeds)
                what.append(change)
            print(f"{op} case {case}: {'; '.join(what)}", flush=True)  # the last line, should it crash
            try:
                sessions[len(feeds)].run(None, {f"i{i}": a for i, a in enumerate(feeds)})
                ran += 1
            except Exception as exc:  # noqa: BLE001 - sorted below
                refused += 1
                message = str(exc)
                if f"{op}: " not in message:
                    print(f"WRONG {op} case {case} ({'; '.join(what)}): {message[-300:]}", flush=True)
                    wrong += 1
        print(f"RESULT {op}: {ran} ran, {refused} refused", flush=True)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
