"""The native PagedAttention operator: against a numpy reference, in the engine graph, and its fallback."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import KV_ENGINES, cpu_has

from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs


def reference(q, k_new, v_new, pool_k, pool_v, tables, ctx, qlens):
    """Attention of each valid new token over its past (read through the block table) and the new
    tokens up to itself; padding rows stay zero."""
    B, T, Hq, D = q.shape
    Hkv, _, BS, _ = pool_k.shape
    G = Hq // Hkv
    out = np.zeros((B, T, Hq, D), np.float64)
    for b in range(B):
        pos = np.arange(ctx[b])
        keys = np.concatenate([pool_k[:, tables[b][pos // BS], pos % BS], k_new[b].transpose(1, 0, 2)], axis=1)
        values = np.concatenate([pool_v[:, tables[b][pos // BS], pos % BS], v_new[b].transpose(1, 0, 2)], axis=1)
        for t in range(qlens[b]):
            for h in range(Hq):
                seen = ctx[b] + t + 1
                s = keys[h // G, :seen].astype(np.float64) @ q[b, t, h]
                p = np.exp(s - s.max())
                out[b, t, h] = (p / p.sum()) @ values[h // G, :seen]
    return out.reshape(B, T, Hq * D)


def block_tables(rng, ctx: list[int], nb: int, bs: int) -> np.ndarray:
    """Each sequence's blocks, anywhere in a pool of nb blocks and in any order; unused entries 0."""
    tables = np.zeros((len(ctx), max(1, -(-max(ctx) // bs))), np.int64)
    for b, c in enumerate(ctx):
        n = -(-c // bs)
        tables[b, :n] = rng.choice(nb, n, replace=False)
    return tables


def op_session(library, hq, hkv, d, nb, bs, int8_kv=False, threads=0):
    """A session of the operator alone; ``int8_kv`` True: int8 pools with a scale per KV head,
    "token": with a scale per stored token and KV head; ``threads``: ONNX Runtime's (0: its default)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = ["q", "k", "v", "pk", "pv", "bt", "ctx", "ql"] + (["ks", "vs"] if int8_kv else [])
    op = "PagedAttentionInt8KV" if int8_kv else "PagedAttention"
    node = helper.make_node(op, names, ["out"], domain="autoglm.trt")
    f, i, pool = TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT8 if int8_kv else TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, ["B", "T", hq, d]),
              helper.make_tensor_value_info("k", f, ["B", "T", hkv, d]),
              helper.make_tensor_value_info("v", f, ["B", "T", hkv, d]),
              helper.make_tensor_value_info("pk", pool, [hkv, nb, bs, d]),
              helper.make_tensor_value_info("pv", pool, [hkv, nb, bs, d]),
              helper.make_tensor_value_info("bt", i, ["B", "M"]),
              helper.make_tensor_value_info("ctx", i, ["B"]), helper.make_tensor_value_info("ql", i, ["B"])]
    inputs += [helper.make_tensor_value_info(n, f, [hkv, nb, bs] if int8_kv == "token" else [hkv]) for n in names[8:]]
    graph = helper.make_graph([node], "paged_attention", inputs, [helper.make_tensor_value_info("out", f, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    so.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("int8_kv", [False, True, "token"], ids=["float-kv", "int8-kv", "int8-token-kv"])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 2, 16), (2, 2, 8)])
@pytest.mark.parametrize("ctx,qlens,t", [
    ([0, 17, 40, 5], [1, 1, 1, 1], 1),  # decode, ragged contexts (one empty)
    ([0, 17, 40], [5, 2, 1], 5),  # prefill chunks of different lengths, padded to 5
    ([3, 0, 33], [4, 4, 4], 4),
    ([300], [1], 1),  # a long context over many blocks
    ([2500, 7, 1030], [1, 1, 1], 1),  # pasts split into parts of 1,024 positions (PART_POSITIONS) and merged
    ([1500, 3], [3, 2], 3),  # a split past with new tokens
])
def test_kernel_matches_reference(library, hq, hkv, d, ctx, qlens, t, int8_kv):
    rng = np.random.default_rng(hq * 100 + sum(ctx) + t)
    bs = 8
    nb = max(48, -(-max(ctx) // bs))
    pool_k = rng.standard_normal((hkv, nb, bs, d), dtype=np.float32)
    pool_v = rng.standard_normal((hkv, nb, bs, d), dtype=np.float32)
    feeds = {}
    if int8_kv:  # int8 pools with a scale per KV head (or token); the reference reads them dequantized
        shape = (hkv, nb, bs) if int8_kv == "token" else (hkv, 1, 1)
        k_scales, v_scales = (rng.uniform(0.01, 0.05, shape).astype(np.float32) for _ in range(2))
        stored = [rng.integers(-127, 128, (hkv, nb, bs, d)).astype(np.int8) for _ in range(2)]
        pool_k, pool_v = (x * sc[..., None] for x, sc in zip(stored, (k_scales, v_scales)))
        if int8_kv is True:
            k_scales, v_scales = k_scales.reshape(hkv), v_scales.reshape(hkv)
        feeds = {"pk": stored[0], "pv": stored[1], "ks": k_scales, "vs": v_scales}
    B = len(ctx)
    q = rng.standard_normal((B, t, hq, d), dtype=np.float32) * 0.3
    k_new = rng.standard_normal((B, t, hkv, d), dtype=np.float32)
    v_new = rng.standard_normal((B, t, hkv, d), dtype=np.float32)
    tables = block_tables(rng, ctx, nb, bs)
    out = op_session(library, hq, hkv, d, nb, bs, int8_kv).run(["out"], {
        "q": q, "k": k_new, "v": v_new, "pk": pool_k, "pv": pool_v, "bt": tables,
        "ctx": np.array(ctx, np.int64), "ql": np.array(qlens, np.int64), **feeds})[0]
    want = reference(q, k_new, v_new, pool_k, pool_v, tables, ctx, qlens)
    assert out.shape == (B, t, hq * d)
    np.testing.assert_allclose(out, want, atol=2e-5 if int8_kv else 3e-6, rtol=1e-5)  # int8 K/V values reach 6
    for b, n in enumerate(qlens):
        assert not out[b, n:].any(), "padding rows must be zero"


@pytest.mark.parametrize("d", [64, 16])
def test_per_token_scales_on_every_build(kernel_library, d):
    """Int8 pools with a scale per stored token, on the best, AVX2 and portable builds: the
    reference over the dequantized pools, for decode and a padded prefill chunk."""
    rng = np.random.default_rng(d)
    hq, hkv, nb, bs = 6, 2, 24, 8
    ctx, qlens, t = [0, 21, 40], [3, 1, 2], 3
    k_scales, v_scales = (rng.uniform(0.001, 0.1, (hkv, nb, bs)).astype(np.float32) for _ in range(2))
    stored = [rng.integers(-127, 128, (hkv, nb, bs, d)).astype(np.int8) for _ in range(2)]
    q = rng.standard_normal((len(ctx), t, hq, d), dtype=np.float32) * 0.3
    k_new, v_new = (rng.standard_normal((len(ctx), t, hkv, d), dtype=np.float32) for _ in range(2))
    tables = block_tables(rng, ctx, nb, bs)
    out = op_session(kernel_library, hq, hkv, d, nb, bs, "token").run(["out"], {
        "q": q, "k": k_new, "v": v_new, "pk": stored[0], "pv": stored[1], "bt": tables, "ks": k_scales, "vs": v_scales,
        "ctx": np.array(ctx, np.int64), "ql": np.array(qlens, np.int64)})[0]
    want = reference(q, k_new, v_new, stored[0] * k_scales[..., None], stored[1] * v_scales[..., None], tables, ctx,
                     qlens)
    np.testing.assert_allclose(out, want, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("bs", [16, 24])
def test_a_split_past_gives_the_same_bits_on_any_number_of_threads(library, bs):
    """A past longer than a part (1,024 positions, whole blocks: 1,008 at 24 a block) is attended
    in parts that are merged afterwards; the parts depend on the context alone, so one, two and
    four threads give the same bits, and the result is attention's (the reference)."""
    rng = np.random.default_rng(bs)
    hq, hkv, d, ctx, qlens = 8, 2, 64, [3000, 1008, 1009, 40], [1, 1, 1, 0]
    nb = -(-max(ctx) // bs) + 1
    feeds = {"q": rng.standard_normal((4, 1, hq, d), dtype=np.float32) * 0.3,
             "k": rng.standard_normal((4, 1, hkv, d), dtype=np.float32),
             "v": rng.standard_normal((4, 1, hkv, d), dtype=np.float32),
             "pk": rng.standard_normal((hkv, nb, bs, d), dtype=np.float32),
             "pv": rng.standard_normal((hkv, nb, bs, d), dtype=np.float32), "bt": block_tables(rng, ctx, nb, bs),
             "ctx": np.array(ctx, np.int64), "ql": np.array(qlens, np.int64)}
    outs = [op_session(library, hq, hkv, d, nb, bs, threads=n).run(["out"], feeds)[0] for n in (1, 2, 4)]
    for other in outs[1:]:
        np.testing.assert_array_equal(outs[0], other)
    want = reference(feeds["q"], feeds["k"], feeds["v"], feeds["pk"], feeds["pv"], feeds["bt"], ctx, qlens)
    np.testing.assert_allclose(outs[0], want, atol=3e-6, rtol=1e-5)
    assert not outs[0][3].any()


def test_scale_pools_of_another_geometry_fail_the_run(library):
    """Per-token scale pools must have the int8 pools' blocks and block size: a crafted graph's
    smaller ones are an error, not a read past their end."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    names = ["q", "k", "v", "pk", "pv", "bt", "ctx", "ql", "ks", "vs"]
    node = helper.make_node("PagedAttentionInt8KV", names, ["out"], domain="autoglm.trt")
    types = {"pk": TensorProto.INT8, "pv": TensorProto.INT8, "bt": TensorProto.INT64, "ctx": TensorProto.INT64,
             "ql": TensorProto.INT64}
    inputs = [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None) for n in names]
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("autoglm.trt", 1)])
    so = ort.SessionOptions()
    so.register_custom_ops_library(str(library))
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {"q": np.ones((1, 1, 1, 8), np.float32), "k": np.ones((1, 1, 1, 8), np.float32),
             "v": np.ones((1, 1, 1, 8), np.float32), "pk": np.zeros((1, 4, 4, 8), np.int8),
             "pv": np.zeros((1, 4, 4, 8), np.int8), "bt": np.array([[3, 2]], np.int64), "ctx": np.array([7], np.int64),
             "ql": np.ones(1, np.int64), "ks": np.ones((1, 1, 4), np.float32), "vs": np.ones((1, 1, 4), np.float32)}
    with pytest.raises(Exception, match="PagedAttentionInt8KV: shapes do not fit"):
        sess.run(["out"], feeds)


@pytest.mark.parametrize("nb,bs,ctx,table,why", [
    (4, 0, [0], [[0]], "blocks of 0: each must be at least 1"),  # unchecked: a division by zero (SIGFPE)
    (0, 4, [3], [[0]], "0 blocks of 4: each must be at least 1"),  # unchecked: a read out of the empty pool
    (4, 4, [2**63 - 1], [[0]], r"context_lens\[0\] = 9223372036854775807 does not fit a block table"),  # overflows
    (4, 4, [-5], [[0]], r"context_lens\[0\] = -5"),
    (4, 4, [9], [[0, 1, 4]], r"block_tables\[0\]\[2\] = 4 is outside the pool of 4 blocks"),  # unchecked: read as block 0
])
def test_inputs_the_kernel_cannot_read_safely_fail_the_run_with_the_reason(library, nb, bs, ctx, table, why):
    """A crafted graph's pool geometry, lengths or block numbers: an ONNX Runtime error naming the
    operator and what does not fit, instead of a crash, a read outside the pools or silent zeros."""
    hq = hkv = 1
    d = 8
    sess = op_session(library, hq, hkv, d, nb, bs)
    feeds = {"q": np.ones((1, 1, hq, d), np.float32), "k": np.ones((1, 1, hkv, d), np.float32),
             "v": np.ones((1, 1, hkv, d), np.float32), "pk": np.zeros((hkv, nb, bs, d), np.float32),
             "pv": np.zeros((hkv, nb, bs, d), np.float32), "bt": np.array(table, np.int64),
             "ctx": np.array(ctx, np.int64), "ql": np.ones(1, np.int64)}
    with pytest.raises(Exception, match=f"PagedAttention: .*{why}"):
        sess.run(["out"], feeds)


def _runner(engine_dir, monkeypatch, native: bool):
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends import open_runner

    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "1" if native else "0")
    return open_runner(Manifest.read(engine_dir), num_blocks=32, threads=1)


@pytest.mark.parametrize("kv", list(KV_ENGINES))
def test_engine_graph_with_the_operator_matches_the_graph_attention(request, library, monkeypatch, kv):
    """The tiny engine's logits with the native operator equal those of its own attention nodes,
    for a prefill of two prompts of different lengths and then two decode steps (float32 and
    INT8 KV cache, static and per-token scales)."""
    engine = request.getfixturevalue(KV_ENGINES[kv])
    runners = [_runner(engine, monkeypatch, native) for native in (True, False)]
    assert runners[0].attention == "native"
    assert runners[1].attention == "graph (AUTOGLM_TRT_NATIVE=0)"
    from conftest import logits_over_steps

    for native, graph in logits_over_steps(runners):
        np.testing.assert_allclose(native, graph, atol=2e-5, rtol=1e-4)
    for r in runners:
        r.close()


@pytest.mark.parametrize("kv,op", [("float", "PagedAttention"), ("int8", "PagedAttentionInt8KV"),
                                   ("int8-token", "PagedAttentionInt8KV")])
def test_the_rewrite_gives_every_layer_the_operator_for_decode_steps(request, kv, op):
    import onnx

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.passes.attention import rewrite

    manifest = Manifest.read(request.getfixturevalue(KV_ENGINES[kv]))
    model = onnx.load(str(manifest.engine_path), load_external_data=False)
    before = len(model.graph.node)
    done, why = rewrite(model, manifest.spec.num_layers)
    assert done, why
    ops = [n.op_type for n in model.graph.node]
    branches = [n for n in model.graph.node if n.op_type == "If"]
    assert len(branches) == manifest.spec.num_layers and "Softmax" not in ops and len(ops) < before
    for node in branches:
        then, other = (next(a.g for a in node.attribute if a.name == name) for name in ("then_branch", "else_branch"))
        assert [n.op_type for n in then.node] == [op]  # one new token per sequence
        assert "Softmax" in [n.op_type for n in other.node]  # prefill: the graph's own attention


def test_a_graph_without_the_expected_tensors_is_left_alone(tiny_engine):
    import onnx

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.passes.attention import rewrite

    manifest = Manifest.read(tiny_engine)
    model = onnx.load(str(manifest.engine_path), load_external_data=False)
    for node in model.graph.node:
        node.output[:] = [o.replace("layers.1.q_grouped", "renamed") for o in node.output]
    nodes = len(model.graph.node)
    done, why = rewrite(model, manifest.spec.num_layers)
    assert not done and "layers.1.q_grouped" in why and len(model.graph.node) == nodes


def test_no_installed_build_means_the_graph_attention(tiny_engine, monkeypatch):
    from autoglm_trt import native

    monkeypatch.setattr(native, "installed", lambda: {})
    runner = _runner(tiny_engine, monkeypatch, native=True)
    assert runner.attention.startswith("graph (the native library was not built when autoglm-trt was installed")
    runner.close()


def test_the_installed_library_runs_where_there_is_no_compiler(tiny_engine, library, tmp_path):
    """Built at install time: a process whose PATH has no C compiler loads it and runs the engine's
    decode steps with the native operators (nothing is compiled on first use)."""
    import os
    import subprocess
    import sys

    code = ("import shutil, sys; from autoglm_trt.artifacts import Manifest; from autoglm_trt.backends import open_runner\n"
            "assert not any(shutil.which(c) for c in ('cc', 'gcc', 'clang')), 'a compiler is on PATH'\n"
            f"r = open_runner(Manifest.read({str(tiny_engine)!r}), num_blocks=32, threads=1)\n"
            "print(r.attention)")
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "AUTOGLM_TRT_NATIVE", "AUTOGLM_TRT_NATIVE_VARIANT")}
    env["PATH"] = str(tmp_path)  # nothing on it
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "native"


def test_doctor_says_which_attention_decode_steps_run(tiny_engine, library, monkeypatch):
    from conftest import run_cli

    r = run_cli("doctor", str(tiny_engine))
    assert r.returncode == 0 and f"native PagedAttention operator ({library})" in r.stdout
    monkeypatch.setenv("AUTOGLM_TRT_NATIVE", "0")
    r = run_cli("doctor", str(tiny_engine))
    assert r.returncode == 0 and "the graph's own nodes, slower (AUTOGLM_TRT_NATIVE=0)" in r.stdout


def test_a_library_that_does_not_load_means_the_graph_attention(tiny_engine, monkeypatch, tmp_path):
    from autoglm_trt import native

    bogus = tmp_path / "broken.so"
    bogus.write_text("not a shared library")
    monkeypatch.setattr(native, "library", lambda variant=None: (bogus, ""))
    runner = _runner(tiny_engine, monkeypatch, native=True)
    assert runner.attention.startswith(f"graph (the native library {bogus} did not load")
    feeds, slots = step_inputs([[5, 9, 3]], [SeqState(0, [0])], runner.block_size)
    assert np.isfinite(runner.step(feeds, slots)).all()
    runner.close()


@pytest.mark.parametrize("d,ctx,qlens,t", [(64, [0, 17, 300, 5], [1, 1, 1, 1], 1), (64, [3, 0, 33], [4, 4, 4], 4),
                                           (128, [70, 1, 16], [1, 1, 1], 1), (128, [9, 40], [2, 3], 3),
                                           (24, [40, 9], [1, 3], 3), (8, [21], [1], 1)])
@pytest.mark.parametrize("int8_kv", [False, True], ids=["float-kv", "int8-kv"])
def test_the_vector_kernels_give_the_bits_of_the_compiled_loop(turned_builds, d, ctx, qlens, t, int8_kv):
    """The AVX-512 and AVX2 builds' attention kernels add in the order GCC's vectorization of the
    plain loops does with that build's vectors (``paged_attention.c``), so the operator's output is
    the loop build's, bit for bit: the runtime figures measured before them stand. d 64 and 128 take
    the turned loops (keys inner, outputs in registers), d 24 and 8 the tail and the short paths.
    Where GCC prefers narrower vectors than the build's (its tuning for Intel's AVX-512 cores is
    256 bits), the loop rounds otherwise and only the reference check above applies."""
    library, loop = turned_builds
    rng = np.random.default_rng(d + t)
    hq, hkv, nb, bs = 6, 2, 48, 8
    B, tables = len(ctx), block_tables(rng, ctx, nb, bs)
    feeds = {"q": rng.standard_normal((B, t, hq, d), dtype=np.float32),
             "k": rng.standard_normal((B, t, hkv, d), dtype=np.float32),
             "v": rng.standard_normal((B, t, hkv, d), dtype=np.float32),
             "pk": rng.standard_normal((hkv, nb, bs, d), dtype=np.float32),
             "pv": rng.standard_normal((hkv, nb, bs, d), dtype=np.float32), "bt": tables,
             "ctx": np.array(ctx, np.int64), "ql": np.array(qlens, np.int64)}
    if int8_kv:
        feeds.update({"pk": rng.integers(-127, 128, (hkv, nb, bs, d)).astype(np.int8),
                      "pv": rng.integers(-127, 128, (hkv, nb, bs, d)).astype(np.int8),
                      "ks": rng.uniform(0.01, 0.05, hkv).astype(np.float32),
                      "vs": rng.uniform(0.01, 0.05, hkv).astype(np.float32)})
    ours = op_session(library, hq, hkv, d, nb, bs, int8_kv).run(["out"], feeds)[0]
    theirs = op_session(loop, hq, hkv, d, nb, bs, int8_kv).run(["out"], feeds)[0]
    assert ours.any()
    np.testing.assert_array_equal(ours, theirs)


VECTOR_BITS = {"avx512-vnni": "512", "avx512": "512", "avx2": "256"}  # the builds with vector kernels


@pytest.fixture(scope="module", params=["native", "avx2"])
def turned_builds(request, library, tmp_path_factory):
    """(a build with vector attention kernels, the same variant compiled again with the plain loops
    (``-DAUTOGLM_LOOP_DOT4``), which GCC vectorizes): the installed build for this CPU, and the AVX2
    build where that is another; skips without a compiler, or where the compiler's preferred vector
    width for that variant is not the build's."""
    from autoglm_trt.native import library as native_library
    from autoglm_trt.native import variant_of
    from autoglm_trt.native.build import compile_library, compiler
    from autoglm_trt.native.variants import COMMON_FLAGS, SOURCES, for_machine

    if request.param == "avx2":
        if variant_of(library) == "avx2":
            pytest.skip("the installed build for this CPU is the AVX2 one (the native case)")
        if not cpu_has("avx2"):
            pytest.skip("this CPU has no AVX2")
        library, why = native_library("avx2")
        if library is None:
            pytest.skip(f"no AVX2 build here: {why}")
    name = variant_of(library)
    if name not in VECTOR_BITS:
        pytest.skip(f"the {name} build has no vector attention kernels")
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler to build the plain-loop library with")
    variant = {v.name: v for v in for_machine()}[name]
    width = _preferred_vector_width(cc, variant.flags)
    if width not in ("none", VECTOR_BITS[name]):
        pytest.skip(f"the compiler vectorizes the plain loop with {width}-bit vectors here, not {VECTOR_BITS[name]}")
    out = tmp_path_factory.mktemp("loop") / f"libautoglm-{name}-loop.so"
    compile_library(out, variant.flags + ("-DAUTOGLM_LOOP_DOT4",), SOURCES, COMMON_FLAGS, cc=cc)
    return library, out


def _preferred_vector_width(cc: str, flags: tuple[str, ...]) -> str:
    """The C compiler's preferred vector width for these flags (``-mprefer-vector-width``: "none"
    means the widest), or "unknown" where it does not say (clang)."""
    import subprocess

    try:
        out = subprocess.run([cc, *flags, "-Q", "--help=target"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    for line in out.splitlines():
        if line.strip().startswith("-mprefer-vector-width="):
            return line.split()[-1]
    return "unknown"


@pytest.mark.parametrize("kv", list(KV_ENGINES))
def test_one_branch_per_step_gives_the_per_layer_branches_outputs_bit_for_bit(request, library, monkeypatch, kv):
    """The loaded graph branches once (decode: the operator in every layer; prefill: the graph's
    attention), and its logits and new K/V equal those of the per-layer ``If`` form exactly,
    over a prefill and two decode steps."""
    from conftest import logits_over_steps, rewritten_runner

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import passes
    from autoglm_trt.backends.onnxrt.passes import decode_nodes

    engine = request.getfixturevalue(KV_ENGINES[kv])
    one = _runner(engine, monkeypatch, native=True)
    per_layer = rewritten_runner(engine, skip={"step_branch"})
    monkeypatch.undo()
    pools = [r.pools for r in (one, per_layer)]
    for a, b in logits_over_steps([one, per_layer]):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(pools[0].data, pools[1].data)  # the K/V written back
        if kv == "int8-token":
            np.testing.assert_array_equal(pools[0].scales, pools[1].scales)

    manifest = Manifest.read(engine)
    model = passes.rewrite(manifest.engine_path, manifest.spec, one.kv_dtype, passes.Target.here(), pack=False).model
    step = [n for n in model.graph.node if n.op_type == "If"]
    assert len(step) == 1 and len(model.graph.node) == 4  # the condition's Shape, Gather, Equal; the If
    branches = {a.name: [n.op_type for n in a.g.node] for a in step[0].attribute}
    decode, prefill = branches["then_branch"], branches["else_branch"]
    from autoglm_trt.native import softmax_exact

    softmax = "MaskedSoftmax" if softmax_exact(library) else "Softmax"  # the prefill's, either way the graph's bits
    assert "If" not in decode + prefill and softmax not in decode and softmax in prefill
    op = "PagedAttention" if kv == "float" else "PagedAttentionInt8KV"
    assert decode.count(op) == manifest.spec.num_layers and op not in prefill
    assert decode_nodes(model)[op] == manifest.spec.num_layers
    for r in (one, per_layer):
        r.close()


def test_only_a_library_nobody_else_may_write_is_loaded(library, monkeypatch, tmp_path):
    """The library is loaded from the package's directory alone (nothing is compiled into or read
    from a cache another user could plant a file in), and not when others may write it or its
    directory."""
    import shutil

    from autoglm_trt import native

    monkeypatch.setenv("AUTOGLM_TRT_CACHE", str(tmp_path))  # a shared cache directory: never read
    found, why = native.library()
    assert found is not None and found.parent == native.HERE and why == ""
    here = tmp_path / "pkg"
    here.mkdir(mode=0o755)
    copy = here / found.name
    shutil.copy2(found, copy)
    copy.chmod(0o755)
    monkeypatch.setattr(native, "HERE", here)
    assert native.library() == (copy, "")
    copy.chmod(0o757)
    assert native.library()[0] is None and "writable by its group or others" in native.library()[1]
    copy.chmod(0o755)
    here.chmod(0o777)
    assert native.library()[0] is None and str(here) in native.library()[1]
