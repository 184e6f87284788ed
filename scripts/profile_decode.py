#!/usr/bin/env python3
"""Where a decode step of the SmolLM2 engines spends its time, measured on this machine.

    python scripts/profile_decode.py [--engines engines/smollm2-int8,engines/smollm2-fp32] [--ctx 128]

For each engine, at batch 1 and 8 with ``--ctx`` tokens of context (2 ONNX Runtime threads):
1. the engine graph alone: ``session.run`` of ``model.opt.onnx`` on a decode step's inputs;
2. its linears alone: a graph of the same GEMMs (shapes of every layer's QKV, o_proj, gate/up,
   down and the LM head, INT8 where the engine's plan has INT8, with the kernels ONNX Runtime
   picked for the engine: QuantizeLinear + MatMulIntegerToFloat, or MatMul) chained layer by
   layer, random weights. Its time is the floor the rest of the graph sits on;
3. ONNX Runtime's own profile of the engine graph: kernel time by operator type (profiling
   adds a per-node cost, so shares are indicative);
4. the whole runtime at batch 1: time per generated token and, of it, the time inside
   ``run_with_iobinding``; the rest is Python, K/V write-back and sampling.
With ``--experiments``, for the INT8 engine, two variants of its graph timed against it
(timing only: their outputs are not the model's):
- without the attention core: each layer's o_proj reads its input norm instead of the
  attention output, and the nodes that no longer reach an output are dropped;
- with ``MatMulNBits`` (8 bits, blocks of 32, ``accuracy_level`` 4: the kernel ONNX Runtime
  GenAI's int8 models use) in place of each QuantizeLinear + MatMulIntegerToFloat pair.
Prints the CPU model and one JSON line per engine.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def session(model, threads: int, profile: str | None = None):
    """A CPU session with the project's options (``graph.session``), ONNX Runtime profiling if asked."""
    import onnxruntime as ort

    from autoglm_trt.graph.session import session_options

    so = session_options(threads)
    if profile:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(model if isinstance(model, (str, bytes)) else model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def decode_feeds(spec, batch: int, ctx: int, block_size: int = 16, slots: bool = False) -> dict[str, np.ndarray]:
    """A decode step's inputs (``paged_kv.step_inputs``): ``batch`` sequences of ``ctx`` cached tokens
    each, in blocks of their own, over pools of random K/V; with ``slots``, also where the native
    attention operator stores the new tokens' K/V (``native.slots``, an input of the runner's graph)."""
    from autoglm_trt.kvcache.host_pools import KVPools
    from autoglm_trt.kvcache.layout import blocks_needed
    from autoglm_trt.kvcache.step_inputs import SeqState, step_inputs

    nb = blocks_needed(ctx + 1, block_size)
    pools = KVPools(spec.num_layers, batch * nb, block_size, spec.num_kv_heads, spec.head_dim)
    pools.data[:] = np.random.default_rng(0).standard_normal(pools.data.shape, np.float32)
    states = [SeqState(ctx, list(range(b * nb, (b + 1) * nb))) for b in range(batch)]
    feeds, where = step_inputs([[5]] * batch, states, block_size)
    if slots:
        feeds["native.slots"] = where.block * block_size + where.offset
    return {**feeds, **pools.feeds()}


def run_ms(sess, feeds: dict[str, np.ndarray], runs: int = 40) -> float:
    """Mean time of one run, the best of 5 repetitions of ``runs // 5`` runs."""
    for _ in range(5):
        sess.run(None, feeds)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(runs // 5):
            sess.run(None, feeds)
        best = min(best, (time.perf_counter() - t) / (runs // 5))
    return best * 1e3


def linears_graph(spec, int8: set[str], batch: int):
    """The engine's GEMMs alone, chained: x -> (qkv, o_proj, gate/up on x; down on silu-free gate*up)
    -> x + down, layer after layer, then the LM head."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    d, f = spec.hidden_size, spec.intermediate_size
    qkv = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim

    def linear(x: str, k: int, n: int, name: str) -> str:
        if name in int8:
            inits.extend([numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), f"{name}.w"),
                          numpy_helper.from_array(np.float32(0.02), f"{name}.as"),
                          numpy_helper.from_array(np.uint8(128), f"{name}.zp"),
                          numpy_helper.from_array(np.full(n, 1e-3, np.float32), f"{name}.ws")])
            nodes.append(helper.make_node("QuantizeLinear", [x, f"{name}.as", f"{name}.zp"], [f"{name}.q"]))
            nodes.append(helper.make_node("MatMulIntegerToFloat", [f"{name}.q", f"{name}.w", f"{name}.as", f"{name}.ws",
                                                                   f"{name}.zp"], [name], domain="com.microsoft"))
        else:
            inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.02).astype(np.float32), f"{name}.w"))
            nodes.append(helper.make_node("MatMul", [x, f"{name}.w"], [name]))
        return name

    x = "x"
    for i in range(spec.num_layers):
        p = f"layers.{i}"
        linear(x, d, qkv, f"{p}.qkv")
        linear(x, d, d, f"{p}.o_proj")
        gu = linear(x, d, 2 * f, f"{p}.gate_up")
        nodes.append(helper.make_node("Split", [gu], [f"{p}.g", f"{p}.u"], axis=-1, num_outputs=2))
        nodes.append(helper.make_node("Mul", [f"{p}.g", f"{p}.u"], [f"{p}.act"]))
        down = linear(f"{p}.act", f, d, f"{p}.down")
        nodes.append(helper.make_node("Add", [x, down], [f"{p}.res"]))
        x = f"{p}.res"
    out = linear(x, d, spec.vocab_size, "lm_head")
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, d])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def op_profile(path: Path, feeds: dict[str, np.ndarray], threads: int, runs: int = 30) -> dict[str, dict]:
    cache = ROOT / "engines" / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # beside the engine: its data file is hard-linked
        sess = session(str(path), threads, profile=os.path.join(tmp, "prof"))
        for _ in range(runs):
            sess.run(None, feeds)
        events = json.loads(Path(sess.end_profiling()).read_text())
    by_op: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] += e["dur"]
            count[e["args"]["op_name"]] += 1
    total = sum(by_op.values())
    return {op: {"share": round(t / total, 3), "nodes": count[op] // runs}
            for op, t in sorted(by_op.items(), key=lambda kv: -kv[1])}


def runtime_split(engine_dir: Path, threads: int, gen: int = 96) -> dict[str, float]:
    from autoglm_trt.runtime import Engine, SamplingParams

    engine = Engine.load(engine_dir, threads=threads)
    sess = engine.backend.session
    inner = sess.run_with_iobinding
    ort_s: list[float] = []

    def timed(*a, **k):
        t = time.perf_counter()
        inner(*a, **k)
        ort_s.append(time.perf_counter() - t)

    sess.run_with_iobinding = timed
    prompt = np.random.default_rng(1).integers(100, 40000, 32).tolist()
    runs = []  # (median ms a token, median ms in ONNX Runtime) of one generation: both from the same steps
    for _ in range(3):
        ort_s.clear()
        r = engine.generate([prompt], SamplingParams(max_new_tokens=gen, ignore_eos=True))[0]
        runs.append((float(np.median(np.diff(r.token_times))) * 1e3, float(np.median(ort_s[1:])) * 1e3))
    engine.close()
    step, ort_ms = min(runs)
    return {"token_ms": round(step, 3), "inside_ort_ms": round(ort_ms, 3), "outside_ort_ms": round(step - ort_ms, 3)}


def without_attention(model):
    """The graph with every layer's o_proj fed its input norm, and the dead nodes dropped."""
    for node in model.graph.node:
        node.input[:] = [x[: -len(".attn")] + ".input_norm" if x.startswith("layers.") and x.endswith(".attn")
                         else x for x in node.input]
    needed, kept = {o.name for o in model.graph.output}, []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            kept.append(node)
            needed.update(node.input)
    del model.graph.node[:]
    model.graph.node.extend(reversed(kept))
    return model


def with_matmul_nbits(model, block: int = 32):
    """Each INT8 GEMM (QuantizeLinear -> [Reshape] -> MatMulIntegerToFloat) as one MatMulNBits on
    the float input: the INT8 weights exactly (uint8 = int8 + 128, the channel's scale in every block)."""
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    replaced, nodes = set(), []
    for node in model.graph.node:
        if node.op_type != "MatMulIntegerToFloat":
            nodes.append(node)
            continue
        chain, q = [], producer[node.input[0]]
        while q.op_type != "QuantizeLinear":
            chain.append(q)
            q = producer[q.input[0]]
        replaced.update(n.name for n in [q, *chain])
        w = numpy_helper.to_array(inits[node.input[1]]).astype(np.int16)
        scale = numpy_helper.to_array(inits[node.input[3]]).astype(np.float32)
        k, n = w.shape
        blocks = -(-k // block)
        q8 = (np.pad(w.T, ((0, 0), (0, blocks * block - k))) + 128).astype(np.uint8).reshape(n, blocks, block)
        model.graph.initializer.extend([numpy_helper.from_array(q8, f"{node.name}.nbits_w"), numpy_helper.from_array(
            np.repeat(scale[:, None], blocks, axis=1).reshape(-1), f"{node.name}.nbits_s")])
        x = q.input[0]
        for r in reversed(chain):  # the rotation's reshapes, on the float tensor
            nodes.append(helper.make_node("Reshape", [x, r.input[1]], [f"{r.output[0]}.f"], name=f"{r.name}.f"))
            x = f"{r.output[0]}.f"
        nodes.append(helper.make_node("MatMulNBits", [x, f"{node.name}.nbits_w", f"{node.name}.nbits_s"],
                                      list(node.output), name=f"{node.name}.nbits", domain="com.microsoft", K=k, N=n,
                                      bits=8, block_size=block, accuracy_level=4))
    del model.graph.node[:]
    model.graph.node.extend(n for n in nodes if n.name not in replaced)
    return model


def experiments(path: Path, spec, ctx: int, threads: int) -> dict:
    import onnx

    out = {}
    cache = ROOT / "engines" / ".cache"
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # beside the engine: its data file is hard-linked
        variants = {"full": str(path / "model.opt.onnx")}
        full = onnx.load(str(path / "model.opt.onnx"))  # (onnx refuses a data file with two links: before the link)
        onnx.save(with_matmul_nbits(full), f"{tmp}/nbits.onnx", save_as_external_data=True, location="nbits.onnx.data")
        variants["matmul_nbits"] = f"{tmp}/nbits.onnx"
        light = onnx.load(str(path / "model.opt.onnx"), load_external_data=False)
        onnx.save(without_attention(light), f"{tmp}/no_attention.onnx")  # weights: the engine's data file
        os.link(path / "model.opt.onnx.data", f"{tmp}/model.opt.onnx.data")  # ONNX Runtime refuses symlinks out
        variants["without_attention"] = f"{tmp}/no_attention.onnx"
        for batch in (1, 8):
            feeds = decode_feeds(spec, batch, ctx)
            for name, model in variants.items():
                out[f"{name}_b{batch}_ms"] = round(run_ms(session(model, threads), feeds), 3)
    return out


def main() -> None:
    from autoglm_trt.fileutil import cpu_model
    from autoglm_trt.model.spec import spec_from_dict

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="engines/smollm2-int8,engines/smollm2-fp32")
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experiments", action="store_true", help="also time the INT8 graph's variants (see above)")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}; {args.threads} ONNX Runtime threads; decode step at {args.ctx} tokens of context")
    for name in args.engines.split(","):
        path = ROOT / name
        manifest = json.loads((path / "manifest.json").read_text())
        spec = spec_from_dict(manifest["spec"])
        calib = path / "calib.json"
        linears = [f"layers.{i}.{k}" for i in range(spec.num_layers) for k in ("qkv", "o_proj", "gate_up", "down")]
        linears.append("lm_head")
        if calib.is_file():
            record = json.loads(calib.read_text())
            int8 = set(linears) - {f["linear"] for f in record["float_linears"]}
        else:
            int8 = set()
        sess = session(str(path / "model.opt.onnx"), args.threads)
        nodes = json.loads((path / "fusion_report.json").read_text())["nodes_after"]
        row: dict = {"engine": name, "int8_linears": len(int8), "nodes": nodes}
        for batch in (1, 8):
            feeds = decode_feeds(spec, batch, args.ctx)
            graph = run_ms(sess, feeds)
            lin = run_ms(session(linears_graph(spec, int8, batch), args.threads),
                         {"x": np.random.default_rng(2).standard_normal((batch, spec.hidden_size)).astype(np.float32)})
            row[f"b{batch}"] = {"graph_ms": round(graph, 3), "linears_only_ms": round(lin, 3),
                                "rest_ms": round(graph - lin, 3)}
        row["profile_b1"] = op_profile(path / "model.opt.onnx", decode_feeds(spec, 1, args.ctx), args.threads)
        row["runtime_b1"] = runtime_split(path, args.threads)
        print(f"{name}: {row['nodes']} nodes, {len(int8)} INT8 linears")
        for batch in (1, 8):
            b = row[f"b{batch}"]
            print(f"  batch {batch}: graph {b['graph_ms']:.2f} ms = linears alone {b['linears_only_ms']:.2f} ms "
                  f"+ the rest {b['rest_ms']:.2f} ms")
        top = ", ".join(f"{op} {v['share']:.0%} ({v['nodes']})" for op, v in list(row["profile_b1"].items())[:8])
        print(f"  ONNX Runtime profile, batch 1 (share of kernel time, nodes): {top}")
        rt = row["runtime_b1"]
        print(f"  runtime, batch 1: {rt['token_ms']:.2f} ms a token, {rt['inside_ort_ms']:.2f} in ONNX Runtime, "
              f"{rt['outside_ort_ms']:.2f} outside")
        if args.experiments and int8:
            row["experiments"] = ex = experiments(path, spec, args.ctx, args.threads)
            for batch in (1, 8):
                print(f"  batch {batch}: full graph {ex[f'full_b{batch}_ms']:.2f} ms, without the attention core "
                      f"{ex[f'without_attention_b{batch}_ms']:.2f} ms, with MatMulNBits "
                      f"{ex[f'matmul_nbits_b{batch}_ms']:.2f} ms")
        print(json.dumps(row))


if __name__ == "__main__":
    main()
