"""Decode steps' new K/V stored by the PagedAttention operator (its ``slots`` input) rather than
scattered by the runner after the step: the same pools and logits, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import KV_ENGINES


def store_session(library, hq, hkv, d, nb, bs, int8_kv: bool):
    """One ``PagedAttention`` (or ``PagedAttentionInt8KV``) node with the optional store inputs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    f, i64, pool = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT8 if int8_kv else TensorProto.FLOAT
    shapes = {"q": (f, ["B", "T", hq, d]), "k": (f, ["B", "T", hkv, d]), "v": (f, ["B", "T", hkv, d]),
              "pk": (pool, [hkv, nb, bs, d]), "pv": (pool, [hkv, nb, bs, d]), "bt": (i64, ["B", "M"]),
              "ctx": (i64, ["B"]), "ql": (i64, ["B"])}
    if int8_kv:
        shapes.update({"ks": (f, [hkv]), "vs": (f, [hkv])})
    shapes["slots"] = (i64, ["B"])
    if int8_kv:
        shapes.update({"k8": (pool, ["B", "T", hkv, d]), "v8": (pool, ["B", "T", hkv, d])})
    op = "PagedAttentionInt8KV" if int8_kv else "PagedAttention"
    node = helper.make_node(op, list(shapes), ["out"], domain="autoglm.trt")
    inputs = [helper.make_tensor_value_info(name, t, dims) for name, (t, dims) in shapes.items()]
    graph = helper.make_graph([node], "store", inputs, [helper.make_tensor_value_info("out", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def run_bound(session, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The output of one run with every input bound in place (as the runner binds its pools)."""
    import onnxruntime as ort

    binding = session.io_binding()
    values = {name: ort.OrtValue.ortvalue_from_numpy(arr) for name, arr in feeds.items()}
    for name, value in values.items():
        binding.bind_ortvalue_input(name, value)
    binding.bind_output("out")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


@pytest.mark.parametrize("int8_kv", [False, True], ids=["float-kv", "int8-kv"])
@pytest.mark.parametrize("t", [1, 3], ids=["decode", "prefill"])
def test_the_operator_stores_each_new_token_at_its_slot(library, int8_kv, t):
    """A decode step writes each sequence's new K and V (the int8 inputs for an int8 pool) at its
    slot and nowhere else; a slot of -1 stores nothing; a step of several new tokens stores
    nothing; the attention output is the same as without storing."""
    rng = np.random.default_rng(7 + t + int8_kv)
    hq, hkv, d, nb, bs, ctx = 4, 2, 16, 12, 8, [5, 8, 0]
    B = len(ctx)
    dtype = np.int8 if int8_kv else np.float32
    pools = [(rng.integers(-127, 128, (hkv, nb, bs, d)) if int8_kv else rng.standard_normal((hkv, nb, bs, d)))
             .astype(dtype) for _ in range(2)]
    feeds = {"q": rng.standard_normal((B, t, hq, d), dtype=np.float32) * 0.3,
             "k": rng.standard_normal((B, t, hkv, d), dtype=np.float32),
             "v": rng.standard_normal((B, t, hkv, d), dtype=np.float32),
             "bt": np.array([[3, 4], [6, 7], [9, 0]], np.int64), "ctx": np.array(ctx, np.int64),
             "ql": np.full(B, t, np.int64)}
    if int8_kv:
        feeds.update({"ks": np.full(hkv, 0.02, np.float32), "vs": np.full(hkv, 0.03, np.float32),
                      "k8": rng.integers(-127, 128, (B, t, hkv, d)).astype(np.int8),
                      "v8": rng.integers(-127, 128, (B, t, hkv, d)).astype(np.int8)})
    # sequence 0: block 3, offset 5; sequence 1: position 8 is the first of block 7; sequence 2: none
    slots = np.array([3 * bs + 5, 7 * bs + 0, -1], np.int64)
    session = store_session(library, hq, hkv, d, nb, bs, int8_kv)
    before = [p.copy() for p in pools]
    unstored = run_bound(session, {**feeds, "pk": before[0].copy(), "pv": before[1].copy(),
                                   "slots": np.full(B, -1, np.int64)})
    out = run_bound(session, {**feeds, "pk": pools[0], "pv": pools[1], "slots": slots})
    np.testing.assert_array_equal(out, unstored)
    want = [p.copy() for p in before]
    if t == 1:
        new = (feeds["k8"], feeds["v8"]) if int8_kv else (feeds["k"], feeds["v"])
        for b, slot in enumerate(slots):
            if slot >= 0:
                for w, x in zip(want, new):
                    w[:, slot // bs, slot % bs] = x[b, 0]
        assert not np.array_equal(want[0], before[0])  # something was to be stored
    for got, w in zip(pools, want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.parametrize("kv", list(KV_ENGINES))
def test_stored_by_the_operator_or_by_the_runner_the_pools_and_logits_agree(request, library, monkeypatch, kv):
    """Two prompts, then 9 greedy decode steps (crossing block boundaries) on two runners of the
    same engine: one whose attention operator stores decode steps' K/V, one that scatters them
    itself. After every step the logits and the pools (and per-token scale pools) are equal bit for
    bit, and the first runner scattered only the prefill's K/V."""
    from conftest import same_pools_over_steps

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner

    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "1")
    runners = [open_runner(Manifest.read(request.getfixturevalue(KV_ENGINES[kv])), num_blocks=32, threads=1)
               for _ in range(2)]
    assert all(r.stores_kv for r in runners)
    runners[1].stores_kv = False
    scatters, scatter = [], runners[0].pools.write_stacked

    def counted(stacked, slots, scales=None):
        scatters.append(stacked.shape)
        scatter(stacked, slots, scales)

    monkeypatch.setattr(runners[0].pools, "write_stacked", counted)
    same_pools_over_steps(runners, 10)
    assert runners[0].pools.scales is not None or kv != "int8-token"
    assert len(scatters) == 1 and scatters[0][3] == 11  # the prefill's, padded to 11 tokens
    assert runners[0].pools.data.any()
    for r in runners:
        r.close()
