#!/usr/bin/env python3
"""The phone agent's workload on a small GLM-4.1V: the engine against transformers, in one run on one machine.

    python -m benchmarks.bench_agent --images [--turns 4] [--answer-tokens 100]

A random GLM-4.1V checkpoint of a small config (fixed seed; no real weights are reachable here)
with Open-AutoGLM's image settings (``max_pixels`` 5,000,000: a 1080 x 2400 screenshot is 3,108
image tokens) runs a multi-turn trace shaped like Open-AutoGLM's: a system prompt of about 1,500
tokens, then per turn one new 1080 x 2400 UI-like screenshot with a short instruction, the
earlier turns kept as text (their screenshots dropped, as the agent drops them), and an answer of
``--answer-tokens`` tokens (greedy, EOS ignored). Two engines run it: fp32 (everything float32)
and int8-dyn (8-bit decoder activations, so by default INT8 vision linears and bfloat16 vision
attention where this CPU has them), the latter sent the fp32 engine's answers as its history so
that both see the same prompts. For each turn it prints each engine's time to first token split
into image decode, preprocessing, encoder and prefill (the step that computes the first token,
prefix cache on), and transformers' for the same request (its image processor, then ``generate``
to the first token, with the same processor output); and whether the first tokens agree
(fp32's with transformers', int8-dyn's with fp32's). The goal in the issue: the engine's TTFT at
most 0.5x transformers'.
"""

from __future__ import annotations

import io
import json
import statistics
import sys
import time
from pathlib import Path

from autoglm_trt.model.screens import ui_screenshot_png

from .common import ROOT, machine

TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, max_position_embeddings=16384, mrope_section=[4, 6, 6])
VISION = dict(depth=4, hidden_size=256, intermediate_size=512, num_heads=4, image_size=336)
PREPROCESSOR = {"size": {"shortest_edge": 56 * 56, "longest_edge": 5_000_000}}  # Open-AutoGLM's max_pixels
IMAGE_TOKEN = 259  # the test checkpoints' <|image|> (tests/tiny_models.py GLM4V_TOKENS)


def checkpoint(out: Path, vision: dict | None = None, text: dict | None = None) -> Path:
    """``out``: a random GLM-4.1V checkpoint of this config (or of ``vision``'s and ``text``'s), made
    unless there."""
    from tests.tiny_models import make_tiny_checkpoint

    if not (out / "config.json").is_file():
        make_tiny_checkpoint("glm4v", out, vision=vision or VISION, preprocessor=PREPROCESSOR, **(text or TEXT))
    return out


def trace(turns: int, system_tokens: int) -> tuple[str, list[tuple[bytes, str]]]:
    text = "".join(f.read_text() for f in sorted((ROOT / "autoglm_trt" / "calib" / "data").glob("*.txt")))
    system = text[:system_tokens]  # the byte-level tokenizer: one token a byte
    steps = [(ui_screenshot_png(t), f"Step {t + 1}: {text[system_tokens + 97 * t: system_tokens + 97 * t + 60]}")
             for t in range(turns)]
    return system, steps


def messages(system: str, history: list[tuple[str, str]], instruction: str, image: object) -> list[dict]:
    """Open-AutoGLM's shape: system, earlier turns as text, the new screenshot with the instruction."""
    out = [{"role": "system", "content": system}]
    for asked, answered in history:
        out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    out.append({"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": instruction}]})
    return out


def run_engine(engine_dir: Path, system: str, steps: list, answer: int, answers: list[str] | None = None) -> list[dict]:
    """The engine's rows, turn by turn; ``answers``: the earlier turns' answers to send instead of its own."""
    from autoglm_trt.runtime import Engine, ImageOptions, SamplingParams

    params = SamplingParams(max_new_tokens=answer, ignore_eos=True)
    rows, history = [], []
    with Engine.load(engine_dir, images=ImageOptions(max_pixels=5_000_000)) as engine:
        engine.generate([[{"role": "user", "content": "warm up"}]], SamplingParams(max_new_tokens=2))
        for png, instruction in steps:
            t0 = time.perf_counter()
            prepared = engine.prepare(messages(system, history, instruction, png))
            prep = time.perf_counter() - t0
            [res] = engine.generate([prepared], params)
            s = prepared.seconds
            rows.append({"prompt_tokens": len(prepared.ids), "decode_ms": 1000 * s["decode"],
                         "preprocess_ms": 1000 * s["preprocess"], "encode_ms": 1000 * s["encode"],
                         "prefill_ms": 1000 * res.ttft, "ttft_ms": 1000 * (prep + res.ttft), "tokens": res.token_ids,
                         "hit_tokens": engine.stats()["prefix_hit_tokens"],
                         "image_tokens": prepared.ids.count(IMAGE_TOKEN), "text": res.text,
                         "graph": engine.images.encoder.graph})
            history.append((instruction, res.text if answers is None else answers[len(history)]))
    return rows


def run_transformers(ckpt: Path, system: str, steps: list, engine_rows: list[dict]) -> list[dict]:
    """transformers on the same requests (the engine's answers as the history), to the first token."""
    import torch
    import transformers
    from PIL import Image

    from autoglm_trt.model.tokenizer import TextTokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    processor = transformers.AutoImageProcessor.from_pretrained(str(ckpt), use_fast=False)
    tok = TextTokenizer(ckpt)
    rows, history = [], []
    for (png, instruction), mine in zip(steps, engine_rows):
        ids = tok.apply_chat_template(messages(system, history, instruction, None))
        t0 = time.perf_counter()
        image = Image.open(io.BytesIO(png)).convert("RGB")
        out = processor(images=[image], return_tensors="pt")
        t1 = time.perf_counter()
        grid = out["image_grid_thw"]
        n = int(grid.prod()) // 4
        k = ids.index(IMAGE_TOKEN)
        expanded = ids[:k] + [IMAGE_TOKEN] * n + ids[k + 1:]
        with torch.no_grad():
            first = model.generate(torch.tensor([expanded]), pixel_values=out["pixel_values"], image_grid_thw=grid,
                                   mm_token_type_ids=torch.tensor([[int(t == IMAGE_TOKEN) for t in expanded]]),
                                   max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
        t2 = time.perf_counter()
        rows.append({"prompt_tokens": len(expanded), "preprocess_ms": 1000 * (t1 - t0), "ttft_ms": 1000 * (t2 - t0),
                     "first_token_equal": int(first[0, -1]) == mine["tokens"][0]})
        history.append((instruction, tok.decode(mine["tokens"])))
    return rows


def is_current(engine: Path) -> bool:
    """Whether ``engine`` exists and was built by this code's graph and vision record (else rebuild it)."""
    from autoglm_trt.artifacts import ExportRecord
    from autoglm_trt.errors import AutoGLMError
    from autoglm_trt.graph.decoder import GRAPH_VERSION

    try:
        record = ExportRecord.read(engine)
        return (engine / "manifest.json").is_file() and record.graph_version == GRAPH_VERSION and \
            record.vision() is not None
    except AutoGLMError:
        return False


def small_engine(work: Path, precision: str = "fp32") -> Path:
    """``work``/engine-<precision>: the ONNX Runtime engine of ``checkpoint(work / "checkpoint")``
    (fp32 unless said), built unless a current one is there."""
    from autoglm_trt.builder.config import BuildConfig
    from autoglm_trt.builder.pipeline import BuildRequest, build_engine

    engine = work / f"engine-{precision}"
    if not is_current(engine):
        build_engine(BuildRequest(checkpoint(work / "checkpoint"), engine, precision=precision, backend="onnxruntime",
                                  force=engine.exists(),
                                  config=BuildConfig(max_seq_len=8192, max_input_len=2048, max_batch_size=4)),
                     log=lambda m: print(m, file=sys.stderr))
    return engine


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", action="store_true", help="(the flag bench_agent dispatches on)")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--answer-tokens", type=int, default=100)
    ap.add_argument("--work", type=Path, default=ROOT / "engines" / "bench-glm4v")
    args = ap.parse_args()
    ckpt = checkpoint(args.work / "checkpoint")
    engines = {"fp32": small_engine(args.work), "int8-dyn": small_engine(args.work, "int8-dyn")}
    system, steps = trace(args.turns, args.system_tokens)
    mine = run_engine(engines["fp32"], system, steps, args.answer_tokens)
    fast = run_engine(engines["int8-dyn"], system, steps, args.answer_tokens, [row["text"] for row in mine])
    ref = run_transformers(ckpt, system, steps, mine)
    keys = ("decode_ms", "preprocess_ms", "encode_ms", "prefill_ms", "ttft_ms")
    for t, (a, f, b) in enumerate(zip(mine, fast, ref)):
        print(json.dumps({"turn": t + 1, "prompt_tokens": a["prompt_tokens"],
                          "hf_preprocess_ms": round(b["preprocess_ms"], 1), "hf_ttft_ms": round(b["ttft_ms"], 1),
                          "prefix_hit_tokens": a["hit_tokens"],
                          "fp32": {**{k: round(a[k], 1) for k in keys}, "ttft_ratio": round(a["ttft_ms"] / b["ttft_ms"], 3),
                                   "first_token_equal_hf": b["first_token_equal"]},
                          "int8-dyn": {**{k: round(f[k], 1) for k in keys},
                                       "ttft_ratio": round(f["ttft_ms"] / b["ttft_ms"], 3),
                                       "first_token_equal_fp32": f["tokens"][0] == a["tokens"][0]}}))
    print(json.dumps({"turns": args.turns, "image_tokens_per_screenshot": mine[0]["image_tokens"],
                      "median_ttft_ratio": {name: round(statistics.median(r["ttft_ms"] / b["ttft_ms"]
                                                                          for r, b in zip(rows, ref)), 3)
                                            for name, rows in (("fp32", mine), ("int8-dyn", fast))},
                      "vision_graph": {"fp32": mine[0]["graph"], "int8-dyn": fast[0]["graph"]},
                      "machine": machine()}))


if __name__ == "__main__":
    main()
