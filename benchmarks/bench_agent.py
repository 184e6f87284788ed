#!/usr/bin/env python3
"""The agent workload, with and without prefix caching, in one run on one machine.

    python -m benchmarks.bench_agent [--engine engines/smollm2-int8] [--agents 4] [--turns 8]
    python -m benchmarks.bench_agent --images [--turns 4]   (GLM-4.1V screenshots: bench_agent_images)

Each agent runs a multi-turn trace the way a phone agent does: a system prompt of about
1,000 tokens (rules and action space), then turns that each add an observation of about 150
tokens and get an answer of about 40 (greedy, EOS ignored); every turn resends the whole
history (about 2,500 tokens by the last turn, so the engine is built with max_seq_len 4096).
The agents run at once, each in its own thread. Prints time to first token per turn
(median over agents) and the trace's wall time for both settings, their ratios, and checks
that the answers are identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from .common import ROOT


def texts(n_tokens: int, tok, offset: int) -> list[list[int]]:
    """Token windows cut from the calibration text (real prose and code), one per use."""
    ids: list[int] = []
    for f in sorted((ROOT / "autoglm_trt" / "calib" / "data").glob("*.txt")):
        ids += tok.encode(f.read_text())
    return [ids[offset + i * n_tokens: offset + (i + 1) * n_tokens] for i in range(len(ids) // n_tokens - 1)]


def run(engine_dir: Path, caching: bool, system: list[int], observations: list[list[list[int]]],
        answer_len: int) -> dict:
    from autoglm_trt.runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=answer_len, ignore_eos=True)
    ttft: list[list[float]] = [[] for _ in observations[0]]
    answers: list[list[list[int]]] = [[] for _ in observations]
    with Engine.load(engine_dir, prefix_caching=caching) as engine:
        engine.generate([system[:16]], SamplingParams(max_new_tokens=2))  # warm-up

        def agent(a: int) -> None:
            history = list(system)
            for t, obs in enumerate(observations[a]):
                history += obs
                [res] = engine.generate([history], params)
                ttft[t].append(res.ttft)
                answers[a].append(res.token_ids)
                history += res.token_ids

        t0 = time.perf_counter()
        threads = [threading.Thread(target=agent, args=(a,)) for a in range(len(observations))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t0
        stats = engine.stats()
    return {"wall_s": wall, "ttft_ms": [1000 * statistics.median(x) for x in ttft], "answers": answers,
            "hit_tokens": stats["prefix_hit_tokens"], "queried_tokens": stats["prefix_queried_tokens"]}


def main() -> None:
    if "--images" in sys.argv:  # the GLM-4.1V phone-agent trace: its own module
        from .bench_agent_images import main as images_main

        return images_main()
    from autoglm_trt.fileutil import cpu_model
    from autoglm_trt.model.tokenizer import TextTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8-agent",
                    help="built from models/smollm2-135m (INT8, max_seq_len 4096) if it does not exist")
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--observation-tokens", type=int, default=150)
    ap.add_argument("--answer-tokens", type=int, default=40)
    args = ap.parse_args()
    if not (args.engine / "manifest.json").is_file():
        from autoglm_trt.builder.config import BuildConfig
        from autoglm_trt.builder.pipeline import BuildRequest, build_engine

        build_engine(BuildRequest(ROOT / "models" / "smollm2-135m", args.engine, precision="int8",
                                  backend="onnxruntime", config=BuildConfig(max_seq_len=4096)),
                     log=lambda m: print(m, file=sys.stderr))
    tok = TextTokenizer(args.engine)
    system = texts(args.system_tokens, tok, 0)[0]
    pool = texts(args.observation_tokens, tok, args.system_tokens)
    observations = [[pool[(a * args.turns + t) % len(pool)] for t in range(args.turns)] for a in range(args.agents)]
    off = run(args.engine, False, system, observations, args.answer_tokens)
    on = run(args.engine, True, system, observations, args.answer_tokens)
    later = lambda r: statistics.median(r["ttft_ms"][1:])  # noqa: E731 - turns >= 2
    print(json.dumps({"turn": list(range(1, args.turns + 1)), "ttft_ms_uncached": [round(x, 1) for x in off["ttft_ms"]],
                      "ttft_ms_cached": [round(x, 1) for x in on["ttft_ms"]]}))
    print(json.dumps({
        "agents": args.agents, "turns": args.turns, "final_prompt_tokens": args.system_tokens
        + args.turns * (args.observation_tokens + args.answer_tokens) - args.answer_tokens,
        "wall_s_uncached": round(off["wall_s"], 2), "wall_s_cached": round(on["wall_s"], 2),
        "wall_ratio": round(on["wall_s"] / off["wall_s"], 3),
        "ttft_turns_2plus_ratio": round(later(on) / later(off), 3),
        "prefix_hit_share": round(on["hit_tokens"] / max(on["queried_tokens"], 1), 3),
        "answers_identical": on["answers"] == off["answers"], "engine": args.engine.name, "cpu": cpu_model()}))


if __name__ == "__main__":
    main()
