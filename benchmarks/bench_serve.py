#!/usr/bin/env python3
"""Server against in-process aggregate throughput, in one run on one machine.

    python -m benchmarks.bench_serve [--engine engines/smollm2-int8] [--concurrency 16] [--rounds 2]

Alternates, round by round: ``runtime.bench.run_level`` on an ``Engine`` in this process, and
the same level through a ``autoglm-trt serve`` subprocess on a free loopback port (streamed
``/v1/completions``). Prints each round, the median ratio server / in-process of aggregate
generated tokens/s, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .common import ROOT


def main() -> None:
    from autoglm_trt.fileutil import cpu_model, free_port
    from autoglm_trt.runtime import Engine
    from autoglm_trt.runtime.bench import engine_call, run_level
    from autoglm_trt.serve.client import url_call

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(args.engine), "--port", str(port)],
                            cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                remote = url_call(url)
                break
            except OSError:
                time.sleep(0.2)
        rows = []
        with Engine.load(args.engine) as engine:
            local, vocab = engine_call(engine), engine.spec.vocab_size
            for call in (local, remote):  # warm-up
                run_level(call, vocab, 2, args.prompt_len, 4, 2)
            for r in range(args.rounds):
                level = (args.concurrency, args.prompt_len, args.gen_len, args.requests)
                a = run_level(local, vocab, *level)
                b = run_level(remote, vocab, *level)
                rows.append({"round": r + 1, "in_process_tok_s": round(a["tokens_per_s"], 1),
                             "server_tok_s": round(b["tokens_per_s"], 1),
                             "ratio": round(b["tokens_per_s"] / a["tokens_per_s"], 3),
                             "server_ttft_ms_p50": round(b["ttft_ms_p50"], 1),
                             "in_process_ttft_ms_p50": round(a["ttft_ms_p50"], 1)})
                print(json.dumps(rows[-1]), flush=True)
        print(json.dumps({"median_ratio": statistics.median(r["ratio"] for r in rows), "concurrency": args.concurrency,
                          "engine": args.engine.name, "cpu": cpu_model()}))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
