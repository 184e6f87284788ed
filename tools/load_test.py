#!/usr/bin/env python3
"""Bounded load on a running ``autoglm-trt serve`` over loopback.

    python tools/load_test.py --url http://127.0.0.1:8080 [--requests 500] [--concurrency 32]

Sends ``--requests`` completions from ``--concurrency`` client threads: streamed greedy
requests of random token prompts, of which ``--disconnect`` (10%) hang up mid-stream and
``--malformed`` (5%) send a broken body; with ``--image WxH`` (an image-text engine),
``--image-share`` of them (50%) are chats that carry a new synthetic screenshot of that size.
Prints P50/P99 time to first token and inter-token latency, aggregate tokens/s and the HTTP
status counts, then checks, and exits 1 when any fails:
no 5xx; every well-formed request either completed ([DONE], all its tokens) or was one we
cancelled; malformed ones got 400; the server's KV blocks are all free at the end (/metrics).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from collections import Counter

import numpy as np

from autoglm_trt.model.screens import screenshot_message
from autoglm_trt.serve.client import connect, served_model, stream_chat, stream_completion

MALFORMED = [b"{not json", b'{"model": 5}', b'{"prompt": "x"}', b'{"model": "M", "prompt": "x", "max_tokens": -3}',
             b'{"model": "M", "prompt": [1, 2], "temperature": "hot"}', b"[]"]


def post_raw(url: str, body: bytes) -> int:
    conn, base = connect(url, 60)
    try:
        conn.request("POST", f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.read()
        return r.status
    finally:
        conn.close()


def kv_blocks_used(url: str) -> float:
    conn, base = connect(url, 30)
    try:
        conn.request("GET", f"{base}/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return next(float(line.split()[-1]) for line in text.splitlines() if line.startswith("autoglm_kv_blocks_used"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--disconnect", type=float, default=0.10)
    ap.add_argument("--malformed", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", default=None, metavar="WxH", help="screenshots of this size in some requests")
    ap.add_argument("--image-share", type=float, default=0.5)
    args = ap.parse_args()
    image = tuple(int(v) for v in args.image.lower().split("x")) if args.image else None
    rng = random.Random(args.seed)
    model = served_model(args.url)
    plan = []
    for _ in range(args.requests):
        u = rng.random()
        kind = "malformed" if u < args.malformed else "disconnect" if u < args.malformed + args.disconnect else "full"
        plan.append((kind, [rng.randrange(3, 250) for _ in range(rng.randrange(1, args.prompt_len + 1))]))
    statuses: Counter[int] = Counter()
    outcomes: Counter[str] = Counter()
    results = []
    problems: list[str] = []
    lock = threading.Lock()
    next_i = [0]

    def worker() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= len(plan):
                return
            kind, prompt = plan[i]
            if kind == "malformed":
                status = post_raw(args.url, MALFORMED[i % len(MALFORMED)].replace(b'"M"', json.dumps(model).encode()))
                with lock:
                    statuses[status] += 1
                    outcomes["malformed"] += 1
                    if status != 400:
                        problems.append(f"request {i}: malformed body answered {status}, expected 400")
                continue
            cut = rng.randrange(1, args.gen_len) if kind == "disconnect" else None
            if image is not None and rng.random() < args.image_share:
                res = stream_chat(args.url, model, screenshot_message(i, image, " ".join(map(str, prompt))),
                                  args.gen_len, stop_after_chunks=cut)
            else:
                res = stream_completion(args.url, model, prompt, args.gen_len, stop_after_chunks=cut)
            with lock:
                statuses[res.status] += 1
                if kind == "disconnect":
                    outcomes["cancelled"] += 1
                elif res.status == 200 and res.done and res.completion_tokens == args.gen_len:
                    outcomes["completed"] += 1
                    results.append(res)
                else:
                    problems.append(f"request {i}: status {res.status}, done {res.done}, "
                                    f"{res.completion_tokens} tokens, {res.error}")

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    problems += [f"{n} responses with status {s}" for s, n in statuses.items() if s >= 500]
    deadline = time.monotonic() + 30
    while (used := kv_blocks_used(args.url)) > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    if used > 0:
        problems.append(f"{used:.0f} KV blocks still in use after the load")
    # (a request whose tokens all decode to no text, special tokens, sends no text chunk to time)
    ttft = np.array([r.token_times[0] - r.submitted for r in results if r.token_times] or [np.nan]) * 1000
    itl = np.concatenate([np.diff(r.token_times) for r in results if len(r.token_times) > 1] or [[np.nan]]) * 1000
    tokens = sum(r.completion_tokens for r in results)
    from autoglm_trt.fileutil import cpu_model

    print(json.dumps({"requests": args.requests, "concurrency": args.concurrency, "wall_s": round(wall, 2),
                      "statuses": dict(sorted(statuses.items())), "outcomes": dict(outcomes),
                      "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
                      "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
                      "itl_ms_p50": round(float(np.percentile(itl, 50)), 2),
                      "itl_ms_p99": round(float(np.percentile(itl, 99)), 2),
                      "completed_tokens_per_s": round(tokens / wall, 1), "kv_blocks_used_after": used,
                      "cpu": cpu_model()}))
    for p in problems[:20]:
        print("FAIL", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
