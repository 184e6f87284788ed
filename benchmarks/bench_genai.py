#!/usr/bin/env python3
"""Side by side with ONNX Runtime GenAI: batch-1 and batch-8 greedy decode of SmolLM2, one run.

    python -m benchmarks.bench_genai [--rounds 3] [--gen 128] [--prompt-len 32] [--json OUT]

ONNX Runtime GenAI 0.18 (PyPI ``onnxruntime-genai``, with ``onnx_ir`` for its model builder)
is installed with ``--no-deps`` into ``.genai/`` (it runs on this venv's onnxruntime), and its
model builder makes its own fp32, int8 and int4 models of ``models/smollm2-135m`` (int8 and int4:
8- and 4-bit ``MatMulNBits`` weights, blocks of 32, its CPU defaults) in ``engines/.cache/genai-*``,
set beside this toolkit's fp32, int8 and int4-awq engines.
The same prompts (random token ids, fixed seed, ``--prompt-len`` each) go to both; each side
generates ``--gen`` tokens greedily with EOS ignored, 2 ONNX Runtime threads. Decode rate =
tokens after the first / time after the first token, summed over the batch. Rounds interleave
every measurement; the figures are medians over rounds, each ratio the median of per-round ratios.
Needs the engines of ``benchmarks/bench_runtime.py`` (built if missing).
"""

from __future__ import annotations

import argparse
import json
import site
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .common import ROOT

GENAI_DIR = ROOT / ".genai"
PACKAGES = ["onnxruntime-genai==0.18.0", "onnx_ir==1.1.0"]
SMOL = ROOT / "models" / "smollm2-135m"
PAIRS = {"fp32": "fp32", "int8": "int8", "int4-awq": "int4"}  # our precision: GenAI's


def install() -> None:
    if not (GENAI_DIR / ".installed").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(GENAI_DIR),
                        *PACKAGES], check=True)
        (GENAI_DIR / ".installed").write_text(" ".join(PACKAGES) + "\n")
    site.addsitedir(str(GENAI_DIR))  # the --target install, importable from here on


def genai_model(precision: str, threads: int) -> Path:
    out = ROOT / "engines" / ".cache" / f"genai-{precision}"
    if not (out / "genai_config.json").is_file():
        print(f"building the ONNX Runtime GenAI {precision} model (its own builder) in {out}", flush=True)
        built = subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(SMOL), "-o",
                                str(out), "-p", precision, "-e", "cpu", "-c", str(out.parent / "genai-hf-cache")],
                               env={"PYTHONPATH": str(GENAI_DIR), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True)
        if built.returncode != 0:
            raise SystemExit(f"ONNX Runtime GenAI's model builder failed:\n{built.stderr[-4000:]}")
    config = json.loads((out / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    (out / "genai_config.json").write_text(json.dumps(config, indent=1))
    return out


def genai_rate(model, prompts: np.ndarray, gen: int) -> float:
    import onnxruntime_genai as og

    batch, plen = prompts.shape
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=plen + gen, min_length=plen + gen, do_sample=False, batch_size=batch)
    generator = og.Generator(model, params)
    generator.append_tokens(prompts.astype(np.int32))
    times = []
    while not generator.is_done():
        generator.generate_next_token()
        times.append(time.perf_counter())
    return batch * (len(times) - 1) / (times[-1] - times[0])


def engine_rate(engine, prompts: np.ndarray, gen: int) -> float:
    from autoglm_trt.runtime import SamplingParams

    res = engine.generate([p.tolist() for p in prompts], SamplingParams(max_new_tokens=gen, ignore_eos=True))
    first = min(r.token_times[0] for r in res)
    last = max(r.token_times[-1] for r in res)
    return sum(len(r.token_times) - 1 for r in res) / (last - first)


def decode_rounds(peer: str, peer_rate: Callable[[str, np.ndarray], float], ours: dict, prompt_len: int,
                  gen: int, rounds: int, log: bool = False) -> list[dict[str, float]]:
    """Decode rates of a peer and of ``ours`` (precision -> Engine) at batch 1 and 8, on the same
    random prompts: one warm-up of each, then ``rounds`` rounds interleaving them all, keyed
    ``{peer|ours}_{precision}_b{batch}``. ``peer_rate(precision, prompts)``: the peer's rate."""
    rng = np.random.default_rng(0)
    prompts = {b: rng.integers(100, 40000, (b, prompt_len)) for b in (1, 8)}
    measures: dict[str, Callable[[], float]] = {}
    for p in ours:
        for b in (1, 8):
            measures[f"{peer}_{p}_b{b}"] = lambda p=p, b=b: peer_rate(p, prompts[b])
            measures[f"ours_{p}_b{b}"] = lambda p=p, b=b: engine_rate(ours[p], prompts[b], gen)
    for f in measures.values():  # warm up
        f()
    out = []
    for r in range(rounds):
        out.append({k: f() for k, f in measures.items()})
        if log:
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[-1].items()), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    install()
    import onnxruntime_genai as og

    from autoglm_trt.fileutil import cpu_model
    from autoglm_trt.runtime import Engine

    from .bench_runtime import ensure_engine

    ours = {p: Engine.load(ensure_engine(p), threads=args.threads) for p in PAIRS}
    theirs = {p: og.Model(str(genai_model(g, args.threads))) for p, g in PAIRS.items()}
    rounds = decode_rounds("genai", lambda p, prompts: genai_rate(theirs[p], prompts, args.gen), ours,
                           args.prompt_len, args.gen, args.rounds, log=True)
    for e in ours.values():
        e.close()
    out: dict = {k: float(np.median([m[k] for m in rounds])) for k in rounds[0]}
    for p in PAIRS:
        for b in (1, 8):
            out[f"ours_vs_genai_{p}_b{b}"] = float(np.median([m[f"ours_{p}_b{b}"] / m[f"genai_{p}_b{b}"] for m in rounds]))
    out["cpu"] = cpu_model()
    print(f"CPU: {out['cpu']}; decode tokens/s, {args.prompt_len}-token prompts, {args.gen} greedy tokens, "
          f"{args.threads} threads, median of {args.rounds} rounds")
    print("| | batch 1 | batch 8 |\n|---|---|---|")
    for p, g in PAIRS.items():
        print(f"| ONNX Runtime GenAI {g} | {out[f'genai_{p}_b1']:.1f} | {out[f'genai_{p}_b8']:.1f} |")
        print(f"| autoglm-trt {p} | {out[f'ours_{p}_b1']:.1f} ({out[f'ours_vs_genai_{p}_b1']:.2f}×) | "
              f"{out[f'ours_{p}_b8']:.1f} ({out[f'ours_vs_genai_{p}_b8']:.2f}×) |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
