#!/usr/bin/env python3
"""Side by side with llama.cpp: greedy decode at batch 1 and 8, and the time to the first token
of fresh 1,000- and 4,000-token prompts, llama.cpp's Q8_0 and Q4_K_M of SmolLM2 against this
toolkit's int8 and int4-awq engines, one run.

    python -m benchmarks.bench_llamacpp [--rounds 3] [--gen 128] [--tokens 1000,4000]

llama.cpp is llama-cpp-python as ``benchmarks.peer_accuracy`` builds it (this CPU's instruction
sets, read from ``/proc/cpuinfo``, but AMX, whose matrix multiply crashed here) and its GGUFs are
that script's requantizations of the shipped one. It runs through its C API (``llama_decode`` on a batch of
all sequences' tokens, greedy by argmax over each sequence's logits), 2 threads, a context of
8,192 cells with 8 sequences, ``n_batch`` 2,048 and ``n_ubatch`` 512 (llama-bench's defaults),
its own choice of flash attention. This toolkit's engines as ``bench_runtime`` (decode) and
``bench_prefill`` (room for 4,000 tokens) build them, 2 ONNX Runtime threads.

Decode: the same random 32-token prompts to both, ``--gen`` tokens each with EOS ignored; rate =
tokens after the first / time after the first, summed over the batch. Prefill: one random prompt
per round and length (no prefix cached), one greedy token. Rounds interleave every measurement;
figures are medians over rounds, each ratio the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import time
from pathlib import Path

import numpy as np

from .common import machine

PAIRS = {"int8": "Q8_0", "int4-awq": "Q4_K_M"}  # our precision: llama.cpp's of the same bit width
CONTEXT, SEQUENCES = 8192, 8


class LlamaRunner:
    """One GGUF in a llama.cpp context: prefill and greedy decode of up to ``SEQUENCES`` sequences."""

    def __init__(self, path: Path, threads: int):
        import llama_cpp as lc

        self.lc = lc
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = CONTEXT, 2048, 512, SEQUENCES
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one pool of CONTEXT cells for all sequences (a long prompt may take most)
        self.ctx = lc.llama_init_from_model(self.model, params)
        if not self.model or not self.ctx:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(2048, 0, SEQUENCES)

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """(token, position, sequence, wants logits) entries, at most ``n_batch`` a call."""
        b = self.batch
        for start in range(0, len(tokens), 2048):
            part = tokens[start:start + 2048]
            for i, (tok, pos, seq, out) in enumerate(part):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
                b.seq_id[i][0] = seq
            b.n_tokens = len(part)
            if self.lc.llama_decode(self.ctx, b) != 0:
                raise SystemExit("llama_decode failed (context full?)")

    def _argmax(self, i: int) -> int:
        row = self.lc.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (self.vocab,)).argmax())

    def generate(self, prompts: np.ndarray, gen: int) -> list[float]:
        """Greedy ``gen`` tokens after each prompt (a row); the time of each step's tokens."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)
        batch, plen = prompts.shape
        entries = [(int(prompts[s, p]), p, s, p == plen - 1) for s in range(batch) for p in range(plen)]
        if batch > 1 and len(entries) > 2048:
            raise ValueError("several prompts must fit one llama_decode call (2,048 tokens) together")
        self._decode(entries)
        last = [self._argmax(s * plen + plen - 1) if batch > 1 else self._argmax(-1) for s in range(batch)]
        times = [time.perf_counter()]
        for step in range(1, gen):
            self._decode([(last[s], plen + step - 1, s, True) for s in range(batch)])
            last = [self._argmax(s) for s in range(batch)]
            times.append(time.perf_counter())
        return times

    def ttft(self, prompt: np.ndarray) -> float:
        t = time.perf_counter()
        self.generate(prompt[None], 1)
        return time.perf_counter() - t


def llama_rate(runner: LlamaRunner, prompts: np.ndarray, gen: int) -> float:
    times = runner.generate(prompts, gen)
    return prompts.shape[0] * (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--tokens", default="1000,4000")
    args = ap.parse_args()
    from .peer_accuracy import gguf, install_llamacpp

    install_llamacpp()
    import llama_cpp

    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # its log callback prints below this level

    from autoglm_trt.fileutil import library_versions
    from autoglm_trt.runtime import Engine

    from .bench_genai import decode_rounds
    from .bench_genai_prefill import ttft_rows
    from .bench_prefill import ensure
    from .bench_runtime import ensure_engine

    llama_cpp.llama_backend_init()
    theirs = {p: LlamaRunner(gguf(f), 2) for p, f in PAIRS.items()}
    decoders = {p: Engine.load(ensure_engine(p), threads=2) for p in PAIRS}
    print(machine(), flush=True)
    rounds = decode_rounds("llama", lambda p, prompts: llama_rate(theirs[p], prompts, args.gen), decoders,
                           args.prompt_len, args.gen, args.rounds)
    for e in decoders.values():
        e.close()
    for p, f in PAIRS.items():
        for b in (1, 8):
            row = {"decode": f"{p} vs {f}", "batch": b, "tokens_per_s": {
                side: round(float(np.median([r[f"{side}_{p}_b{b}"] for r in rounds])), 1) for side in ("ours", "llama")},
                "ours_vs_llama": round(float(np.median([r[f"ours_{p}_b{b}"] / r[f"llama_{p}_b{b}"] for r in rounds])), 2)}
            print(json.dumps(row), flush=True)
    prefills = {p: Engine.load(ensure(p), threads=2) for p in PAIRS}
    for row in ttft_rows("llama", lambda p, prompt: theirs[p].ttft(prompt), prefills,
                         [int(t) for t in args.tokens.split(",")], args.rounds, np.random.default_rng(1), "prefill_tokens"):
        print(json.dumps(row), flush=True)
    for e in prefills.values():
        e.close()
    for r in theirs.values():
        r.close()
    print(", ".join(f"{k} {v}" for k, v in library_versions("llama-cpp-python", "onnxruntime").items()))
    print("llama.cpp: " + llama_cpp.llama_print_system_info().decode().strip())


if __name__ == "__main__":
    main()
