#!/usr/bin/env python3
"""Bounded load on a running ``autoglm-trt serve`` over loopback, with attackers beside it.

    python tools/load_test.py --url http://127.0.0.1:8080 [--requests 500] [--concurrency 32]
                              [--attackers 2 --quiet-first]

Sends ``--requests`` completions from ``--concurrency`` client threads: streamed greedy
requests of random token prompts, of which ``--disconnect`` (10%) hang up early (half of them
streams cut mid-way, half ``n`` = 3 requests without streaming closed while they run),
``--malformed`` (5%) send a broken body, ``--oversized`` (2%) a body over ``--max-body-bytes``
and, with ``--api-key``, ``--bad-key`` (2%) a wrong key; with ``--image WxH`` (an image-text
engine), ``--image-share`` of them (50%) are chats that carry a new synthetic screenshot of that
size. With ``--attackers N``, N more threads send crafted requests while that load runs (and each
kind at least once), in turn: an image bomb (ten 8000 x 8000 one-bit PNGs, ~100 KB; image engines only), a huge
grammar (a 240 KB JSON schema, an enum of 18,000 words, ``n`` = 8), a stop-string flood (16
stop strings of 1,024 characters, streamed) and a client that leaves a non-streamed ``n`` = 4
request while it decodes. With ``--quiet-first`` the same well-behaved load first runs alone.

Prints P50/P99 time to first token and inter-token latency, aggregate tokens/s and the HTTP status
counts (each phase's, with the attacks' outcomes, the server's resident memory and the engine
loop's longest hold), then checks, and exits 1 when any fails: no 5xx; every well-formed request
either completed ([DONE], all its tokens) or was one we cancelled; malformed ones got 400,
oversized ones 413 and bad keys 401, each with OpenAI's error JSON; every attack answered as a
client's mistake or served (no 5xx); with ``--quiet-first``, the well-behaved streams' P99
inter-token latency within ``--max-itl-ratio`` (2x) of the quiet run's; at the end the server's KV
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
        return answer(r)
    finally:
        sock.close()


def answer(r: http.client.HTTPResponse) -> tuple[int, dict | None]:
    """A response's status and its JSON body (None if it is not JSON)."""
    data = r.read()
    try:
        return r.status, json.loads(data)
    except ValueError:
        return r.status, None


def json_headers(api_key: str | None) -> dict[str, str]:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}


def openai_error(body: dict | None) -> bool:
    return isinstance(body, dict) and set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])


def close_while_running(url: str, model: str, prompt: list[int], max_tokens: int, api_key: str | None,
                        after_s: float) -> None:
    """A request for 3 samples without streaming, whose client goes away after ``after_s``."""
    conn, base = connect(url, 60)
    headers = json_headers(api_key)
    conn.request("POST", f"{base}/v1/completions", json.dumps({"model": model, "prompt": prompt, "n": 3,
                 "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True}), headers)
    time.sleep(after_s)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


LIVE = ("autoglm_kv_blocks_used", "autoglm_requests_running", "autoglm_requests_waiting")
WATCHED = ("process_resident_memory_bytes", "autoglm_loop_longest_hold_seconds")


def server_gauges(url: str, api_key: str | None, names: tuple[str, ...] = LIVE) -> dict[str, float]:
    conn, base = connect(url, 30)
    try:
        conn.request("GET", f"{base}/metrics", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    return {line.split()[0]: float(line.split()[-1]) for line in text.splitlines() if line.startswith(names)}


def post_json(url: str, path: str, body: dict, api_key: str | None) -> tuple[int, dict | None]:
    """A non-streamed request over a connection of its own: its status and JSON answer."""
    conn, base = connect(url, 300)
    try:
        conn.request("POST", f"{base}{path}", json.dumps(body), json_headers(api_key))
        return answer(conn.getresponse())
    finally:
        conn.close()


def one_bit_png_url(side: int) -> str:
    """A data: URL of a black one-bit PNG of side x side pixels (a few KB that decode to side**2 * 3 bytes)."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (side, side)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Attacks:
    """Crafted requests, in turn; each answer is recorded by kind with whether it was one a server may give."""

    def __init__(self, url: str, model: str, api_key: str | None, images: bool, gen_len: int):
        self.url, self.model, self.api_key, self.gen_len = url, model, api_key, gen_len
        rng = random.Random(1)
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(5, 15)))
                 for _ in range(18_000)]
        self.schema = {"type": "object", "properties": {"w": {"enum": words}}, "required": ["w"]}
        self.stop_strings = ["".join(rng.choice("QXZJ") for _ in range(1024)) for _ in range(16)]
        self.bomb_url = one_bit_png_url(8000) if images else None
        self.kinds = ["grammar", "stops", "leave"] + (["bomb"] if images else [])
        self.outcomes: dict[str, Counter[int]] = {k: Counter() for k in self.kinds}
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def run(self, k: int, stop: threading.Event) -> None:
        """Attacks in turn from the ``k``-th kind on, until ``stop`` is set and each kind was sent once."""
        first = k
        while not stop.is_set() or k < first + len(self.kinds):
            kind = self.kinds[k % len(self.kinds)]
            k += 1
            status, expected, detail = getattr(self, kind)()
            with self.lock:
                self.outcomes[kind][status] += 1
                if status not in expected:
                    self.problems.append(f"attack {kind}: {status} {detail[:200]}, expected one of {sorted(expected)}")

    def bomb(self) -> tuple[int, set[int], str]:
        parts = [{"type": "image_url", "image_url": {"url": self.bomb_url}}] * 10
        status, body = post_json(self.url, "/v1/chat/completions", {
            "model": self.model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                *parts, {"type": "text", "text": "tap"}]}]}, self.api_key)
        return status, {400, 413}, str(body)

    def grammar(self) -> tuple[int, set[int], str]:
        status, body = post_json(self.url, "/v1/completions", {
            "model": self.model, "prompt": "Pick a word:", "max_tokens": 16, "n": 8, "temperature": 1.0,
            "guided_json": self.schema}, self.api_key)
        return status, {200, 400, 413, 429}, str(body)  # 400: the grammar passed a limit of llguidance's

    def stops(self) -> tuple[int, set[int], str]:
        conn, base = connect(self.url, 300)
        headers = json_headers(self.api_key)
        try:
            conn.request("POST", f"{base}/v1/completions", json.dumps({
                "model": self.model, "prompt": "Tell me a story.", "max_tokens": self.gen_len, "stream": True,
                "stop": self.stop_strings, "ignore_eos": True}), headers)
            r = conn.getresponse()
            text = r.read().decode(errors="replace")
            ok = r.status != 200 or text.rstrip().endswith("data: [DONE]")
            return (r.status if ok else -1), {200}, text[-200:]
        finally:
            conn.close()

    def leave(self) -> tuple[int, set[int], str]:
        conn, base = connect(self.url, 60)
        headers = json_headers(self.api_key)
        conn.request("POST", f"{base}/v1/completions", json.dumps({
            "model": self.model, "prompt": "Tell me a long story.", "n": 4, "max_tokens": 4 * self.gen_len,
            "temperature": 1.0, "ignore_eos": True}), headers)
        time.sleep(0.3)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        return 499, {499}, "left"


def percentile_ms(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values or [np.nan]) * 1000, q)), 2)


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
    ap.add_argument("--attackers", type=int, default=0, help="threads sending crafted requests beside the load")
    ap.add_argument("--quiet-first", action="store_true", help="run the well-behaved load alone first, to compare")
    ap.add_argument("--max-itl-ratio", type=float, default=2.0,
                    help="with --quiet-first: the attacked P99 inter-token latency over the quiet one, at most")
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
        plan.append((kind, [rng.randrange(3, 250) for _ in range(rng.randrange(1, args.prompt_len + 1))],
                     rng.random() < args.image_share, rng.randrange(1, args.gen_len), rng.uniform(0.01, 0.3)))
    problems: list[str] = []
    report: dict = {"requests": args.requests, "concurrency": args.concurrency, "attackers": args.attackers}
    if args.quiet_first:
        quiet = run_phase(args, plan, model, image, None)
        problems += quiet.pop("problems")
        report["quiet"] = quiet
    attacks = Attacks(args.url, model, args.api_key, image is not None, args.gen_len) if args.attackers else None
    loaded = run_phase(args, plan, model, image, attacks)
    problems += loaded.pop("problems")
    report.update(loaded)
    if attacks is not None:
        report["attacks"] = {kind: dict(sorted(c.items())) for kind, c in attacks.outcomes.items()}
        problems += attacks.problems
        if not all(sum(c.values()) for c in attacks.outcomes.values()):
            problems.append(f"not every attack was sent while the load ran: {report['attacks']}")
    if args.quiet_first:
        ratio = report["itl_ms_p99"] / report["quiet"]["itl_ms_p99"]
        report["itl_p99_over_quiet"] = round(ratio, 2)
        if not ratio <= args.max_itl_ratio:
            problems.append(f"the well-behaved streams' P99 inter-token latency is {ratio:.2f}x the quiet run's "
                            f"(at most {args.max_itl_ratio}x)")
    from autoglm_trt.fileutil import cpu_model

    report["cpu"] = cpu_model()
    print(json.dumps(report))
    for p in problems[:20]:
        print("FAIL", p)
    return 1 if problems else 0


def run_phase(args: argparse.Namespace, plan: list, model: str, image: tuple[int, ...] | None,
              attacks: Attacks | None) -> dict:
    """The planned requests from ``--concurrency`` threads (and ``attacks`` from ``--attackers`` more
    while they run), then a wait until the server is idle: the phase's figures and its problems."""
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
            kind, prompt, with_image, cut_at, after_s = plan[i]
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
                close_while_running(args.url, model, prompt, args.gen_len, args.api_key, after_s)
                with lock:
                    outcomes["cancelled"] += 1
                continue
            cut = cut_at if kind == "disconnect" else None
            if image is not None and with_image:
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

    before = server_gauges(args.url, args.api_key, WATCHED)
    stop = threading.Event()
    attackers = [threading.Thread(target=attacks.run, args=(k, stop)) for k in range(args.attackers)] if attacks else []
    for t in attackers:
        t.start()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stop.set()
    for t in attackers:
        t.join()
    problems += [f"{n} responses with status {s}" for s, n in statuses.items() if s >= 500]
    deadline = time.monotonic() + 60
    while any((gauges := server_gauges(args.url, args.api_key)).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if any(gauges.values()):
        problems.append(f"after the load: {gauges} (KV blocks still in use, or requests still live)")
    after = server_gauges(args.url, args.api_key, WATCHED)
    # (a request whose tokens all decode to no text, special tokens, sends no text chunk to time)
    ttft = [r.token_times[0] - r.submitted for r in results if r.token_times]
    itl = [float(d) for r in results for d in np.diff(r.token_times)]
    rss = "process_resident_memory_bytes"
    return {"wall_s": round(wall, 2), "statuses": dict(sorted(statuses.items())), "outcomes": dict(outcomes),
            "ttft_ms_p50": percentile_ms(ttft, 50), "ttft_ms_p99": percentile_ms(ttft, 99),
            "itl_ms_p50": percentile_ms(itl, 50), "itl_ms_p99": percentile_ms(itl, 99),
            "completed_tokens_per_s": round(sum(r.completion_tokens for r in results) / wall, 1),
            "kv_blocks_used_after": gauges["autoglm_kv_blocks_used"],
            "requests_live_after": gauges["autoglm_requests_running"] + gauges["autoglm_requests_waiting"],
            "server_rss_mb": [round(g.get(rss, 0) / 2**20) for g in (before, after)],
            "loop_longest_hold_ms": round(after.get("autoglm_loop_longest_hold_seconds", 0) * 1000, 1),
            "problems": problems}


if __name__ == "__main__":
    sys.exit(main())
