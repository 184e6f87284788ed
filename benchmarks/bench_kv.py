#!/usr/bin/env python3
"""INT8 against float KV cache on SmolLM2, in one run: accuracy through the pool and decode speed.

    python -m benchmarks.bench_kv [--checkpoint models/smollm2-135m] [--contexts 256,2000]

Builds (or reuses) four engines in engines/: fp32 and int8 weights, each with a float and an
int8 KV cache, all with the same ``kv_memory_bytes``. Accuracy: ``eval`` on the held-out text
fed 16 tokens per step through the pool (each step reads its past back from the pool), against
the float32 checkpoint; the int8-KV engine's perplexity over its float-KV twin's. Speed:
batch-1 decode tokens/s after prompts of each context length, interleaved rounds, medians.
Prints the blocks each pool holds and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .common import ROOT


def engine(checkpoint: Path, precision: str, kv: str) -> Path:
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    out = ROOT / "engines" / f"smollm2-{precision}-kv-{kv}"
    if not (out / "manifest.json").is_file():
        cfg = BuildConfig(kv_cache_dtype=kv, max_seq_len=2304)
        build_engine(BuildRequest(checkpoint, out, precision=precision, backend="onnxruntime", config=cfg,
                                  force=True), log=lambda m: print(m, file=sys.stderr))
    return out


def decode_rate(eng, prompt: list[int], new_tokens: int) -> float:
    from autoglm_trt.runtime import SamplingParams

    [r] = eng.generate([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])


def main() -> None:
    from autoglm_trt.evaluate import evaluate
    from autoglm_trt.fileutil import cpu_model
    from autoglm_trt.runtime import Engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--contexts", default="256,2000")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    text = ROOT / "calibration" / "eval" / "heldout.txt"
    engines = {(p, kv): engine(args.checkpoint, p, kv) for p in ("fp32", "int8") for kv in ("float32", "int8")}
    for path in engines.values():
        m = json.loads((path / "manifest.json").read_text())["kv_cache"]
        print(json.dumps({"engine": path.name, "kv_blocks": m["num_blocks"], "kv_bytes": m["bytes"]}), flush=True)
    if not args.skip_accuracy:
        for p in ("fp32", "int8"):
            res = {kv: evaluate(engines[(p, kv)], text, args.checkpoint, step_tokens=16) for kv in ("float32", "int8")}
            print(json.dumps({"weights": p, "step_tokens": 16,
                              "float_kv": {k: round(res["float32"][k], 4) for k in ("ppl", "ppl_ratio", "top1_agreement")},
                              "int8_kv": {k: round(res["int8"][k], 4) for k in ("ppl", "ppl_ratio", "top1_agreement")},
                              "int8_kv_ppl_over_float_kv": round(res["int8"]["ppl"] / res["float32"]["ppl"], 4)}),
                  flush=True)
    from autoglm_trt.model.tokenizer import TextTokenizer

    ids = TextTokenizer(engines[("int8", "int8")]).encode(text.read_text())
    loaded = {kv: Engine.load(engines[("int8", kv)], prefix_caching=False) for kv in ("float32", "int8")}
    try:
        for ctx in (int(c) for c in args.contexts.split(",")):
            rates: dict[str, list[float]] = {"float32": [], "int8": []}
            for r in range(args.rounds):
                for kv, eng in loaded.items():
                    rates[kv].append(decode_rate(eng, ids[r * 7: r * 7 + ctx], args.new_tokens))
            f, q = statistics.median(rates["float32"]), statistics.median(rates["int8"])
            print(json.dumps({"weights": "int8", "context": ctx, "float_kv_tok_s": round(f, 1),
                              "int8_kv_tok_s": round(q, 1), "int8_over_float": round(q / f, 3)}), flush=True)
    finally:
        for eng in loaded.values():
            eng.close()
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
