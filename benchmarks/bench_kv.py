#!/usr/bin/env python3
"""INT8 against float KV cache on SmolLM2, in one run: accuracy through the pool and decode speed.

    python -m benchmarks.bench_kv [--checkpoint models/smollm2-135m] [--contexts 256,2000]

Builds (or reuses) six engines in engines/: fp32 and int8 weights, each with a float KV cache, an
INT8 one with static per-head scales (``int8``) and one with a scale per token and KV head
(``int8-token``), all with the same ``kv_memory_bytes``. Accuracy: ``eval`` on each kind of
held-out text fed 16 tokens per step through the pool (each step reads its past back from the
pool), against the float32 checkpoint; each INT8-KV engine's perplexity over its float-KV twin's.
Speed: batch-1 decode tokens/s of the int8-weight engines after prompts of each context length,
interleaved rounds, medians. Prints the blocks each pool holds and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from .accuracy_kinds import EVAL as KINDS
from .common import ROOT

CACHES = {"float32": {"kv_cache_dtype": "float32"}, "int8": {"kv_cache_dtype": "int8"},
          "int8-token": {"kv_cache_dtype": "int8", "kv_scales": "token"}}


def engine(checkpoint: Path, precision: str, kv: str) -> Path:
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    out = ROOT / "engines" / f"smollm2-{precision}-kv-{kv}"
    if not (out / "manifest.json").is_file():
        cfg = BuildConfig(max_seq_len=2304, **CACHES[kv])
        build_engine(BuildRequest(checkpoint, out, precision=precision, backend="onnxruntime", config=cfg,
                                  force=True), log=lambda m: print(m, file=sys.stderr))
    return out


def decode_rate(eng, prompt: list[int], new_tokens: int) -> float:
    from autoglm_trt.runtime import SamplingParams

    [r] = eng.generate([prompt], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])


def accuracy(engines: dict, checkpoint: Path, max_chunks: int | None) -> None:
    """One line per weights and kind: each cache's ppl, ppl ratio and top-1 against the checkpoint."""
    from autoglm_trt.evaluate import evaluate

    for p in ("fp32", "int8"):
        for kind, name in KINDS.items():
            text = ROOT / "calibration" / "eval" / name
            res = {kv: evaluate(engines[(p, kv)], text, checkpoint, step_tokens=16, max_chunks=max_chunks)
                   for kv in CACHES}
            line: dict = {"weights": p, "kind": kind, "step_tokens": 16, "tokens": res["float32"]["tokens"]}
            for kv, r in res.items():
                line[kv] = {k: round(r[k], 4) for k in ("ppl", "ppl_ratio", "top1_agreement")}
                if kv != "float32":
                    line[kv]["ppl_over_float_kv"] = round(r["ppl"] / res["float32"]["ppl"], 4)
            print(json.dumps(line), flush=True)


def speed(engines: dict, contexts: str, rounds: int, new_tokens: int) -> None:
    from autoglm_trt.model.tokenizer import TextTokenizer
    from autoglm_trt.runtime import Engine

    text = ROOT / "calibration" / "eval" / "heldout.txt"
    ids = TextTokenizer(engines[("int8", "int8")]).encode(text.read_text())
    loaded = {kv: Engine.load(engines[("int8", kv)], prefix_caching=False) for kv in CACHES}
    try:
        for ctx in (int(c) for c in contexts.split(",")):
            rates: dict[str, list[float]] = {kv: [] for kv in CACHES}
            for r in range(rounds):
                for kv, eng in loaded.items():
                    rates[kv].append(decode_rate(eng, ids[r * 7: r * 7 + ctx], new_tokens))
            med = {kv: statistics.median(v) for kv, v in rates.items()}
            line = {"weights": "int8", "context": ctx, **{f"{kv}_kv_tok_s": round(v, 1) for kv, v in med.items()}}
            line.update((f"{kv}_over_float", round(med[kv] / med["float32"], 3)) for kv in CACHES if kv != "float32")
            print(json.dumps(line), flush=True)
    finally:
        for eng in loaded.values():
            eng.close()


def main() -> None:
    from autoglm_trt.fileutil import cpu_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "models" / "smollm2-135m")
    ap.add_argument("--contexts", default="256,2000")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-chunks", type=int, default=None, help="Windows of 256 tokens per kind [default: all].")
    ap.add_argument("--skip-accuracy", action="store_true")
    args = ap.parse_args()
    engines = {(p, kv): engine(args.checkpoint, p, kv) for p in ("fp32", "int8") for kv in CACHES}
    for path in engines.values():
        m = json.loads((path / "manifest.json").read_text())["kv_cache"]
        print(json.dumps({"engine": path.name, "kv_blocks": m["num_blocks"], "kv_bytes": m["bytes"]}), flush=True)
    if not args.skip_accuracy:
        accuracy(engines, args.checkpoint, args.max_chunks)
    speed(engines, args.contexts, args.rounds, args.new_tokens)
    print(f"CPU: {cpu_model()}")


if __name__ == "__main__":
    main()
