"""INT8 KV cache with a scale per token and KV head (``build --kv-cache-dtype int8 --kv-scales
token``): the graph quantizes as the numpy reference does, bit for bit; the scales travel with
their blocks (stored, gathered, copied); accuracy through the pool beats the static scales'."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import build_tiny_engine

from autoglm_trt.backends.onnxrt.offline import GraphRunner
from autoglm_trt.builder.config import BuildConfig, BuildConfigError
from autoglm_trt.kvcache.host_pools import KVPools
from autoglm_trt.quant.kv import quantize_rows
from autoglm_trt.runtime import Engine, SamplingParams


@pytest.fixture(scope="module")
def engines(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv-token")
    return {kv: build_tiny_engine(tiny_dir, out / kv, family="glm4", **cfg) for kv, cfg in (
        ("float", {}), ("head", {"kv_cache_dtype": "int8"}), ("token", {"kv_cache_dtype": "int8", "kv_scales": "token"}))}


def test_quantize_rows_exact_values():
    x = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, -0.5, 0.25, 0.0], [3.0, 1.5, -2.9, 0.0118]], np.float32)
    q, s = quantize_rows(x)
    assert s.dtype == np.float32 and q.dtype == np.int8
    np.testing.assert_array_equal(s, np.float32([1e-6, 1.0, 3.0]) / np.float32(127))
    np.testing.assert_array_equal(q, [[0, 0, 0, 0], [127, -64, 32, 0], [127, 64, -123, 0]])  # -63.5 -> -64 (even)


def test_the_graph_stores_what_quantize_rows_makes(engines):
    """One prefill: the int8 K/V outputs and their scales are ``quantize_rows`` of the float
    engine's K/V (the same graph up to the quantizing nodes), bit for bit."""
    windows = np.random.default_rng(1).integers(3, 250, (2, 24))
    runner, ref = GraphRunner(engines["token"]), GraphRunner(engines["float"])
    from autoglm_trt.backends.onnxrt.offline import prefill_feeds
    from autoglm_trt.backends.onnxrt.session import run

    got = run(runner.session, prefill_feeds(runner.spec, windows, "int8", token_scales=True))
    want = run(ref.session, prefill_feeds(ref.spec, windows, "float32"))
    for name in ("new_key.0", "new_value.1"):
        q, s = quantize_rows(want[name])
        np.testing.assert_array_equal(got[name.replace(".", "_scale.")], s)
        np.testing.assert_array_equal(got[name], q)


def test_per_token_scales_read_back_closer_than_static_ones(engines):
    """Logits 4 tokens per step through the pool: the per-token cache's largest difference from
    the float cache is below the static per-head cache's, and small."""
    windows = np.random.default_rng(0).integers(3, 250, (3, 64))
    ref = GraphRunner(engines["float"]).paged_logits(windows, 4)
    err = {kv: np.abs(GraphRunner(engines[kv]).paged_logits(windows, 4) - ref).max() for kv in ("head", "token")}
    assert err["token"] < err["head"]
    assert err["token"] <= 0.02 * np.abs(ref).max()


def test_engine_decodes_through_scale_pools_with_shared_prefixes(engines):
    """Greedy generation of the per-token engine agrees with the float engine on most prompts,
    with prefix caching on (blocks shared, partly filled ones copied with their scales)."""
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13] for i in range(6)] + [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Engine.load(engines["float"]) as f, Engine.load(engines["token"]) as q:
        want = [r.token_ids for r in f.generate(prompts, params)]
        got = [r.token_ids for r in q.generate(prompts, params)]
        again = [r.token_ids for r in q.generate(prompts, params)]  # now from the prefix cache
        assert q.backend.pools.scales is not None and q.backend.pools.scales.any()
    assert got == again
    assert np.mean([a == b for a, b in zip(got, want)]) >= 0.8


def test_copy_blocks_copies_scales():
    pools = KVPools(2, 4, 2, 1, 4, np.int8, token_scales=True)
    pools.data[:, :, :, 1] = 7
    pools.scales[:, :, :, 1] = 0.5
    pools.copy_blocks([(1, 3)])
    assert (pools.data[:, :, :, 3] == 7).all() and (pools.scales[:, :, :, 3] == 0.5).all()
    assert set(pools.feeds()) == {f"past_{k}{s}.{i}" for k in ("key", "value") for s in ("", "_scale") for i in (0, 1)}


def test_token_scales_need_an_int8_cache_and_onnxruntime(tiny_dir, tmp_path, monkeypatch):
    with pytest.raises(BuildConfigError, match="kv_cache_dtype int8"):
        BuildConfig(kv_scales="token").check()
    with pytest.raises(BuildConfigError, match="head or token"):
        BuildConfig(kv_cache_dtype="int8", kv_scales="block").check()
    from autoglm_trt.backends.registry import backend
    from autoglm_trt.builder import pipeline
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine
    from autoglm_trt.errors import AutoGLMError

    monkeypatch.setattr(pipeline, "_backend_for", lambda req, p, log: backend("tensorrt"))  # as if installed
    with pytest.raises(AutoGLMError, match="onnxruntime backend"):
        build_engine(BuildRequest(tiny_dir("llama"), tmp_path / "e", precision="fp32", backend="tensorrt",
                                  config=BuildConfig(kv_cache_dtype="int8", kv_scales="token")), log=lambda m: None)


def test_token_engine_graph_names_its_scale_pools(engines):
    model = onnx.load(str(engines["token"] / "model.opt.onnx"), load_external_data=False)
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    assert {"past_key_scale.0", "past_value_scale.1"} <= inputs and {"new_key_scale.0", "new_value_scale.1"} <= outputs


def test_the_native_graph_quantizes_with_one_operator_and_the_same_bits(engines, library):
    """The native graph makes each new K and V with one ``QuantizeKVRows`` (no ReduceMax left in a
    decode step); over the same prefill and decode steps, the pools and scale pools of that graph
    and of the same passes without ``kv_quantize`` (the graph's seven nodes) are equal bit for bit."""
    from conftest import rewritten_runner, same_pools_over_steps

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.passes import decode_nodes

    manifest = Manifest.read(engines["token"])
    native = onnx.load(str(engines["token"] / str(manifest.ort_graphs.native_graph)), load_external_data=False)
    ops = decode_nodes(native)  # a decode step's nodes
    assert ops.get("QuantizeKVRows") == 2 * manifest.spec.num_layers and "ReduceMax" not in ops
    runners = [rewritten_runner(engines["token"]), rewritten_runner(engines["token"], skip={"kv_quantize"})]
    assert "ReduceMax" in decode_nodes(rewritten_graph(engines["token"]))
    same_pools_over_steps(runners, 4)
    for r in runners:
        r.close()


def rewritten_graph(engine_dir):
    """The engine's graph through the passes but ``kv_quantize`` (nodes only)."""
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import passes

    m = Manifest.read(engine_dir)
    return passes.rewrite(m.engine_path, m.spec, m.kv.dtype, passes.Target.here(), pack=False,
                          skip={"kv_quantize"}).model


def test_the_operator_gives_quantize_rows_bits(kernel_library):
    """``QuantizeKVRows`` against ``quantize_rows`` on rows with ties (x / scale exactly half-way),
    zeros, one huge value and tiny ones, on every build."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    node = helper.make_node("QuantizeKVRows", ["x"], ["q", "s"], domain="autoglm.trt")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("q", TensorProto.INT8, None),
                               helper.make_tensor_value_info("s", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(kernel_library))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 5, 2, 64)).astype(np.float32)
    x[0, 0, 0] = 0.0
    x[0, 1, 0, :4] = [127.0, 0.5, -1.5, 2.5]  # scale 1: ties at 0.5, -1.5, 2.5
    x[0, 1, 0, 4:] = 0.0
    x[1, 2, 1] *= 1e-9  # below the floor
    x[2, 3, 0, 7] = 3e4
    q, s = sess.run(None, {"x": x})
    want_q, want_s = quantize_rows(x)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(q, want_q)
    assert list(q[0, 1, 0, :4]) == [127, 0, -2, 2]
