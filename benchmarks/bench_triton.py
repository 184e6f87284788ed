#!/usr/bin/env python3
"""Throughput through Triton against in-process, at the same concurrency, in one run.

    python -m benchmarks.bench_triton [--engine engines/smollm2-int8] [--concurrency 16] [--rounds 2]

Writes a model repository for the engine, starts ``autoglm-trt triton-serve`` on free
loopback ports, then alternates rounds: ``--requests`` greedy generations of ``--gen-len``
tokens from ``--concurrency`` threads, in-process (``Engine.generate``) and through Triton's
``generate_stream``. The same text prompts give the same greedy texts on both sides; tokens
are counted by tokenizing each output. Prints tokens/s per round, the median ratio, the CPU.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .common import ROOT


def triton_text(port: int, prompt: str, gen_len: int) -> str:
    body = json.dumps({"text_input": prompt, "max_tokens": gen_len, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/bench/generate_stream", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        events = [json.loads(line[6:]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    return "".join(e.get("text_output", "") for e in events)


def level(fn, prompts: list[str], concurrency: int, count) -> float:
    texts: list[str] = []
    lock = threading.Lock()
    it = iter(prompts)

    def worker() -> None:
        while True:
            with lock:
                p = next(it, None)
            if p is None:
                return
            t = fn(p)
            with lock:
                texts.append(t)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(count(t) for t in texts) / (time.perf_counter() - t0)


def main() -> None:
    from autoglm_trt.fileutil import cpu_model, free_port
    from autoglm_trt.runtime import Engine, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    words = (ROOT / "calibration" / "eval" / "heldout.txt").read_text().split()
    prompts = [" ".join(words[i * 40:(i + 1) * 40]) for i in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        subprocess.run([sys.executable, "-m", "autoglm_trt", "triton", str(args.engine), "-o", str(repo), "--name",
                        "bench"], check=True, cwd=ROOT)
        http, grpc, metrics = free_port(), free_port(), free_port()
        proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "triton-serve", str(repo), "--http-port",
                                 str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(1200):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=2):
                        break
                except OSError:
                    time.sleep(0.25)
            with Engine.load(args.engine) as engine:
                params = SamplingParams(max_new_tokens=args.gen_len)
                count = lambda text: len(engine.tokenizer.tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
                local = lambda p: engine.generate([p], params)[0].text  # noqa: E731
                remote = lambda p: triton_text(http, p, args.gen_len)  # noqa: E731
                assert local(prompts[0]) == remote(prompts[0]), "Triton and in-process disagree on a greedy text"
                rows = []
                for r in range(args.rounds):
                    a = level(local, prompts, args.concurrency, count)
                    b = level(remote, prompts, args.concurrency, count)
                    rows.append({"round": r + 1, "in_process_tok_s": round(a, 1), "triton_tok_s": round(b, 1),
                                 "ratio": round(b / a, 3)})
                    print(json.dumps(rows[-1]), flush=True)
            print(json.dumps({"median_ratio": statistics.median(x["ratio"] for x in rows),
                              "concurrency": args.concurrency, "engine": args.engine.name, "cpu": cpu_model()}))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)


if __name__ == "__main__":
    main()
