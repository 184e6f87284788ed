#!/usr/bin/env python3
"""AutoGLM-Phone-9B's shape end to end: a random GLM-4.1V-9B checkpoint exported, built, served, one agent step.

    python -m benchmarks.agent_9b_shape [--work /tmp/agent9b] [--precision int8-wo,int4-awq]
                                        [--vision fast|float] [--gen-len 32] [--keep]

Writes a checkpoint of GLM-4.1V-9B's exact config (``export_9b_shape``: random bfloat16 weights, 40
decoder layers of width 4096, the 24-layer vision tower of width 1536) with GLM-4.1V's special token
ids, a byte-level tokenizer over its vocabulary, GLM-4.1V-9B's preprocessor limits and a chat
template of GLM-4.1V's form; exports it to float16 (the checkpoint is then deleted: the disk holds
the export and the engine, not all three), builds an engine of each ``--precision`` from that export
in turn (``int4-awq`` with ``--int4-rounding nearest``: AWQ's search and GPTQ would take hours here;
``--vision fast``: the encoder's INT8 linears and bfloat16 attention, ``float``: float32), serves it
with ``autoglm-trt serve``, and sends one Open-AutoGLM step: a system prompt, a 1080 x 2400 screenshot as a PNG data:
URL and the task, streamed, with the client's sampling (temperature 0, top_p 0.85,
frequency_penalty 0.2), ``--gen-len`` tokens. Prints each stage's wall time and peak RSS (the
children's own, from ``wait4``; the server's ``VmHWM``), the engine's size on disk (decoder,
vision encoder, and of the decoder the native operators' packed weights, ``model.native.bin``, which
the plain graph's copy of the same weights stands beside), the server's split of the time to first token
(``autoglm_request_phase_seconds``) and the decode rate; each engine is deleted before the next is
built. Needs ~60 GB of free disk; about 25 minutes per precision on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .bench_agents_serve import PHASES, free_port, phase_totals, wait_healthy
from .common import machine
from .export_9b_shape import GLM4V_CONFIG, glm4v_shapes, write_checkpoint

# GLM-4's special tokens at their ids in its 151,552-token vocabulary (GLM-4.1V adds <|image|> and
# <|video|>; zai-org/GLM-4.1V-9B-Thinking tokenizer_config.json)
SPECIALS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
            "<|end_of_video|>", "<|image|>", "<|video|>"]
FIRST_SPECIAL = 151329
# GLM-4.1V-9B's preprocessor_config.json: images up to 9,633,792 pixels (counted twice: temporal 2)
PREPROCESSOR = {"image_processor_type": "Glm4vImageProcessor", "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "size": {"shortest_edge": 12544, "longest_edge": 9633792},
                "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
FAST = "vision_linears: int8\nvision_attention: bfloat16\n"
FLOAT = "vision_linears: float32\nvision_attention: float32\n"
# the precisions built, and the build's extra arguments for each
PRECISIONS = {"int8-wo": [], "int8-dyn": [], "int4-awq": ["--int4-rounding", "nearest"]}


def tokenizer_files(ckpt: Path) -> None:
    """A byte-level tokenizer whose ids 0-255 are bytes, padded to GLM-4's specials' ids, its chat
    template of GLM-4.1V's form (tests.tiny_models'), GLM-4.1V-9B's preprocessor limits."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from tests.tiny_models import GLM4V_CHAT_TEMPLATE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"<filler_{i}>": i for i in range(len(vocab), FIRST_SPECIAL)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    assert tok.token_to_id("<|image|>") == GLM4V_CONFIG["image_token_id"]
    tok.save(str(ckpt / "tokenizer.json"))
    (ckpt / "chat_template.jinja").write_text(GLM4V_CHAT_TEMPLATE)
    (ckpt / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def child(argv: list[str], env: dict | None = None) -> dict:
    """Run ``python -m autoglm_trt argv``; its wall time and peak RSS (its own, from wait4)."""
    t = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", *argv], env={**os.environ, **(env or {})})
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"autoglm-trt {argv[0]} failed with exit code {proc.returncode}")
    return {"seconds": round(time.perf_counter() - t, 1), "peak_rss_gb": round(usage.ru_maxrss * 1024 / 1e9, 2)}


def gb(paths) -> float:
    return round(sum(p.stat().st_size for p in paths if p.is_file()) / 1e9, 2)


def sizes(engine: Path) -> dict:
    files = [p for p in engine.iterdir() if p.is_file()]
    vision = [p for p in files if p.name.startswith("vision")]
    return {"engine_gb": gb(files), "vision_gb": gb(vision), "decoder_and_rest_gb": gb(set(files) - set(vision)),
            "of_which_packed_gb": gb([engine / "model.native.bin"])}


def agent_step(url: str, model: str, gen_len: int) -> dict:
    """One Open-AutoGLM step, streamed: time to first token and the decode rate after it."""
    from autoglm_trt.model.screens import screenshot_message

    system = ("You are a phone agent. Each turn you get a screenshot and the task; think in <think>...</think>, "
              "then answer one action in <answer>do(action=\"Tap\", element=[x,y])</answer>. ") * 12
    [turn] = screenshot_message(1, (1080, 2400), "Open the settings and turn on Wi-Fi. ** Screen Info ** "
                                "{\"current_app\": \"System Home\"}")
    body = {"model": model, "stream": True, "max_tokens": gen_len, "temperature": 0.0, "top_p": 0.85,
            "frequency_penalty": 0.2, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, turn]}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, tokens, prompt = [], 0, 0
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens, prompt = chunk["usage"]["completion_tokens"], chunk["usage"]["prompt_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("delta", {}).get("content"):
                    stamps.append(time.perf_counter() - t0)
    if not stamps or tokens < 2:
        sys.exit("the server streamed no answer")
    # the first chunk carries the first token; the tokens after it came over the rest of the stream
    return {"prompt_tokens": prompt, "ttft_s": round(stamps[0], 2), "tokens": tokens,
            "decode_tokens_per_s": round((tokens - 1) / (stamps[-1] - stamps[0]), 2)}


def served(engine: Path, gen_len: int) -> dict:
    """Serve ``engine``, make one agent step, stop: load time, the step, the phases, the server's peak RSS."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(engine), "--port", str(port)],
                              stdout=subprocess.DEVNULL)
    try:
        wait_healthy(url, server, 3600)
        load_s = round(time.perf_counter() - t, 1)
        step = agent_step(url, engine.name, gen_len)
        phases = phase_totals(url)
        hwm = next(line for line in Path(f"/proc/{server.pid}/status").read_text().splitlines()
                   if line.startswith("VmHWM"))
        return {"load_s": load_s, **step, "peak_rss_gb": round(int(hwm.split()[1]) * 1024 / 1e9, 2),
                "phase_s": {p: round(phases[p][0], 2) for p in PHASES if p in phases}}
    finally:
        server.terminate()
        server.wait(120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/agent9b"))
    ap.add_argument("--precision", default="int8-wo",
                    help="comma-separated of int8-wo, int8-dyn and int4-awq (built with --int4-rounding nearest)")
    ap.add_argument("--vision", choices=("fast", "float"), default="fast")
    ap.add_argument("--gen-len", type=int, default=32)
    ap.add_argument("--keep", action="store_true", help="keep the export and the engines afterwards")
    args = ap.parse_args()
    wanted = [p for p in args.precision.split(",") if p]
    if not wanted or set(wanted) - set(PRECISIONS):
        sys.exit(f"--precision takes a comma-separated list of {', '.join(PRECISIONS)}, got {args.precision!r}")
    print(machine(), flush=True)
    ckpt, export = args.work / "checkpoint", args.work / "export"
    made = args.work / "export-stage.json"  # the export's figures, for a run that resumes after it
    if not (export / "export.json").is_file() or not made.is_file():
        print(f"writing the checkpoint to {ckpt}", flush=True)
        t = time.perf_counter()
        write_checkpoint(ckpt, GLM4V_CONFIG, glm4v_shapes(GLM4V_CONFIG))
        tokenizer_files(ckpt)
        stage = {"checkpoint_gb": gb(ckpt.glob("*.safetensors")), "checkpoint_s": round(time.perf_counter() - t),
                 "export": child(["export", str(ckpt), "-o", str(export), "--dtype", "float16", "--no-validate",
                                  "--force"])}
        shutil.rmtree(ckpt)
        made.write_text(json.dumps(stage))
    else:
        print(f"resuming after the export in {export}, made earlier", flush=True)
    stage = {**json.loads(made.read_text()), "export_gb": gb(export.iterdir())}
    config = args.work / "build.yaml"
    config.write_text(FAST if args.vision == "fast" else FLOAT)
    for name in wanted:
        engine = args.work / f"engine-{name}"
        out: dict = {"model": "GLM-4.1V-9B shape (random bf16 weights)", "precision": name,
                     "vision": args.vision, **stage}
        if PRECISIONS[name]:
            out["int4_rounding"] = "to nearest (no calibration)"
        out["build"] = child(["build", str(export), "--precision", name, "-o", str(engine), "--force",
                              "--config", str(config), *PRECISIONS[name]])
        shutil.rmtree(args.work / ".cache", ignore_errors=True)
        out.update(sizes(engine))
        out["serve"] = served(engine, args.gen_len)
        print(json.dumps(out, indent=1), flush=True)
        if not args.keep:
            shutil.rmtree(engine)
    if not args.keep:
        shutil.rmtree(args.work)


if __name__ == "__main__":
    main()
