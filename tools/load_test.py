#!/usr/bin/env python3
"""Bounded load on a running ``autoglm-trt serve`` over loopback.

    python tools/load_test.py --url http://127.0.0.1:8080 [--requests 500] [--concurrency 32]

Sends ``--requests`` completions from ``--concurrency`` client threads: streamed greedy
requests of random token prompts, of which ``--disconnect`` (10%) hang up early (half of them
streams cut mid-way, half ``n`` = 3 requests without streaming closed while they run),
``--malformed`` (5%) send a broken body, ``--oversized`` (2%) a body over ``--max-body-bytes``
and, with ``--api-key``, ``--bad-key`` (2%) a wrong key; with ``--image WxH`` (an image-text
engine), ``--image-share`` of them (50%) are chats that carry a new synthetic screenshot of that
size. Prints P50/P99 time to first token and inter-token latency, aggregate tokens/s and the
HTTP status counts, then checks, and exits 1 when any fails: no 5xx; every well-formed request
either completed ([DONE], all its tokens) or was one we cancelled; malformed ones got 400,
oversized ones 413 and bad keys 401, each with OpenAI's error JSON; at the end the server's KV
blocks are all free and no request is running or waiting (/metrics).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from urllib.parse import urlsplit

import numpy as np

from autoglm_trt.model.screens import screenshot_message
from autoglm_trt.serve.client import connect, served_model, stream_chat, stream_completion
from autoglm_trt.serve.guard import DEFAULT_MAX_BODY_BYTES

MALFORMED = [b"{not json", b'{"model": 5}', b'{"prompt": "x"}', b'{"model": "M", "prompt": "x", "max_tokens": -3}',
             b'{"model": "M", "prompt": [1, 2], "temperature": "hot"}', b"[]"]


def post_raw(url: str, body: bytes, api_key: str | None) -> tuple[int, dict | None]:
    """POST ``body`` to /v1/completions over a socket of its own: the status and the JSON answer.
    A server may answer before the body is all sent (a 413, a 401) and close: the answer is read
    whatever happened to the rest of the body."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port or 80), timeout=60)
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{auth}Connection: close\r\n\r\n")
    try:
        try:
            sock.sendall(head.encode() + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        r = http.client.HTTPResponse(sock)
        r.begin()
        data = r.read()
        try:
            return r.status, json.loads(data)
        except ValueError:
            return r.status, None
    finally:
        sock.close()


def openai_error(body: dict | None) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])


def close_while_running(url: str, model: str, prompt: list[int], max_tokens: int, api_key: str | None,
                        after_s: float) -> None:
    """A request for 3 samples without streaming, whose client goes away after ``after_s``."""
    conn, base = connect(url, 60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    conn.request("POST", f"{base}/v1/completions", json.dumps({"model": model, "prompt": prompt, "n": 3,
                 "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}), headers)
    time.sleep(after_s)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


def server_gauges(url: str, api_key: str | None) -> dict[str, float]:
    conn, base = connect(url, 30)
    try:
        conn.request("GET", f"{base}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    names = ("autoglm_kv_blocks_used", "autoglm_requests_running", "autoglm_requests_waiting")
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(names)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--disconnect", type=float, default=0.10)
    ap.add_argument("--malformed", type=float, default=0.05)
    ap.add_argument("--oversized", type=float, default=0.02)
    ap.add_argument("--bad-key", type=float, default=0.02, help="share with a wrong key (only with --api-key)")
    ap.add_argument("--api-key", default=None, help="the server's key, sent with every other request")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="the server's --max-body-bytes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--image", default=None, metavar="WxH", help="screenshots of this size in some requests")
    ap.add_argument("--image-share", type=float, default=0.5)
    args = ap.parse_args()
    image = tuple(int(v) for v in args.image.lower().split("x")) if args.image else None
    rng = random.Random(args.seed)
    model = served_model(args.url, args.api_key)
    shares = [("malformed", args.malformed), ("oversized", args.oversized),
              ("bad_key", args.bad_key if args.api_key else 0.0), ("disconnect", args.disconnect)]
    plan = []
    for _ in range(args.requests):
        u, kind = rng.random(), "full"
        for name, share in shares:
            if u < share:
                kind = name
                break
            u -= share
        plan.append((kind, [rng.randrange(3, 250) for _ in range(rng.randrange(1, args.prompt_len + 1))]))
    oversized = b'{"model": "M", "prompt": "' + b"x" * args.max_body_bytes + b'"}'
    expected = {"malformed": 400, "oversized": 413, "bad_key": 401}
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
            if kind in expected:
                body = {"malformed": MALFORMED[i % len(MALFORMED)], "oversized": oversized,
                        "bad_key": b'{"model": "M", "prompt": [5, 6], "max_tokens": 2}'}[kind]
                status, answer = post_raw(args.url, body.replace(b'"M"', json.dumps(model).encode(), 1),
                                          "wrong" if kind == "bad_key" else args.api_key)
                with lock:
                    statuses[status] += 1
                    outcomes[kind] += 1
                    if status != expected[kind] or not openai_error(answer):
                        problems.append(f"request {i}: {kind} answered {status} {str(answer)[:200]}, expected "
                                        f"{expected[kind]} with OpenAI's error JSON")
                continue
            if kind == "disconnect" and i % 2:
                close_while_running(args.url, model, prompt, args.gen_len, args.api_key, rng.uniform(0.01, 0.3))
                with lock:
                    outcomes["cancelled"] += 1
                continue
            cut = rng.randrange(1, args.gen_len) if kind == "disconnect" else None
            if image is not None and rng.random() < args.image_share:
                res = stream_chat(args.url, model, screenshot_message(i, image, " ".join(map(str, prompt))),
                                  args.gen_len, args.api_key, stop_after_chunks=cut)
            else:
                res = stream_completion(args.url, model, prompt, args.gen_len, args.api_key, stop_after_chunks=cut)
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
    deadline = time.monotonic() + 60
    while any((gauges := server_gauges(args.url, args.api_key)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    used = gauges["autoglm_kv_blocks_used"]
    if any(gauges.values()):
        problems.append(f"after the load: {gauges} (KV blocks still in use, or requests still live)")
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
                      "requests_live_after": gauges["autoglm_requests_running"] + gauges["autoglm_requests_waiting"],
                      "cpu": cpu_model()}))
    for p in problems[:20]:
        print("FAIL", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
