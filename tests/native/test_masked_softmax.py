"""The native MaskedSoftmax against ONNX Runtime's own nodes: Concat of the two score blocks, Add
of the mask bias, Softmax, and the two Slices back, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

NEG_INF = -1.0e9  # the engine graph's mask value (graph/decoder.py)


def _sessions(library):
    import onnxruntime as ort

    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info(n, f, None) for n in ("past", "new", "bias")]
    outputs = [helper.make_tensor_value_info(n, f, None) for n in ("probs_past", "probs_new")]
    graph = helper.make_graph([
        helper.make_node("Concat", ["past", "new"], ["scores"], axis=4),
        helper.make_node("Add", ["scores", "bias"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["probs"], axis=-1),
        helper.make_node("Shape", ["past"], ["past_shape"]),
        helper.make_node("Slice", ["past_shape", "four", "five"], ["past_len"]),
        helper.make_node("Slice", ["probs", "zero", "past_len", "last"], ["probs_past"]),
        helper.make_node("Slice", ["probs", "past_len", "end", "last"], ["probs_new"]),
    ], "ref", inputs, outputs, [helper.make_tensor(n, TensorProto.INT64, [1], [v]) for n, v in
                                (("zero", 0), ("four", 4), ("five", 5), ("last", -1), ("end", 2**62))])
    native = helper.make_graph([helper.make_node("MaskedSoftmax", ["past", "new", "bias"], ["probs_past", "probs_new"],
                                                 domain="autoglm.trt")], "native", inputs, outputs)
    sessions = []
    for g in (graph, native):
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
        so = ort.SessionOptions()
        so.register_custom_ops_library(str(library))
        sessions.append(ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]))
    return sessions


@pytest.mark.parametrize("h,b,g,t,p,n", [
    (3, 1, 3, 17, 16, 17),  # a prefill of 17 tokens over one block of past: a partial vector per row
    (2, 2, 2, 5, 32, 5),
    (1, 1, 1, 40, 0, 40),  # no past at all
    (3, 2, 3, 33, 48, 33),  # rows longer than one unrolled step of MLAS's kernel (48)
])
def test_equals_onnx_runtimes_join_mask_softmax_and_split(library, h, b, g, t, p, n):
    from autoglm_trt.native import softmax_exact

    if not softmax_exact(library):
        pytest.skip("MaskedSoftmax repeats ONNX Runtime's AVX-512F softmax; this build has no AVX-512F")
    rng = np.random.default_rng(h * 1000 + t + p)
    past = (rng.standard_normal((h, b, g, t, p)) * 4).astype(np.float32)
    new = (rng.standard_normal((h, b, g, t, n)) * 4).astype(np.float32)
    ok = np.concatenate([rng.random((b, t, p)) < 0.6, np.tril(np.ones((t, n), bool))[None].repeat(b, 0)], axis=2)
    ok[:, t // 2:, :] &= rng.random((b, t - t // 2, p + n)) < 0.8  # some rows mask more
    ok[:, :, p] = True  # every row may attend to something
    bias = np.where(ok, np.float32(0), np.float32(NEG_INF)).astype(np.float32)[None, :, None]
    feeds = {"past": past, "new": new, "bias": bias}
    ref, native = (s.run(None, feeds) for s in _sessions(library))
    assert native[0].shape == (h, b, g, t, p) and native[1].shape == (h, b, g, t, n)
    for a, e in zip(native, ref):
        np.testing.assert_array_equal(a, e)
    assert np.allclose(native[0].sum(-1) + native[1].sum(-1), 1.0, atol=1e-5)  # rows that are distributions


def test_doctor_says_which_softmax_prefill_steps_run(tiny_engine, library, monkeypatch):
    from conftest import run_cli

    from autoglm_trt.native import softmax_exact

    r = run_cli("doctor", str(tiny_engine))
    want = ("prefill softmax: native MaskedSoftmax operator" if softmax_exact(library)
            else "prefill softmax: ONNX Runtime's Softmax (the library is not built for AVX-512F)")
    assert r.returncode == 0 and want in r.stdout, r.stdout
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    r = run_cli("doctor", str(tiny_engine))
    assert r.returncode == 0 and "prefill softmax: ONNX Runtime's Softmax\n" in r.stdout, r.stdout
