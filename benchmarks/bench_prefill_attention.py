#!/usr/bin/env python3
"""One layer's prefill attention every way: the graph's own nodes, the same with the scores by
row and (AVX-512 builds) ``MaskedSoftmax``, what the engines ran before ``PrefillAttention``, the
native ``PrefillAttention`` operator, and where this CPU has AMX-BF16 ``PrefillAttentionBf16``
(checked against the graph to bfloat16's rounding, the others to float32's).

    python -m benchmarks.bench_prefill_attention [--tokens 1000,2000,4000] [--rounds 3] [--threads 2]

Each form is the ``graph/decoder.py`` attention of a new prompt of T tokens (its past: the
prompt's own T slots of the block table, all masked, as a fresh prompt's are), put through the
passes' own functions (``prefill_scores.by_row``, ``prefill_attention.fuse``) and ONNX Runtime's
optimizer, 2 threads, for SmolLM2's heads (3 KV heads x 3, D 64) and GLM-4.1V's (2 x 16, D 128).
Rounds interleave the forms; each figure is the median over rounds, each ratio the median of
the per-round ratios. Prints the machine and one JSON line per (shape, T); a size whose score
tensor would pass ``MAX_SCORES_GB`` (the graph form holds several such tensors at once) is
skipped, with that said.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from .common import machine

SHAPES = {"smollm2": (3, 3, 64), "glm4v": (2, 16, 128)}  # KV heads, query heads per KV head, head size
NEG_INF = -1.0e9  # the engine's mask value (graph/decoder.py)
MAX_SCORES_GB = 1.5


def attention_nodes():
    """Layer 0's prefill attention as ``graph/decoder.py`` writes it, named as the passes expect."""
    from onnx import helper

    from autoglm_trt.graph import names

    t = lambda name: names.in_layer(0, name)  # noqa: E731
    return [
        helper.make_node("Transpose", ["q"], [t(names.Q_T)], perm=[2, 0, 3, 4, 1]),
        helper.make_node("MatMul", ["k_past", t(names.Q_T)], [t(names.SCORES_PAST)]),
        helper.make_node("MatMul", ["k_new", t(names.Q_T)], [t(names.SCORES_NEW)]),
        helper.make_node("Concat", [t(names.SCORES_PAST), t(names.SCORES_NEW)], [t(names.SCORES_T)], axis=3),
        helper.make_node("Transpose", [t(names.SCORES_T)], [t(names.SCORES)], perm=[0, 1, 2, 4, 3]),
        helper.make_node("Add", [t(names.SCORES), "bias"], [t(names.MASKED)]),
        helper.make_node("Softmax", [t(names.MASKED)], [t(names.PROBS)], axis=-1),
        helper.make_node("Slice", [t(names.PROBS), "zero", "past_len", "last"], [t(names.PROBS_PAST)]),
        helper.make_node("Slice", [t(names.PROBS), "past_len", "end", "last"], [t(names.PROBS_NEW)]),
        helper.make_node("MatMul", [t(names.PROBS_PAST), "v_past"], ["ctx_past"]),
        helper.make_node("MatMul", [t(names.PROBS_NEW), "v_new"], ["ctx_new"]),
        helper.make_node("Add", ["ctx_past", "ctx_new"], [t("context")]),
    ]


def sessions(library, threads: int, softmax: bool, bf16: bool) -> dict:
    """The forms' ONNX Runtime sessions (``softmax``: the library's MaskedSoftmax runs here; ``bf16``:
    PrefillAttentionBf16's AMX path does, a fourth form)."""
    from onnx import TensorProto, helper

    from autoglm_trt.backends.onnxrt.passes import prefill_attention, prefill_scores
    from autoglm_trt.backends.onnxrt.session import make_session
    from autoglm_trt.graph import names

    out = names.in_layer(0, "context")
    nodes = attention_nodes()
    forms = {"graph": nodes, "by_row_masked_softmax": prefill_scores.by_row(nodes, 0, softmax),
             "prefill_attention": prefill_attention.fuse(nodes, 0, out)}
    if bf16:
        forms["prefill_attention_bf16"] = prefill_attention.fuse(nodes, 0, out, bf16=True)
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [helper.make_tensor_value_info(n, f, None) for n in ("q", "k_past", "k_new", "v_past", "v_new", "bias")]
    inputs.append(helper.make_tensor_value_info("past_len", i64, [1]))
    consts = [helper.make_tensor(n, i64, [1], [v]) for n, v in (("zero", 0), ("last", -1), ("end", 2**62))]
    made = {}
    for name, form in forms.items():
        graph = helper.make_graph(form, name, inputs, [helper.make_tensor_value_info(out, f, None)], consts)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
                                                        helper.make_opsetid("autoglm.trt", 1)])
        made[name] = make_session(model.SerializeToString(), threads=threads, custom_ops=library)
    return made


def feeds(rng, hkv: int, g: int, d: int, t: int) -> dict[str, np.ndarray]:
    """A fresh prompt of ``t`` tokens: its ``p`` past slots (its own blocks) all masked, causal."""
    p = (t + 15) // 16 * 16
    x = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    ok = np.concatenate([np.zeros((t, p), bool), np.tril(np.ones((t, t), bool))], axis=1)
    bias = np.where(ok, np.float32(0), np.float32(NEG_INF))[None, None, None]
    return {"q": x(1, t, hkv, g, d) * 0.125, "k_past": x(hkv, 1, 1, p, d), "k_new": x(hkv, 1, 1, t, d),
            "v_past": x(hkv, 1, 1, p, d), "v_new": x(hkv, 1, 1, t, d), "bias": bias.astype(np.float32),
            "past_len": np.array([p], np.int64)}


def main() -> None:
    from autoglm_trt.native import attention_bf16, float_kernel, library, softmax_exact

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="1000,2000,4000")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    lib, why = library()
    if lib is None or float_kernel(lib) == "portable C":
        raise SystemExit(f"PrefillAttention cannot run here: {why or 'the library has no fused multiply-add'}")
    made = sessions(lib, args.threads, softmax_exact(lib), attention_bf16(lib))
    print(machine(), flush=True)
    rng = np.random.default_rng(0)
    for shape, (hkv, g, d) in SHAPES.items():
        for t in (int(x) for x in args.tokens.split(",")):
            gb = hkv * g * t * 2 * ((t + 15) // 16 * 16) * 4 / 1e9  # [Hkv, 1, G, T, P + T] float32, P ~ T
            if gb > MAX_SCORES_GB:
                print(json.dumps({"shape": shape, "tokens": t, "skipped": f"a score tensor of {gb:.1f} GB"}))
                continue
            x = feeds(rng, hkv, g, d, t)
            want = made["graph"].run(None, x)[0]
            for sess in made.values():  # warm up
                sess.run(None, x)
            ms: dict[str, list[float]] = {k: [] for k in made}
            for _ in range(args.rounds):
                for name, sess in made.items():
                    time.sleep(0.2)  # the last session's threads stop spinning (each session has its own)
                    t0 = time.perf_counter()
                    got = sess.run(None, x)[0]
                    ms[name].append(1000 * (time.perf_counter() - t0))
                    tolerance = 2e-2 if name.endswith("bf16") else 1e-4  # bfloat16's rounding, or float32's
                    assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), name  # the same attention
            row = {"shape": shape, "tokens": t, "ms": {k: round(statistics.median(v), 1) for k, v in ms.items()}}
            row["graph_time_vs_prefill_attention"] = round(statistics.median(
                a / b for a, b in zip(ms["graph"], ms["prefill_attention"])), 2)
            row["by_row_time_vs_prefill_attention"] = round(statistics.median(
                a / b for a, b in zip(ms["by_row_masked_softmax"], ms["prefill_attention"])), 2)
            if "prefill_attention_bf16" in ms:
                row["prefill_attention_time_vs_bf16"] = round(statistics.median(
                    a / b for a, b in zip(ms["prefill_attention"], ms["prefill_attention_bf16"])), 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
