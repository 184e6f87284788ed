#!/usr/bin/env python3
"""Runtime figures for the README, measured in one run on this machine.

    python -m benchmarks.bench_runtime [--gen 64] [--json OUT]

1. batch-1 decode tokens/s: transformers `generate` (float32) vs the fp32 and int8 engines
   (decode rate = tokens after the first / time after the first);
2. aggregate tokens/s with 16 concurrent requests vs 1 (fp32 engine);
3. decode-step time with a 4096-block KV pool vs a 64-block pool at the same context;
4. batch-1 decode against the memory-bandwidth bound: weight bytes read per token over the
   copy bandwidth of this machine (numpy copies on all cores, bytes read + written), for the
   fp32 engine (its weight file) and the int8 engine (linear weights as calib.json counts them),
   the bandwidth measured in every round and each share the median of the rounds' shares;
   and the fp32 16-concurrent aggregate against the compute bound: the multiply-adds its
   linears do (the prompt tokens the prefix cache does not supply and the generated tokens
   through every linear, the generated ones through the LM head too) over the time, as a share
   of numpy's float32 GEMM rate on this machine (a 2048-square product on all cores, measured
   every round);
5. time to first token of a 1,000-token prompt (random token ids, a new prompt every time so no
   prefix is cached): transformers' forward pass vs the fp32 and int8 engines' prefill;
6. the native operators (attention, INT8 linears, rope) against the graph's own nodes
   (``AUTOGLM_TRT_NATIVE=0``), same engines: int8 batch-1 decode, fp32 16-concurrent
   aggregate and int8 time to first token (the prefill's attention, linears, rope and norms).
   ``attention`` says which form the engines ran;
7. 16 concurrent requests on the int8 engine too.
Engines are built first if missing (engines/smollm2-fp32, engines/smollm2-int8).

These 2-core machines are shared and their speed drifts by 10-20% within minutes, so every
figure is measured once per round, the rounds interleave all of them (``--rounds``, default
5), and each ratio is the median of its per-round ratios (the two sides measured seconds
apart); the absolute figures are medians over the rounds too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from .common import ROOT

SMOL = ROOT / "models" / "smollm2-135m"
TTFT_PROMPT = 1000
PROMPT_TOKENS = 48  # each prompt of the concurrent runs
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


# engines built with options beyond their precision: name -> (precision, build options)
BUILT_WITH = {"int4-awq-gate": ("int4-awq", ("--int4-gate", "1.04"))}


def ensure_engine(name: str) -> Path:
    """SmolLM2's engine of a precision (or of a name in ``BUILT_WITH``) in engines/smollm2-NAME, built if missing."""
    out = ROOT / "engines" / f"smollm2-{name}"
    precision, options = BUILT_WITH.get(name, (name, ()))
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "autoglm_trt", "build", str(SMOL), "--precision", precision, *options,
                        "--backend", "onnxruntime", "-o", str(out)], check=True)
    return out


def hf_decoder(gen: int):
    """A function that measures transformers' batch-1 decode rate once, and the model it loaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SMOL))
    model = AutoModelForCausalLM.from_pretrained(str(SMOL), dtype=torch.float32)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                return_dict=True)["input_ids"]])
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    timed(4)
    return lambda: (gen - 1) / (timed(gen) - timed(1)), model


def hf_ttft(model, rng) -> float:
    """Milliseconds to the first greedy token of a fresh 1,000-token prompt (one forward pass)."""
    import torch

    ids = torch.tensor([rng.integers(100, 40000, TTFT_PROMPT).tolist()])
    t = time.perf_counter()
    with torch.no_grad():
        int(model(ids).logits[0, -1].argmax())
    return (time.perf_counter() - t) * 1e3


def engine_ttft(engine, rng) -> float:
    from autoglm_trt.runtime import SamplingParams

    t = time.perf_counter()
    engine.generate([rng.integers(100, 40000, TTFT_PROMPT).tolist()], SamplingParams(max_new_tokens=1))
    return (time.perf_counter() - t) * 1e3


def engine_decode_rate(engine, gen: int, prompt=None) -> float:
    from autoglm_trt.runtime import SamplingParams

    prompt = prompt or [{"role": "user", "content": PROMPT}]
    r = engine.generate([prompt], SamplingParams(max_new_tokens=gen, ignore_eos=True))[0]
    return (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])


def aggregate(engine, n: int, gen: int, hits: list[int] | None = None) -> float:
    """Tokens/s of n concurrent requests (the same prompts every time); ``hits`` gets the prompt
    tokens the prefix cache supplied (not computed)."""
    from autoglm_trt.runtime import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, PROMPT_TOKENS).tolist() for _ in range(n)]
    before = engine.stats()["prefix_hit_tokens"]
    t = time.perf_counter()
    res = engine.generate(prompts, SamplingParams(max_new_tokens=gen, ignore_eos=True))
    rate = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)
    if hits is not None:
        hits.append(engine.stats()["prefix_hit_tokens"] - before)
    return rate


def copy_bandwidth(threads: int = 2) -> float:
    """Bytes read + written per second by ``threads`` concurrent numpy copies of 256 MiB each
    (the engine's GEMMs read weights with all cores, so one thread would understate the bound)."""
    import threading

    a = [np.ones(64 * 2**20, np.float32) for _ in range(threads)]
    b = [np.empty_like(x) for x in a]
    best = float("inf")
    for _ in range(5):
        ts = [threading.Thread(target=np.copyto, args=(b[i], a[i])) for i in range(threads)]
        t = time.perf_counter()
        for th in ts:
            th.start()
        for th in ts:
            th.join()
        best = min(best, time.perf_counter() - t)
    return 2 * sum(x.nbytes for x in a) / best


def gemm_rate() -> float:
    """Floating-point operations per second of numpy's float32 GEMM (its BLAS, on all cores): the
    best of 5 products of two 2048 x 2048 matrices."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t)
    return 2 * 2048**3 / best


def aggregate_flops(spec, weight_bytes: int, n: int, prompt: int, gen: int, cached: int) -> float:
    """Floating-point operations of ``aggregate``'s linears: n prompts of ``prompt`` tokens, of
    which ``cached`` in all came from the prefix cache, and ``gen`` tokens each; every computed
    prompt token and every generated one but the last goes through the body's linears, every
    generated one through the LM head (the fp32 weight file holds the body and the tied
    embedding, i.e. the head, 4 bytes a parameter)."""
    head = spec.vocab_size * spec.hidden_size
    body = weight_bytes // 4 - head
    return 2.0 * ((n * (prompt + gen - 1) - cached) * body + n * gen * head)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from autoglm_trt.runtime import Engine

    fp32, int8 = ensure_engine("fp32"), ensure_engine("int8")
    long_prompt = np.random.default_rng(1).integers(100, 40000, 480).tolist()
    engines = {"fp32": Engine.load(fp32), "int8": Engine.load(int8),
               "pool_64": Engine.load(fp32, num_blocks=64), "pool_4096": Engine.load(fp32, num_blocks=4096)}
    # the same engines with the graph's own attention nodes instead of the native operator
    os.environ["AUTOGLM_TRT_NATIVE"] = "0"
    engines.update({"fp32_graph": Engine.load(fp32), "int8_graph": Engine.load(int8)})
    del os.environ["AUTOGLM_TRT_NATIVE"]
    hf, hf_model = hf_decoder(args.gen)
    fp32_16x_hits: list[int] = []  # prompt tokens the prefix cache supplied, a round each
    rng = np.random.default_rng(2)
    for e in engines.values():  # warm up
        engine_decode_rate(e, 4)
    measures = {
        "hf_fp32_tok_s": hf,
        "fp32_tok_s": lambda: engine_decode_rate(engines["fp32"], args.gen),
        "int8_tok_s": lambda: engine_decode_rate(engines["int8"], args.gen),
        "fp32_batch1_aggregate_tok_s": lambda: aggregate(engines["fp32"], 1, args.gen),
        "fp32_16x_aggregate_tok_s": lambda: aggregate(engines["fp32"], 16, args.gen, fp32_16x_hits),
        "int8_16x_aggregate_tok_s": lambda: aggregate(engines["int8"], 16, args.gen),
        "int8_graph_attention_tok_s": lambda: engine_decode_rate(engines["int8_graph"], args.gen),
        "fp32_16x_graph_attention_tok_s": lambda: aggregate(engines["fp32_graph"], 16, args.gen),
        "pool_64_tok_s": lambda: engine_decode_rate(engines["pool_64"], 32, long_prompt),
        "pool_4096_tok_s": lambda: engine_decode_rate(engines["pool_4096"], 32, long_prompt),
        "hf_ttft_1000_ms": lambda: hf_ttft(hf_model, rng),
        "fp32_ttft_1000_ms": lambda: engine_ttft(engines["fp32"], rng),
        "int8_ttft_1000_ms": lambda: engine_ttft(engines["int8"], rng),
        "int8_graph_ttft_1000_ms": lambda: engine_ttft(engines["int8_graph"], rng),
        # the bound moves with the machine's load as much as the rates do: measured every round
        "copy_bandwidth_GBps": lambda: copy_bandwidth() / 1e9,
        "gemm_GFLOPs": lambda: gemm_rate() / 1e9,
    }
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        rounds.append({k: f() for k, f in measures.items()})
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1].items()), flush=True)
    for e in engines.values():
        e.close()

    def median(fn) -> float:
        return float(np.median([fn(m) for m in rounds]))

    out: dict = {k: median(lambda m, k=k: m[k]) for k in measures}
    out["step_ms_pool_64"], out["step_ms_pool_4096"] = 1000 / out.pop("pool_64_tok_s"), 1000 / out.pop("pool_4096_tok_s")
    out.update({
        "fp32_vs_hf": median(lambda m: m["fp32_tok_s"] / m["hf_fp32_tok_s"]),
        "int8_vs_hf": median(lambda m: m["int8_tok_s"] / m["hf_fp32_tok_s"]),
        "concurrency16_vs_1": median(lambda m: m["fp32_16x_aggregate_tok_s"] / m["fp32_batch1_aggregate_tok_s"]),
        "int8_native_vs_graph_attention": median(lambda m: m["int8_tok_s"] / m["int8_graph_attention_tok_s"]),
        "fp32_16x_native_vs_graph_attention": median(
            lambda m: m["fp32_16x_aggregate_tok_s"] / m["fp32_16x_graph_attention_tok_s"]),
        "pool_4096_vs_64": median(lambda m: m["pool_64_tok_s"] / m["pool_4096_tok_s"]),  # step-time ratio
        "fp32_ttft_vs_hf": median(lambda m: m["fp32_ttft_1000_ms"] / m["hf_ttft_1000_ms"]),
        "int8_ttft_vs_hf": median(lambda m: m["int8_ttft_1000_ms"] / m["hf_ttft_1000_ms"]),
        "int8_ttft_native_vs_graph": median(lambda m: m["int8_ttft_1000_ms"] / m["int8_graph_ttft_1000_ms"]),
    })
    weight_bytes = (fp32 / "model.opt.onnx.data").stat().st_size
    # INT8: the linears' bytes per token as calibration recorded them (INT8 1 byte, float 4)
    int8_bytes = json.loads((int8 / "calib.json").read_text())["weight_bytes_per_token"]["this_plan_mb"] * 1e6
    out.update({
        "fp32_weight_bytes": weight_bytes,
        "bandwidth_bound_tok_s": out["copy_bandwidth_GBps"] * 1e9 / weight_bytes,
        "fp32_fraction_of_bound": median(lambda m: m["fp32_tok_s"] * weight_bytes / (m["copy_bandwidth_GBps"] * 1e9)),
        "int8_weight_bytes": int(int8_bytes),
        "int8_fraction_of_bound": median(lambda m: m["int8_tok_s"] * int8_bytes / (m["copy_bandwidth_GBps"] * 1e9)),
    })
    spec = engines["fp32"].spec
    flops = [aggregate_flops(spec, weight_bytes, 16, PROMPT_TOKENS, args.gen, c) for c in fp32_16x_hits]
    out["fp32_16x_GFLOP"] = float(np.median(flops)) / 1e9  # from the second round on, prompts come from the cache
    out["fp32_16x_fraction_of_gemm"] = float(np.median([  # the aggregate's seconds: 16 * gen tokens over its rate
        f / (16 * args.gen / m["fp32_16x_aggregate_tok_s"]) / (m["gemm_GFLOPs"] * 1e9) for f, m in zip(flops, rounds)]))
    from autoglm_trt.fileutil import cpu_model

    out["cpu"] = cpu_model()
    out["attention"] = engines["int8"].backend.attention
    for k, v in out.items():
        print(f"{k:32s} {v:12.3f}" if isinstance(v, float) else f"{k:32s} {v:>12}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
