#!/usr/bin/env python3
"""Agents decoding while another agent's screenshot is encoded: the decoder's threads spinning or not.

    python -m benchmarks.bench_encode_overlap [--rounds 2] [--seconds 8]

A GLM-4.1V engine encodes a request's images on the caller's thread while its loop runs the other
requests' decode steps, so on a CPU the encoder's ONNX Runtime threads and the decoder's share the
cores. This runs one random GLM-4.1V checkpoint (fixed seed) with a decoder of SmolLM2-135M's
shape (30 layers, width 576; a byte vocabulary) and the phone-agent benchmark's vision tower,
built ``int8-wo``, loaded twice in one process: with the decoder's intra-op threads spinning
(ONNX Runtime's default, and this toolkit's) and blocking (``spinning=False``), taking turns
over ``--rounds``. Each prints decode tokens/s with 1 and 4 streams alone and while three
1080 x 2400 screenshots are encoded back to back (Open-AutoGLM's max_pixels: 3,108 image tokens
each), and the encoder's seconds a screenshot alone and beside the streams; then the blocking
decoder's figures over the spinning one's (medians over rounds). Last, four agents' screenshots
prepared at once (the default engine): the seconds each took to be decoded, preprocessed and
encoded, with the engine's one-encode-at-a-time and with every encode let run at once.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

from .bench_agent_images import PREPROCESSOR, VISION, is_current, messages, trace
from .common import ROOT, machine

TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
            head_dim=64, max_position_embeddings=16384, mrope_section=[4, 6, 6])


def engine(work: Path) -> Path:
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    ckpt, out = work / "checkpoint", work / "engine-int8-wo"
    if not (ckpt / "config.json").is_file():
        from tests.tiny_models import make_tiny_checkpoint

        make_tiny_checkpoint("glm4v", ckpt, vision=VISION, preprocessor=PREPROCESSOR, **TEXT)
    if not is_current(out):
        build_engine(BuildRequest(ckpt, out, precision="int8-wo", backend="onnxruntime", force=out.exists(),
                                  config=BuildConfig(max_seq_len=8192, max_input_len=2048, max_batch_size=4)),
                     log=lambda m: print(m, file=sys.stderr))
    return out


class Streams:
    """``n`` greedy text requests kept running on ``eng`` until ``stop``; ``tokens()`` counts what they made."""

    def __init__(self, eng, n: int):
        from autoglm_trt.runtime import SamplingParams

        self.eng, self.n, self.params = eng, n, SamplingParams(max_new_tokens=1000, ignore_eos=True)
        self.made: list = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._feed, daemon=True)

    def _feed(self) -> None:
        live: list = []
        while not self.halt.is_set():
            live = [r for r in live if not r.done.is_set()]
            while len(live) < self.n:
                live.append(self.eng.submit(f"Agent {len(self.made)} reports on the screen:", self.params))
                self.made.append(live[-1])
            time.sleep(0.005)
        for r in live:
            self.eng.cancel(r)

    def tokens(self) -> int:
        return sum(len(r.seq.output_ids) for r in list(self.made))

    def __enter__(self) -> Streams:
        self.thread.start()
        time.sleep(1.0)  # past their prefills
        return self

    def __exit__(self, *exc: object) -> None:
        self.halt.set()
        self.thread.join()


def encode_all(eng, system: str, steps: list) -> list[float]:
    """Each screenshot's encoder seconds (the encoder cache is off, so every one is encoded)."""
    return [eng.prepare(messages(system, [], instruction, png)).seconds["encode"] for png, instruction in steps]


def measure(eng, system: str, steps: list, seconds: float) -> dict:
    row: dict = {"encode_s_alone": statistics.median(encode_all(eng, system, steps))}
    for n in (1, 4):
        with Streams(eng, n) as streams:
            t0, c0 = time.perf_counter(), streams.tokens()
            time.sleep(seconds)
            row[f"decode_{n}_alone_tok_s"] = (streams.tokens() - c0) / (time.perf_counter() - t0)
        with Streams(eng, n) as streams:
            t0, c0 = time.perf_counter(), streams.tokens()
            encoded = encode_all(eng, system, steps)
            row[f"decode_{n}_beside_encoder_tok_s"] = (streams.tokens() - c0) / (time.perf_counter() - t0)
            row[f"encode_s_beside_{n}"] = statistics.median(encoded)
    return row


def agents_at_once(eng, system: str, pngs: list[bytes], one_at_a_time: bool) -> list[float]:
    """Seconds each of ``pngs`` took to be prepared, all started together on threads of their own."""
    import contextlib

    if not one_at_a_time:  # what the engine did before it encoded one image at a time
        eng.images._encoding = contextlib.nullcontext()
    took = [0.0] * len(pngs)
    start = threading.Barrier(len(pngs))

    def agent(k: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        eng.prepare(messages(system, [], f"Step {k + 1}: open the settings", pngs[k]))
        took[k] = time.perf_counter() - t0

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(len(pngs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def main() -> None:
    import argparse

    from autoglm_trt.runtime import Engine, ImageOptions, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=8.0, help="each decode-alone window")
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / "bench-glm4v-overlap")
    args = ap.parse_args()
    path = engine(args.work)
    system, steps = trace(3, 1500)
    rows: dict[bool, list[dict]] = {True: [], False: []}
    for r in range(args.rounds):
        for spinning in ((True, False) if r % 2 == 0 else (False, True)):
            options = ImageOptions(max_pixels=5_000_000, encoder_cache_bytes=0)
            with Engine.load(path, images=options, spinning=spinning) as eng:
                eng.generate(["warm up"], SamplingParams(max_new_tokens=4))
                rows[spinning].append(measure(eng, system, steps, args.seconds))
    med = {s: {k: statistics.median(row[k] for row in rows[s]) for k in rows[s][0]} for s in rows}
    for s in (True, False):
        print(json.dumps({"decoder_threads": "spinning" if s else "blocking", "rounds": args.rounds,
                          **{k: round(v, 2 if k.startswith("encode") else 1) for k, v in med[s].items()}}))
    print(json.dumps({"blocking_over_spinning": {k: round(med[False][k] / med[True][k], 3) for k in med[True]},
                      "machine": machine()}))
    from autoglm_trt.model.screens import ui_screenshot_png

    pngs = [ui_screenshot_png(10 + k) for k in range(4)]
    took: dict[bool, list[list[float]]] = {True: [], False: []}
    for r in range(args.rounds):
        for one in ((True, False) if r % 2 == 0 else (False, True)):
            with Engine.load(path, images=ImageOptions(max_pixels=5_000_000, encoder_cache_bytes=0)) as eng:
                eng.prepare(messages(system, [], "warm up", ui_screenshot_png(20)))
                took[one].append(agents_at_once(eng, system, pngs, one))
    summary = {one: {"mean_s": statistics.median(statistics.mean(t) for t in took[one]),
                     "last_s": statistics.median(max(t) for t in took[one])} for one in took}
    for one in (True, False):
        print(json.dumps({"screenshots_at_once": len(pngs), "encoder": "one at a time" if one else "all at once",
                          "rounds": args.rounds, **{k: round(v, 2) for k, v in summary[one].items()}}))
    print(json.dumps({"all_at_once_over_one_at_a_time": {k: round(summary[False][k] / summary[True][k], 3)
                                                         for k in summary[True]}}))


if __name__ == "__main__":
    main()
