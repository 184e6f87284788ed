#!/usr/bin/env python3
"""Long prompts: the time to the first token of a fresh 1,000- and 4,000-token prompt on SmolLM2's
fp32 and int8 engines, and the int8 engine again with Intel AMX turned off (``AUTOGLM_TRT_AMX=0``,
where this CPU has AMX): the AVX-512 VNNI kernel other CPUs run.

    python -m benchmarks.bench_prefill [--rounds 3] [--tokens 1000,4000]

Engines with room for the longest prompt (``max_seq_len`` 4,352) are built first if missing, as
``engines/smollm2-<precision>-4k``. Each configuration runs in a process of its own (the AMX
switch is read once a process); every round starts each process in turn, which warms up on one
prompt and then times one new prompt of each length (random ids, so nothing is cached). Each
figure is the median over rounds, each ratio the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from .common import ROOT, machine

MAX_SEQ_LEN = 4352
SMOL = ROOT / "models" / "smollm2-135m"

CHILD = """
import json, sys
import numpy as np
from autoglm_trt.runtime import Engine, SamplingParams
engine, seed, lengths = Engine.load(sys.argv[1]), int(sys.argv[2]), [int(t) for t in sys.argv[3].split(",")]
rng = np.random.default_rng(seed)
one = lambda n: engine.generate([rng.integers(100, engine.spec.vocab_size, n).tolist()],
                                SamplingParams(max_new_tokens=1))[0].ttft
one(lengths[0])
print(json.dumps({str(n): 1000 * one(n) for n in lengths}))
engine.close()
"""


def ensure(precision: str) -> Path:
    out = ROOT / "engines" / f"smollm2-{precision}-4k"
    if not (out / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "autoglm_trt", "build", str(SMOL), "--precision", precision,
                        "--backend", "onnxruntime", "--max-seq-len", str(MAX_SEQ_LEN), "-o", str(out)], check=True,
                       stdout=sys.stderr)  # the build's log is not the benchmark's output
    return out


def amx_here() -> bool:
    from autoglm_trt.native import int8_amx, library

    path, _ = library()
    return path is not None and int8_amx(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", default="1000,4000")
    args = ap.parse_args()
    lengths = [int(t) for t in args.tokens.split(",")]
    if max(lengths) >= MAX_SEQ_LEN:
        raise SystemExit(f"--tokens: each length must be below {MAX_SEQ_LEN}")
    engines = {"fp32": ensure("fp32"), "int8": ensure("int8")}
    configs = {"fp32": (engines["fp32"], {}), "int8": (engines["int8"], {})}
    if amx_here():
        configs["int8 without AMX"] = (engines["int8"], {"AUTOGLM_TRT_AMX": "0"})
    ms: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, (engine, env) in configs.items():
            done = subprocess.run([sys.executable, "-c", CHILD, str(engine), str(r), args.tokens], capture_output=True,
                                  text=True, check=True, env={**os.environ, **env}, cwd=ROOT)
            ms[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for n in map(str, lengths):
        row = {"tokens": int(n), **{f"{name} ms": round(float(np.median([m[n] for m in ms[name]])), 1) for name in ms}}
        row["fp32 / int8"] = round(float(np.median([f[n] / i[n] for f, i in zip(ms["fp32"], ms["int8"])])), 3)
        if "int8 without AMX" in ms:
            row["int8 without AMX / int8"] = round(float(np.median(
                [a[n] / i[n] for a, i in zip(ms["int8 without AMX"], ms["int8"])])), 3)
        print(json.dumps(row), flush=True)
    print(machine() + ("" if "int8 without AMX" in ms else " (no AMX here: the int8 engine ran AVX-512 VNNI or less)"))


if __name__ == "__main__":
    main()
