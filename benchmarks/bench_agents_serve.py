#!/usr/bin/env python3
"""Phone agents through the server: one and four at once, each request a new screenshot, streamed.

    python -m benchmarks.bench_agents_serve [--rounds 2] [--gen-len 100]

``autoglm-trt serve`` on the GLM-4.1V engine of ``bench_encode_overlap`` (SmolLM2's decoder shape,
the small vision tower, int8-wo) with Open-AutoGLM's max_pixels, measured by ``autoglm-trt bench
--url --image 1080x2400``: each request a chat with a new 1080 x 2400 synthetic screenshot
(3,108 image tokens) as a data: URL, streamed, ``--gen-len`` tokens; 1 client for 2 requests,
then 4 clients for 8. The server runs as it does by default (the decoder's idle threads
spinning) and with ``--no-spinning``, in turns over ``--rounds``; it prints each level's time to
first token, per-token latency and tokens/s (medians over rounds) with the server's split of the
time to first token (``autoglm_request_phase_seconds``, the mean of each phase over the level's
requests: reading the body, waiting for a worker, decoding, preprocessing, waiting for the
encoder, encoding, queue and prefill, and the whole), then ``--no-spinning``'s over the
default's, four clients' median time to first token over one client's, and one client's over the
same requests made to the engine in the benchmark's own process (before the servers run).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .bench_encode_overlap import engine
from .common import ROOT, machine

KEYS = ("ttft_ms_p50", "ttft_ms_p90", "token_ms_p50", "token_ms_p90", "tokens_per_s", "wall_s")
# the server's split of a request's time to first token (autoglm_request_phase_seconds), in order
PHASES = ("read", "images_wait", "decode", "preprocess", "encoder_wait", "encode", "queue_prefill", "ttft")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def phase_totals(url: str) -> dict[str, tuple[float, float]]:
    """The server's ``autoglm_request_phase_seconds`` so far: (sum, count) by phase."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for kind, k in (("_sum", 0), ("_count", 1)):
            head = f"autoglm_request_phase_seconds{kind}{{phase=\""
            if line.startswith(head):
                phase, value = line[len(head):].split("\"}", 1)
                out.setdefault(phase, [0.0, 0.0])[k] = float(value)
    return {p: (v[0], v[1]) for p, v in out.items()}


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until the server at ``url`` answers /health; exits with its error output if it dies first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"serve exited with {server.returncode}: "
                                 f"{server.stderr.read() if server.stderr else ''}") from None
            time.sleep(0.2)
    raise SystemExit(f"serve did not answer {url}/health in {timeout_s:.0f} s")


def measured(path: Path, blocking: bool, gen_len: int) -> list[dict]:
    """``bench --url`` rows against a server started for it (and always stopped)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(path), "--port", str(port),
                               "--max-pixels", "5000000", *(["--no-spinning"] if blocking else [])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(url, server)
        rows = []
        for concurrency in (1, 4):
            before = phase_totals(url)
            out = subprocess.run([sys.executable, "-m", "autoglm_trt", "bench", "--url", url, "--image", "1080x2400",
                                  "--concurrency", str(concurrency), "--prompt-len", "64", "--gen-len", str(gen_len),
                                  "--json"], capture_output=True, text=True, check=True, timeout=1800)
            after = phase_totals(url)
            [row] = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            counts = {p: after[p][1] - before.get(p, (0.0, 0.0))[1] for p in after}
            rows.append({**row, "phase_ms_mean": {p: 1000 * (after[p][0] - before.get(p, (0.0, 0.0))[0]) / counts[p]
                                                  for p in PHASES if counts.get(p)}})
        return rows
    finally:
        server.terminate()
        server.wait(60)


def in_process(path: Path, requests: int = 2) -> float:
    """The median time to first token (ms) of ``requests`` screenshot requests as the server's one
    client sends them, made to the engine in this process: the baseline the server's path adds to."""
    import random

    from autoglm_trt.model.screens import screenshot_message
    from autoglm_trt.runtime import Engine, ImageOptions, SamplingParams

    times = []
    with Engine.load(path, images=ImageOptions(max_pixels=5_000_000)) as engine:
        for k in range(1, requests + 1):
            text = " ".join(str(random.Random(k).randrange(1000)) for _ in range(64))
            t0 = time.perf_counter()
            prepared = engine.prepare(screenshot_message(k, (1080, 2400), text))
            prepare_s = time.perf_counter() - t0
            [res] = engine.generate([prepared], SamplingParams(max_new_tokens=1, ignore_eos=True))
            times.append(1000 * (prepare_s + res.ttft))
    return statistics.median(times)


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gen-len", type=int, default=100)
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / "bench-glm4v-overlap")
    args = ap.parse_args()
    path = engine(args.work)
    alone = in_process(path)
    runs: dict[bool, list[list[dict]]] = {False: [], True: []}
    for r in range(args.rounds):
        for blocking in ((False, True) if r % 2 == 0 else (True, False)):
            runs[blocking].append(measured(path, blocking, args.gen_len))
    med = {s: [{"concurrency": rows[0]["concurrency"], "requests": rows[0]["requests"],
                **{k: statistics.median(row[k] for row in rows) for k in KEYS},
                "phase_ms_mean": {p: round(statistics.median(row["phase_ms_mean"][p] for row in rows), 1)
                                  for p in PHASES if all(p in row["phase_ms_mean"] for row in rows)}}
               for rows in zip(*runs[s])] for s in runs}
    for s in (False, True):
        for row in med[s]:
            print(json.dumps({"server": "--no-spinning" if s else "default", "rounds": args.rounds,
                              **{k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}}))
    for default, blocking in zip(med[False], med[True]):
        print(json.dumps({"concurrency": default["concurrency"], "no_spinning_over_default":
                          {k: round(blocking[k] / default[k], 3) for k in KEYS}}))
    for s in (False, True):
        one, four = med[s]
        print(json.dumps({"server": "--no-spinning" if s else "default",
                          "ttft_p50_4_over_1": round(four["ttft_ms_p50"] / one["ttft_ms_p50"], 3),
                          "ttft_p50_1_over_in_process": round(one["ttft_ms_p50"] / alone, 3)}))
    print(json.dumps({"in_process_ttft_ms_p50": round(alone, 1)}))
    print(json.dumps({"gen_len": args.gen_len, "image": "1080x2400", "machine": machine()}))


if __name__ == "__main__":
    main()
