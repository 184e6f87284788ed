#!/usr/bin/env python3
"""Long prompts beside ONNX Runtime GenAI: the time to the first token of a fresh 1,000- and
4,000-token prompt, GenAI's own fp32 and int8 models of SmolLM2 against this toolkit's fp32 and
int8 engines, one run.

    python -m benchmarks.bench_genai_prefill [--rounds 3] [--tokens 1000,4000]

GenAI and its models as ``bench_genai`` installs and builds them (int8: 8-bit ``MatMulNBits``
weights in blocks of 32, its CPU default, and ``GroupQueryAttention``); this toolkit's engines
as ``bench_prefill`` builds them (room for 4,000 tokens). The same random prompt goes to all
four; each side makes one greedy token, 2 ONNX Runtime threads. Rounds interleave every
measurement (a new prompt each round, so no prefix is cached); figures are medians over rounds,
each ratio (GenAI's time over ours) the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator

import numpy as np

from .common import machine


def genai_ttft(model, prompt: np.ndarray) -> float:
    """Seconds from the prompt to GenAI's first token."""
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + 1, do_sample=False, batch_size=1)
    t = time.perf_counter()
    generator = og.Generator(model, params)
    generator.append_tokens(prompt[None].astype(np.int32))
    generator.generate_next_token()
    return time.perf_counter() - t


def engine_ttft(engine, prompt: np.ndarray) -> float:
    from autoglm_trt.runtime import SamplingParams

    t = time.perf_counter()
    engine.generate([prompt.tolist()], SamplingParams(max_new_tokens=1))
    return time.perf_counter() - t


def ttft_rows(peer: str, peer_ttft: Callable[[str, np.ndarray], float], ours: dict, lengths: list[int],
              rounds: int, rng: np.random.Generator, length_key: str = "tokens") -> Iterator[dict]:
    """Milliseconds to the first token of a peer and of ``ours`` (precision -> Engine): one warm-up
    of each, then per length ``rounds`` rounds of one new random prompt to all; a row per length
    with the medians and each precision's median ratio (the peer's time over ours).
    ``peer_ttft(precision, prompt)``: the peer's seconds."""
    warm = rng.integers(100, 40000, 64)
    for p in ours:
        peer_ttft(p, warm)
        engine_ttft(ours[p], warm)
    for n in lengths:
        measured = []
        for _ in range(rounds):
            prompt = rng.integers(100, 40000, n)
            measured.append({f"{side}_{p}": 1000 * (peer_ttft(p, prompt) if side == peer else engine_ttft(ours[p], prompt))
                             for p in ours for side in (peer, "ours")})
        row: dict = {length_key: n, "ms": {k: round(float(np.median([r[k] for r in measured])), 1) for k in measured[0]}}
        for p in ours:
            row[f"{peer}_over_ours_{p}"] = round(float(np.median([r[f"{peer}_{p}"] / r[f"ours_{p}"] for r in measured])), 2)
        yield row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", default="1000,4000")
    args = ap.parse_args()
    from .bench_genai import genai_model, install
    from .bench_prefill import ensure

    install()
    import onnxruntime_genai as og

    from autoglm_trt.runtime import Engine

    ours = {p: Engine.load(ensure(p), threads=2) for p in ("fp32", "int8")}
    theirs = {p: og.Model(str(genai_model(p, 2))) for p in ("fp32", "int8")}
    print(machine(), flush=True)
    for row in ttft_rows("genai", lambda p, prompt: genai_ttft(theirs[p], prompt), ours,
                         [int(n) for n in args.tokens.split(",")], args.rounds, np.random.default_rng(0)):
        print(json.dumps(row), flush=True)
    for e in ours.values():
        e.close()


if __name__ == "__main__":
    main()
