"""``bench``: latency and throughput of an engine (or a server) at several concurrency levels.

For each level c, c client threads each send requests (random token prompts of
``prompt_len``, ``gen_len`` new tokens, EOS ignored) until ``requests`` have completed; we
record time to first token, the gaps between tokens (per-token latency), and aggregate
generated tokens per second over the level's wall time. The requests go to an ``Engine`` in
this process or, through ``serve.client``, to a server's ``/v1/completions`` stream (there a
token's time is that of the SSE chunk that carried it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .engine import Engine
from .sampling import SamplingParams

# one request: prompt ids, new tokens -> (the time of each token, submission time, tokens generated)
Call = Callable[[list[int], int], tuple[list[float], float, int]]


def engine_call(engine: Engine, image: tuple[int, int] | None = None) -> Call:
    """Requests to an engine in this process; with ``image`` (width, height), each also carries a new
    synthetic screenshot of that size (an image-text engine's; ``model.screens.screenshot_message``)."""
    count = [0]

    def call(prompt: list[int], gen_len: int) -> tuple[list[float], float, int]:
        request: list[int] | list[dict] = prompt
        if image is not None:
            from ..model.screens import screenshot_message

            count[0] += 1
            request = screenshot_message(count[0], image, " ".join(map(str, prompt)))
        [res] = engine.generate([request], SamplingParams(max_new_tokens=gen_len, ignore_eos=True))
        return res.token_times, res.submitted, len(res.token_ids)

    return call


def run_level(call: Call, vocab_size: int, concurrency: int, prompt_len: int, gen_len: int, requests: int,
              seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(100, vocab_size - 1, prompt_len).tolist() for _ in range(requests)]
    results: list[tuple[list[float], float, int]] = []
    lock = threading.Lock()
    next_i = [0]

    def client() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= requests:
                return
            res = call(prompts[i], gen_len)
            with lock:
                results.append(res)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = np.array([times[0] - submitted for times, submitted, _ in results if times]) * 1000
    gaps = np.concatenate([np.diff(times) for times, _, _ in results if len(times) > 1] or [np.zeros(1)]) * 1000
    tokens = sum(n for _, _, n in results)
    return {"concurrency": concurrency, "requests": requests, "prompt_len": prompt_len, "gen_len": gen_len,
            "ttft_ms_p50": float(np.percentile(ttft, 50)), "ttft_ms_p90": float(np.percentile(ttft, 90)),
            "token_ms_p50": float(np.percentile(gaps, 50)), "token_ms_p90": float(np.percentile(gaps, 90)),
            "token_ms_p99": float(np.percentile(gaps, 99)), "tokens_per_s": tokens / wall, "wall_s": wall}


def plot(rows: list[dict], out: Path) -> None:
    from ..errors import require

    require("matplotlib", "matplotlib", "--plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("token_ms_p50", "per-token P50"), ("token_ms_p90", "per-token P90"),
                       ("token_ms_p99", "per-token P99"), ("ttft_ms_p50", "TTFT P50")):
        a.plot(c, [r[key] for r in rows], marker="o", label=label)
    a.set_xlabel("concurrent requests")
    a.set_ylabel("ms")
    a.set_xscale("log", base=2)
    a.legend()
    a.set_title("latency")
    b.plot(c, [r["tokens_per_s"] for r in rows], marker="o")
    b.set_xlabel("concurrent requests")
    b.set_ylabel("generated tokens / s")
    b.set_xscale("log", base=2)
    b.set_title("throughput")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
