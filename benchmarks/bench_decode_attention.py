#!/usr/bin/env python3
"""A decode step's attention in each build of the native library: the ``PagedAttention`` operator
alone, with its vector kernels and with the plain loops they replace.

    python -m benchmarks.bench_decode_attention [--contexts 1000,5000] [--batches 1,8] [--rounds 9]

For each build this CPU runs that has vector attention kernels (AVX-512, AVX2; the installed
library's), the same variant is compiled again with the plain loops (``-DAUTOGLM_LOOP_DOT4``, what
the tests compare the kernels with bit for bit), and the generic build (portable C, x86-64's SSE2)
runs beside them. Each row is one decode step of ``batch`` sequences with ``context`` cached tokens
each, one new token a sequence, over pools of random float32 (or ``--kv int8``) K/V in blocks of 16
scattered through the pool, 2 ONNX Runtime threads, for SmolLM2's heads (9 query heads over 3 KV
heads, D 64) and GLM-4.1V's (32 over 2, D 128). Rounds interleave the builds (whose sessions' threads
do not spin between turns); each figure is the median over rounds, each ratio the median of the
per-round ratios. The loops builds share the operator's softmax and its split of long pasts. Needs a C compiler.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import machine

SHAPES = {"smollm2": (9, 3, 64), "glm4v": (32, 2, 128)}  # query heads, KV heads, head size
BLOCK = 16


def op_model(hq: int, hkv: int, d: int, nb: int, int8: bool) -> bytes:
    """The operator alone over pools of ``nb`` blocks (float32, or int8 with a scale per KV head)."""
    from onnx import TensorProto, helper

    f, i = TensorProto.FLOAT, TensorProto.INT64
    pool = TensorProto.INT8 if int8 else f
    shapes = [
        ("q", f, ["B", 1, hq, d]), ("k", f, ["B", 1, hkv, d]), ("v", f, ["B", 1, hkv, d]),
        ("pk", pool, [hkv, nb, BLOCK, d]), ("pv", pool, [hkv, nb, BLOCK, d]), ("bt", i, ["B", "M"]),
        ("ctx", i, ["B"]), ("ql", i, ["B"])] + ([("ks", f, [hkv]), ("vs", f, [hkv])] if int8 else [])
    node = helper.make_node("PagedAttentionInt8KV" if int8 else "PagedAttention", [s[0] for s in shapes], ["out"],
                            domain="autoglm.trt")
    inputs = [helper.make_tensor_value_info(name, kind, dims) for name, kind, dims in shapes]
    graph = helper.make_graph([node], "decode_attention", inputs, [helper.make_tensor_value_info("out", f, None)])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)]
    return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def feeds(shape: str, batch: int, ctx: int, int8: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    hq, hkv, d = SHAPES[shape]
    per_seq = -(-ctx // BLOCK)
    nb = batch * per_seq
    tables = rng.permutation(nb).reshape(batch, per_seq).astype(np.int64)  # each sequence's blocks anywhere
    out = {"q": rng.standard_normal((batch, 1, hq, d), np.float32) * d ** -0.5,
           "k": rng.standard_normal((batch, 1, hkv, d), np.float32),
           "v": rng.standard_normal((batch, 1, hkv, d), np.float32), "bt": tables,
           "ctx": np.full(batch, ctx, np.int64), "ql": np.ones(batch, np.int64)}
    if int8:
        out.update(pk=rng.integers(-127, 128, (hkv, nb, BLOCK, d), dtype=np.int8),
                   pv=rng.integers(-127, 128, (hkv, nb, BLOCK, d), dtype=np.int8),
                   ks=np.full(hkv, 0.02, np.float32), vs=np.full(hkv, 0.02, np.float32))
    else:
        out.update(pk=rng.standard_normal((hkv, nb, BLOCK, d), np.float32),
                   pv=rng.standard_normal((hkv, nb, BLOCK, d), np.float32))
    return out


def builds(workdir: Path) -> dict[str, Path]:
    """name -> library: each installed vector build this CPU runs and its plain-loop twin, and the generic build."""
    from autoglm_trt.native import library, variant_of
    from autoglm_trt.native.build import compile_library, compiler
    from autoglm_trt.native.variants import COMMON_FLAGS, SOURCES, for_machine

    best, why = library()
    if best is None:
        sys.exit(f"no native library here: {why}")
    cc = compiler()
    if cc is None:
        sys.exit("no C compiler: the plain-loop builds cannot be made")
    variants = {v.name: v for v in for_machine()}
    found: dict[str, Path] = {}
    for name in dict.fromkeys([variant_of(best), "avx2"]):
        path = library(name)[0]
        if path is None or name == "generic":
            continue
        loop = workdir / f"libautoglm-{name}-loop.so"
        print(f"compiling the {name} build with the plain loops", file=sys.stderr, flush=True)
        compile_library(loop, variants[name].flags + ("-DAUTOGLM_LOOP_DOT4",), SOURCES, COMMON_FLAGS, cc=cc)
        found[name], found[f"{name} loops"] = path, loop
    generic = library("generic")[0]
    if generic is not None:
        found["generic"] = generic
    return found


def session(lib: Path, model: bytes, threads: int):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.register_custom_ops_library(str(lib))
    so.intra_op_num_threads = threads
    # the sessions take turns in one process: an idle session's threads must not spin beside the running one's
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def time_ms(sess, inputs: dict[str, np.ndarray], runs: int) -> float:
    sess.run(None, inputs)
    t = time.perf_counter()
    for _ in range(runs):
        sess.run(None, inputs)
    return (time.perf_counter() - t) / runs * 1e3


def row(libs: dict[str, Path], shape: str, batch: int, ctx: int, int8: bool, args) -> dict:
    inputs = feeds(shape, batch, ctx, int8, np.random.default_rng(ctx + batch))
    hq, hkv, d = SHAPES[shape]
    model = op_model(hq, hkv, d, inputs["pk"].shape[1], int8)
    sessions = {name: session(lib, model, args.threads) for name, lib in libs.items()}
    outs = {name: s.run(None, inputs)[0] for name, s in sessions.items()}
    for name, out in outs.items():  # every build computes the same attention (to float32 rounding)
        np.testing.assert_allclose(out, outs[next(iter(outs))], rtol=1e-4, atol=1e-4, err_msg=name)
    rounds = [{name: time_ms(s, inputs, args.runs) for name, s in sessions.items()} for _ in range(args.rounds)]
    result: dict[str, object] = {"shape": shape, "kv": "int8" if int8 else "float32", "batch": batch, "context": ctx}
    result.update({f"{name} ms": round(statistics.median(r[name] for r in rounds), 3) for name in libs})
    for name in libs:
        if f"{name} loops" in libs:
            result[f"{name}: loops over kernels"] = round(statistics.median(r[f"{name} loops"] / r[name]
                                                                             for r in rounds), 2)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="1000,5000")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--kv", default="float32", help="comma-separated: float32, int8")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    print(machine(), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        libs = builds(Path(tmp))
        print(f"builds: {', '.join(libs)}; decode step ms, {args.threads} threads, median of {args.rounds} rounds",
              flush=True)
        for kv in args.kv.split(","):
            for shape in args.shapes.split(","):
                for ctx in (int(c) for c in args.contexts.split(",")):
                    for batch in (int(b) for b in args.batches.split(",")):
                        print(json.dumps(row(libs, shape, batch, ctx, kv == "int8", args)), flush=True)


if __name__ == "__main__":
    main()
