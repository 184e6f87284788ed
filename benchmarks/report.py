"""Run the lasting benchmarks and rewrite ``docs/benchmarks.md`` with what they print.

    python -m benchmarks.report                 # every section (hours: see SECTIONS)
    python -m benchmarks.report --only runtime,attention
    python -m benchmarks.report --list

Each section of the page is one command's output, verbatim, under the command, the machine
(CPU model, cores, memory, the instruction sets that pick the kernels) and the date it ran. A
section that is not run keeps what the page had. A command that fails leaves its section as it
was and makes the report exit non-zero. The page is written under a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from .common import ROOT, machine

PAGE = ROOT / "docs" / "benchmarks.md"


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    argv: tuple[str, ...]  # after ``python -m``
    note: str = ""


SECTIONS = (
    Section("export", "Export", ("benchmarks.bench_export",),
            "SmolLM2-135M to float32 without and with the transformers parity check: wall time and peak RSS."),
    Section("runtime", "Runtime against transformers", ("benchmarks.bench_runtime", "--rounds", "3"),
            "Batch-1 decode and time to first token of a 1,000-token prompt; the native operators against "
            "the graph's own nodes; 16 concurrent requests; the memory-bandwidth and GEMM bounds of this machine."),
    Section("attention", "Decode steps with and without the native operators",
            ("benchmarks.bench_attention", "--rounds", "3")),
    Section("decode_attention", "A decode step's attention, every build",
            ("benchmarks.bench_decode_attention", "--kv", "float32,int8"),
            "The PagedAttention operator alone at 1,000 and 5,000 cached tokens (an agent step's context), batch 1 "
            "and 8: each vector build this CPU runs against the same build with the plain loops its kernels "
            "replace, and the generic build."),
    Section("prefill_attention", "A prefill's attention, every way",
            ("benchmarks.bench_prefill_attention", "--rounds", "3"),
            "One layer's attention over a new prompt: the graph's own nodes, the scores by row with MaskedSoftmax, "
            "the native PrefillAttention operator, and PrefillAttentionBf16 where this CPU has AMX-BF16, for "
            "SmolLM2's and GLM-4.1V's heads."),
    Section("prefill", "Long prompts", ("benchmarks.bench_prefill", "--rounds", "3"),
            "Time to the first token of fresh 1,000- and 4,000-token prompts: the fp32 and int8 engines, and the int8 "
            "engine with Intel AMX off where this CPU has it (its linears' AVX-512 VNNI kernel and float32 "
            "attention, what other CPUs run)."),
    Section("genai_prefill", "Long prompts beside ONNX Runtime GenAI", ("benchmarks.bench_genai_prefill", "--rounds", "3"),
            "Time to the first token of fresh 1,000- and 4,000-token prompts: ONNX Runtime GenAI's own fp32 and int8 "
            "models of SmolLM2 against this toolkit's fp32 and int8 engines."),
    Section("prefill_accuracy", "Accuracy of the bfloat16 prefill attention", ("benchmarks.prefill_accuracy",),
            "The int8 engine's perplexity ratio and top-1 agreement against the float32 checkpoint, windows of 1,024 "
            "tokens prefilled whole, with PrefillAttentionBf16 on AMX and with AMX off (float32 attention)."),
    Section("sampling", "Sampling without sorting the vocabulary", ("benchmarks.bench_sampling", "--rounds", "3")),
    Section("linears", "One linear, every way", ("benchmarks.bench_linears",),
            "SmolLM2's and GLM-4-9B's linear shapes: ONNX Runtime's MatMul and MatMulNBits (8- and 4-bit "
            "blocked weights) against the native FloatLinear, Int8Linear, Int4WeightLinear, Int8WeightLinear and "
            "Int8BlockLinear, 2 threads. "
            "Each is timed on the same weights again and again, so weights "
            "that fit the last-level cache (SmolLM2's, and GLM-4-9B's qkv in 8 and 4 bits) are read warm; "
            "GLM-4-9B's gate_up (and down in 8 bits) is the memory-bound case a decode step is."),
    Section("guided", "Structured output and penalties", ("benchmarks.bench_guided", "--rounds", "3"),
            "16 concurrent requests free, under a JSON schema, and with Open-AutoGLM's frequency_penalty plus a "
            "repetition penalty."),
    Section("kv", "INT8 KV cache", ("benchmarks.bench_kv",),
            "Six engines at the same KV memory (fp32 and int8 weights; float KV, INT8 KV with static per-head "
            "scales, INT8 KV with per-token scales); accuracy with each kind of held-out text fed 16 tokens a step "
            "through the pool."),
    Section("agent", "Agent workload and prefix caching", ("benchmarks.bench_agent",),
            "4 agents at once, a 1,000-token system prompt, 8 turns, the whole history resent each turn."),
    Section("agent_images", "The phone agent on a small GLM-4.1V", ("benchmarks.bench_agent", "--images"),
            "Open-AutoGLM's trace: one new 1080 x 2400 screenshot a turn (3,108 image tokens at max_pixels "
            "5,000,000), a 1,500-token system prompt: the fp32 engine's and the int8-dyn engine's time to first token "
            "split (the latter with the vision encoder's fast forms, its defaults), against transformers."),
    Section("encode_overlap", "Decoding beside a screenshot's encoding",
            ("benchmarks.bench_encode_overlap", "--rounds", "3"),
            "A GLM-4.1V engine (SmolLM2's decoder shape, the small vision tower above, int8-wo) loaded with its "
            "decoder's ONNX Runtime threads spinning and blocking, in turns: decode tokens/s with 1 and 4 streams "
            "alone and while 1080 x 2400 screenshots are encoded, and the encoder's seconds a screenshot; then four "
            "screenshots sent at once, encoded one at a time (the engine's way) and all at once."),
    Section("agents_serve", "Phone agents through the server", ("benchmarks.bench_agents_serve", "--rounds", "2",
                                                                  "--gen-len", "200"),
            "serve on the GLM-4.1V engine above (SmolLM2's decoder shape, int8-wo), measured by bench --url "
            "--image 1080x2400: each request a new screenshot (3,108 image tokens) as a data: URL, streamed, 200 "
            "tokens; 1 client, then 4; the server as by default and with --no-spinning, in turns; with the server's "
            "own split of the time to first token (autoglm_request_phase_seconds, mean per phase)."),
    Section("vision_half", "The TensorRT vision engine's half types", ("benchmarks.vision_half",),
            "A 1080 x 2400 screenshot through the small GLM-4.1V vision tower above: the float32 encoder as ONNX "
            "Runtime runs it against the graph a TensorRT build compiles (graph/vision_trt.py) in float32, float16 "
            "and bfloat16, the half types also as tensor cores compute (half operands and results, float32 sums)."),
    Section("vision_forms", "The vision encoder's fast forms", ("benchmarks.vision_forms",),
            "A 1080 x 2400 screenshot through the small GLM-4.1V vision tower above and through one layer of "
            "GLM-4.1V-9B's width: the float32 encoder, its INT8-linear form (activations per token, weights per "
            "channel; graph/vision_int8.py), each with the native bfloat16 attention (ImageAttentionBf16, where the "
            "CPU has AVX512-BF16), and transformers' tower; each form's cosine per image token against the float32 "
            "encoder's."),
    Section("tensorrt_forms", "The float16 graphs of a TensorRT build", ("benchmarks.tensorrt_forms",),
            "SmolLM2's int8, int8-wo and int4-awq plans written as a TensorRT build writes them (float16 Q/DQ or "
            "dequantized weights, 8-bit weight-only ones per output channel, GEMMs, attention and KV cache) and in "
            "float32, run by ONNX Runtime's CPU "
            "unoptimized, on held-out text of four kinds against the float32 checkpoint."),
    Section("serve", "Serving", ("benchmarks.bench_serve",),
            "Server against in-process aggregate tokens/s, 16 concurrent streams."),
    Section("hardening", "Serving under attack", ("benchmarks.bench_hardening",),
            "Well-behaved streams with and without crafted clients beside them (image bombs, a 240 KB grammar, "
            "stop-string floods, clients leaving n = 4 requests): the load test's figures and checks."),
    Section("triton", "Triton", ("benchmarks.bench_triton",), "Through tritonserver against in-process."),
    Section("genai", "Side by side with ONNX Runtime GenAI", ("benchmarks.bench_genai", "--rounds", "3"),
            "Batch-1 and batch-8 greedy decode: ONNX Runtime GenAI's own fp32, int8 and int4 models of SmolLM2 "
            "against this toolkit's fp32, int8 and int4-awq engines."),
    Section("llamacpp", "Side by side with llama.cpp", ("benchmarks.bench_llamacpp", "--rounds", "3"),
            "Batch-1 and batch-8 greedy decode and the time to the first token of fresh 1,000- and 4,000-token "
            "prompts: llama.cpp's Q8_0 and Q4_K_M of SmolLM2 against this toolkit's int8 and int4-awq engines."),
    Section("calibration_cost", "Calibration cost", ("benchmarks.bench_calibration", "--repeats", "3"),
            "SmolLM2's 128-token windows in batches of 8: plain ONNX Runtime forward passes (logits only) against "
            "calibrate's statistics pass and threshold search, each in its own process, interleaved, the best of 3; "
            "the ratio's goal is 1.1. forward_batch_s is [the first batch, the median of the later ones]. Then the "
            "split of the first sample count's pass (cProfile, SmoothQuant off): onnxruntime_run_s is "
            "the same forward with every linear's input and each K/V written to the calibration's buffers "
            "(the forward reuses those in its own arena), native_statistics_s the waits on the per-batch work "
            "(rows taken, smoothed, Hadamard-rotated and binned on both cores), first_batch_s the SmoothQuant maxima "
            "and samples; bound_run_batch_s and statistics_batch_s are that run and that work batch by batch, as "
            "forward_batch_s. A later batch's (bound run + statistics) / forward is the ratio that many samples tend to; "
            "the first batch's excess is paid once."),
    Section("export_9b", "Exporting the GLM-4-9B shape", ("benchmarks.export_9b_shape",),
            "Random weights of the 9B shape written shard by shard, exported to float16: wall time and peak RSS "
            "(needs ~40 GB of disk)."),
    Section("export_9b_glm4v", "Exporting the GLM-4.1V-9B shape (AutoGLM-Phone-9B)",
            ("benchmarks.export_9b_shape", "--model", "glm4v", "--work", "/tmp/glm4v9b"),
            "The decoder to float16 and the 24-layer vision tower to float32, from random bf16 weights: wall time "
            "and peak RSS (needs ~45 GB of disk)."),
    Section("agent_9b", "AutoGLM-Phone-9B's shape end to end",
            ("benchmarks.agent_9b_shape", "--work", "/tmp/agent9b", "--precision", "int8-wo,int4-awq"),
            "A random checkpoint of GLM-4.1V-9B's exact config exported to float16, built int8-wo and int4-awq "
            "(rounded to nearest: no calibration) from that export (the vision encoder's INT8 linears and bfloat16 "
            "attention), each served, and one Open-AutoGLM step sent through serve (a 1080 x 2400 screenshot, "
            "streamed, 32 tokens): each stage's wall time and peak RSS, the engine's size, the server's split of the "
            "time to first token and the decode rate (needs ~60 GB of disk)."),
    Section("calibrate_9b", "Calibrating the GLM-4-9B shape", ("benchmarks.calibrate_9b_shape",),
            "The same shape exported to float32 (37.6 GB of weights) and calibrated one layer at a time on a "
            "24 GB machine, without the gate (needs ~90 GB of disk)."),
    Section("calibrate_9b_int4", "INT4 weights of the GLM-4-9B shape",
            ("benchmarks.calibrate_9b_shape", "--precision", "int4-awq", "--layers", "4", "--work", "/tmp/glm9b4"),
            "The same shape cut to 4 of its 40 layers (every width as GLM-4-9B's), exported to float32 and made into "
            "int4-awq's model with its default settings (AWQ's search and GPTQ's rounding one layer at a time) on a "
            "24 GB machine: wall time, peak RSS, the INT4 graph's size per layer and outside the layers, and from "
            "them the 40-layer INT4 graph's size against fp16's (needs ~15 GB of disk)."),
    Section("calibrate_9b_int4_trt", "INT4 weights of the GLM-4-9B shape for TensorRT",
            ("benchmarks.calibrate_9b_shape", "--precision", "int4-awq", "--backend", "tensorrt", "--layers", "2",
             "--work", "/tmp/glm9b-trt"),
            "The same, cut to 2 layers, in the form a TensorRT build writes (symmetric INT4 in blocks of 128, "
            "float16 scales and graph, the LM head INT8 per output channel, the embedding float16; TensorRT itself "
            "does not run here): the graph's size per layer and outside the layers, and the 40-layer graph's against "
            "fp16's (needs ~12 GB of disk)."),
    Section("engine_load", "Loading a 9B-wide engine", ("benchmarks.bench_engine_load",),
            "The GLM-4-9B shape cut to 2 of its 40 layers, built as an int8-wo engine: its size on disk (the native "
            "operators' packed weights in model.native.bin apart), its time to load (the packed weights read, no "
            "pass run), and what running the build's passes again would add to each load (needs ~10 GB of disk)."),
    Section("accuracy", "Calibration and accuracy", ("benchmarks.accuracy_table",)),
    Section("accuracy_kinds", "Accuracy by kind of text", ("benchmarks.accuracy_kinds",)),
    Section("runtime_accuracy", "Accuracy as requests see it", ("benchmarks.runtime_accuracy",)),
    Section("chat_agreement", "Greedy answers of each precision against fp32",
            ("benchmarks.chat_agreement", "--show", "0",
             *(f"--engine={p}=engines/smollm2-{p}" for p in ("int8", "int8-wo", "int8-dyn", "int4-awq",
                                                              "int4-awq-gate")))),
    Section("int8_ceiling", "How close 8-bit weights come to fp32's answers", ("benchmarks.int8_weight_ceiling",),
            "SmolLM2's 100 chat prompts, 16 greedy tokens, in transformers with its weights rounded several ways "
            "(fake-quantized), against its float32 answers."),
    Section("peers", "Accuracy beside the peers", ("benchmarks.peer_accuracy",),
            "SmolLM2-135M in each precision of this toolkit and as llama.cpp's Q8_0 / Q4_K_M and ONNX Runtime "
            "GenAI's int8 / int4 of the same checkpoint: held-out text of four kinds against the float32 checkpoint "
            "in transformers, and 100 chat prompts' 16 greedy tokens against the fp32 engine."),
    Section("precisions", "Speed of each precision", ("benchmarks.bench_precisions", "--rounds", "3"),
            "Batch-1 and batch-8 decode and a 1,000-token prefill of the fp32, int8, int8-wo, int8-dyn and int4-awq "
            "engines, and of int4-awq with its accuracy gate (--int4-gate 1.04: int4-awq-gate)."),
    Section("precisions_avx2", "Speed of each precision, AVX2 kernels",
            ("benchmarks.bench_precisions", "--rounds", "3", "--native-variant", "avx2"),
            "The same with the native library's AVX2 build, what a CPU without AVX-512 runs: no precision has "
            "VNNI's 8-bit dot products there, and the 8-bit weights of int8, int8-wo and int8-dyn are all widened to "
            "16 bits for vpmaddwd."),
    Section("int4", "INT4 weights: AWQ, GPTQ, block size, zero points", ("benchmarks.int4_ablation",),
            "SmolLM2-135M's INT4 variants on held-out text of four kinds against the float32 checkpoint, with the "
            "linears each keeps at INT8 and its graph's size; first, how "
            "many of the checkpoint's decoder weight blocks of 32 lie on a 16-level grid (it is a dequantized Q4_1 "
            "GGUF)."),
)

BEGIN, END = "<!-- section:{} -->", "<!-- /section:{} -->"


def render(section: Section, output: str, when: str, where: str) -> str:
    command = "python -m " + " ".join(section.argv)
    lines = [BEGIN.format(section.key), f"## {section.title}", ""]
    if section.note:
        lines += [section.note, ""]
    lines += [f"`{command}` — {where}; {when}", "", "```text", output.rstrip(), "```", END.format(section.key)]
    return "\n".join(lines)


def existing(text: str) -> dict[str, str]:
    """The page's sections by key, as written."""
    out = {}
    for m in re.finditer(r"<!-- section:(\w+) -->.*?<!-- /section:\1 -->", text, re.S):
        out[m.group(1)] = m.group(0)
    return out


def page(blocks: dict[str, str]) -> str:
    head = ("# Benchmarks\n\nEvery figure here is printed by the command above it, run on the machine it names "
            "(`make benchmarks` reruns them all, `python -m benchmarks.report --only KEY` one section). "
            "These machines are shared and drift by 10–20% within minutes: compare figures measured in one "
            "run, not across sections.\n")
    body = [blocks[s.key] for s in SECTIONS if s.key in blocks]
    return head + "\n" + "\n\n".join(body) + "\n"


def run(section: Section, timeout: float) -> str:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", *section.argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(section.argv)} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    print(f"{section.key}: {time.monotonic() - start:.0f} s", file=sys.stderr)
    return done.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated section keys (default: all)")
    ap.add_argument("--list", action="store_true", help="print the sections and exit")
    ap.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per section")
    args = ap.parse_args()
    if args.list:
        for s in SECTIONS:
            print(f"{s.key:18s} python -m {' '.join(s.argv)}")
        return
    keys = {s.key for s in SECTIONS}
    wanted = [k for k in args.only.split(",") if k] or [s.key for s in SECTIONS]
    unknown = sorted(set(wanted) - keys)
    if unknown:
        ap.error(f"unknown sections {', '.join(unknown)}; known: {', '.join(sorted(keys))}")
    where, failed = machine(), []
    for section in (s for s in SECTIONS if s.key in wanted):
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        try:
            output = run(section, args.timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"{section.key}: {exc}", file=sys.stderr)
            failed.append(section.key)
            continue
        print(output)
        # the page as it is now (another report may have rewritten other sections meanwhile)
        blocks = existing(PAGE.read_text()) if PAGE.is_file() else {}
        blocks[section.key] = render(section, output, when, where)
        tmp = PAGE.with_suffix(f".md.{os.getpid()}.partial")
        tmp.write_text(page(blocks))
        os.replace(tmp, PAGE)  # after every section, so a long run keeps what it has measured
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
