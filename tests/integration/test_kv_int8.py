"""INT8 KV cache: the graph rewrite, accuracy through the pool on every family, and
four times the blocks (twice for float16) in the same memory."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import onnx
import pytest
from conftest import ROOT, build_tiny_engine, run_cli

from autoglm_trt.backends.onnxrt.offline import GraphRunner
from autoglm_trt.runtime import Engine, SamplingParams

KV_BYTES = 2**20  # the same memory for every variant


def engine_pair(tiny_dir, tmp_path_factory, family: str, **config) -> tuple:
    out = tmp_path_factory.mktemp(f"kv-{family}")
    cfg = {"kv_memory_bytes": KV_BYTES, "kv_num_blocks": None, **config}
    return (build_tiny_engine(tiny_dir, out / "float", family=family, **cfg),
            build_tiny_engine(tiny_dir, out / "int8", family=family, kv_cache_dtype="int8", **cfg))


@pytest.mark.parametrize("family", ["llama", "glm", "glm4"])
def test_int8_kv_through_the_pool_stays_close_to_float_kv(tiny_dir, tmp_path_factory, family):
    """Logits at every position, 4 tokens per step through the pool (each step reads its whole
    past back from the int8 pool): max |difference| within 10% of the largest |logit| and the
    argmax the same at >= 95% of positions, on random tiny models (real ones do better: README)."""
    float_kv, int8_kv = engine_pair(tiny_dir, tmp_path_factory, family)
    windows = np.random.default_rng(0).integers(3, 250, (3, 64))
    ref = GraphRunner(float_kv).paged_logits(windows, 4)
    got = GraphRunner(int8_kv).paged_logits(windows, 4)
    assert np.abs(got - ref).max() <= 0.1 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.95
    # one prefill never reads the pool: there the two engines agree to float rounding
    np.testing.assert_allclose(GraphRunner(int8_kv).logits(windows), GraphRunner(float_kv).logits(windows),
                               atol=1e-4)


def test_the_rewrite_quantizes_where_k_and_v_are_made_and_dequantizes_after_the_gather(tiny_dir, tmp_path_factory):
    _, int8_kv = engine_pair(tiny_dir, tmp_path_factory, "glm")
    model = onnx.load(str(int8_kv / "model.opt.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
    assert types["past_key.0"] == types["new_value.1"] == onnx.TensorProto.INT8
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("QuantizeLinear") >= 4 and ops.count("DequantizeLinear") >= 4  # K and V of 2 layers
    manifest_scales = Engine.load(int8_kv).manifest.kv.scales
    assert set(manifest_scales) == {f"new_{k}.{i}" for i in range(2) for k in ("key", "value")}
    assert all(len(v) == 2 and min(v) > 0 for v in manifest_scales.values())  # one scale per KV head


def test_four_times_the_blocks_and_that_many_sequences_complete(tiny_dir, tmp_path_factory):
    float_kv, int8_kv = engine_pair(tiny_dir, tmp_path_factory, "llama", max_batch_size=64, max_input_len=8,
                                    max_seq_len=16, kv_memory_bytes=64 * 1024)  # 32 float32 blocks of 8
    with Engine.load(float_kv) as f, Engine.load(int8_kv) as q:
        assert q.allocator.num_blocks == 4 * f.allocator.num_blocks
        prompts = [[3 + i % 200, 4, 5 + i // 200, 6] for i in range(q.allocator.num_blocks)]
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        expected = [r.token_ids for r in f.generate(prompts, params)]
        results: list = [None] * len(prompts)

        def one(i: int) -> None:
            results[i] = q.generate([prompts[i]], params)[0].token_ids

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert all(r is not None and len(r) == 4 for r in results)
        assert np.mean([a == b for a, b in zip(results, expected)]) >= 0.9  # greedy, int8 past: nearly always equal
        assert q.stats()["free_blocks"] == q.allocator.num_blocks


def test_float16_engine_gets_twice_the_blocks(tiny_dir, tmp_path):
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    blocks = {}
    for kv in ("float16", "int8"):
        cfg = BuildConfig(max_batch_size=4, max_input_len=48, max_seq_len=96, kv_block_size=8,
                          kv_memory_bytes=KV_BYTES, kv_cache_dtype=kv)
        m = build_engine(BuildRequest(tiny_dir("llama"), tmp_path / kv, precision="fp16", backend="onnxruntime",
                                      config=cfg, cache_dir=tmp_path / ".cache"), log=lambda m: None)
        blocks[kv] = m["kv_cache"]["num_blocks"]
    assert blocks["int8"] == 2 * blocks["float16"]
    with Engine.load(tmp_path / "int8") as e:
        [r] = e.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert len(r.token_ids) == 8


def test_eval_step_tokens_reads_through_the_pool(tiny_dir, tmp_path_factory):
    float_kv, int8_kv = engine_pair(tiny_dir, tmp_path_factory, "glm4")
    text = str(ROOT / "calibration" / "eval" / "heldout.txt")
    args = ["--text", text, "--max-chunks", "2", "--seq-len", "64", "--json"]
    one_shot = run_cli("eval", str(int8_kv), *args)
    paged = run_cli("eval", str(int8_kv), *args, "--step-tokens", "16", "--reference", str(float_kv))
    assert one_shot.returncode == 0 and paged.returncode == 0, paged.stderr
    import json

    a, b = json.loads(one_shot.stdout), json.loads(paged.stdout)
    assert b["step_tokens"] == 16 and b["ppl"] != a["ppl"]  # the pool (int8) was read
    assert b["top1_agreement"] >= 0.9
    shutil.rmtree(int8_kv.parent, ignore_errors=True)


def test_v_is_measured_as_the_smoothed_graph_stores_it():
    """SmoothQuant of o_proj divides V's channels by s (shared by the query heads of a group):
    the INT8 graph stores V / s, and that is what each KV head's histogram sees."""
    from autoglm_trt.calib.collect import kv_head_amax, kv_observe, value_scales
    from autoglm_trt.model.spec import spec_from_dict

    spec = spec_from_dict({"family": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
                           "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 2, "rms_norm_eps": 1e-5,
                           "rope": {"theta": 1e4, "rotary_dim": 2, "rope_type": "default", "scaling": {}},
                           "max_position_embeddings": 64, "tie_word_embeddings": True, "bos_token_id": None,
                           "eos_token_ids": []})
    # o_proj's vector over the 4 query heads x 2 dims; a KV channel takes its group's max: s_kv = [[1, 8], [4, 1]]
    s_o = np.array([1.0, 2.0, 0.5, 8.0, 4.0, 1.0, 1.0, 1.0], np.float32)
    x = np.array([[1.0, 4.0], [2.0, 3.0]], np.float32).reshape(1, 1, 2, 2)  # [batch, tokens, kv_heads, head_dim]
    hists: dict = {}
    kv_observe(hists, ["new_key.0", "new_value.0"], [x.copy(), x.copy()], value_scales(spec, {"layers.0.o_proj": s_o}))
    assert [h.amax for h in hists["new_key.0"]] == [4.0, 3.0]  # K is not smoothed
    assert [h.amax for h in hists["new_value.0"]] == [max(1.0, 4.0 / 8.0), max(2.0 / 4.0, 3.0)]
    thresholds = kv_head_amax(hists)
    assert all(0 < t <= h.amax for t, h in zip(thresholds["new_value.0"], hists["new_value.0"]))
