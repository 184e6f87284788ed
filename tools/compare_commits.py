#!/usr/bin/env python3
"""This tree's runtime against an earlier commit's, on this machine, in alternating processes.

    python -m tools.compare_commits --base d4f7336 [--pairs 4] [--gen 96] [--keep]   # from the repository root

Rates from one process to the next on these shared machines move by 10-20%, and so does the
same code's rate between two processes, so each side runs in processes of its own, one after
the other: base, this tree, base, this tree, ... (``--pairs`` pairs). The base commit is checked
out in a git worktree (``engines/.cache/compare-<commit>``, removed at the end unless
``--keep``) and builds its own SmolLM2 fp32 and INT8 engines with its own code (a few
minutes, the first time); this tree uses those of ``benchmarks/bench_runtime.py`` (built if
missing). Each process measures, through the public runtime API only:
- batch-1 decode rate after a chat prompt (tokens after the first / time after the first,
  ``--gen`` new tokens, the median of 3),
- the aggregate rate of 16 concurrent requests (48-token random prompts, 64 new tokens each,
  the median of 2),
for the INT8 and the fp32 engine. Prints each pair's ratios (this tree over base), their
medians, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
KEYS = ("int8_b1", "int8_16x", "fp32_b1", "fp32_16x")


def measure(gen: int) -> dict:
    """This process's rates, with the package its PYTHONPATH names (either side's)."""
    import numpy as np

    import autoglm_trt
    from autoglm_trt.runtime import Engine, SamplingParams

    out: dict = {"package": str(Path(autoglm_trt.__file__).resolve().parent)}

    def batch1(engine) -> float:
        r = engine.generate([[{"role": "user", "content": PROMPT}]], SamplingParams(max_new_tokens=gen, ignore_eos=True))[0]
        return (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])

    def concurrent(engine, seed: int) -> float:
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(100, 40000, 48).tolist() for _ in range(16)]
        t = time.perf_counter()
        res = engine.generate(prompts, SamplingParams(max_new_tokens=64, ignore_eos=True))
        return sum(len(r.token_ids) for r in res) / (time.perf_counter() - t)

    for precision in ("int8", "fp32"):
        engine = Engine.load(f"engines/smollm2-{precision}")
        batch1(engine), concurrent(engine, 99)  # warm-up
        out[f"{precision}_b1"] = float(np.median([batch1(engine) for _ in range(3)]))
        out[f"{precision}_16x"] = float(np.median([concurrent(engine, seed) for seed in (1, 2)]))
        engine.close()
    return out


def base_tree(commit: str) -> Path:
    """A worktree of ``commit`` with the models linked in and its own engines built."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                         capture_output=True, text=True)
    if sha.returncode != 0:
        sys.exit(f"--base {commit!r} is not a commit of this repository ({sha.stderr.strip()})")
    tree = ROOT / "engines" / ".cache" / f"compare-{sha.stdout.strip()[:12]}"
    if not (tree / ".git").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(tree), commit], check=True)
    if not (tree / "models").exists():
        (tree / "models").symlink_to(ROOT / "models")
    for precision in ("int8", "fp32"):
        out = tree / "engines" / f"smollm2-{precision}"
        if not (out / "manifest.json").is_file():
            print(f"building the base's {precision} engine with its own code ...", flush=True)
            subprocess.run([sys.executable, "-m", "autoglm_trt", "build", "models/smollm2-135m", "--precision",
                            precision, "--backend", "onnxruntime", "-o", str(out)], cwd=tree, check=True)
    return tree


def side(cwd: Path, gen: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the side's own package, before the installed one
    run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--measure", "--gen", str(gen)], cwd=cwd,
                         capture_output=True, text=True, env=env)
    if run.returncode != 0:
        sys.exit(f"measuring in {cwd} failed:\n{run.stderr[-2000:]}")
    out = json.loads(run.stdout.strip().splitlines()[-1])
    if Path(out["package"]) != (cwd / "autoglm_trt").resolve():  # the side's own code, not another's
        sys.exit(f"the process in {cwd} imported {out['package']}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the earlier commit (e.g. the one an issue was filed against)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--keep", action="store_true", help="keep the base's worktree and engines")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)  # one side, in its own process
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.gen)))
        return
    if not args.base or args.pairs < 1:
        ap.error("give --base COMMIT and --pairs >= 1")
    import numpy as np

    from autoglm_trt.fileutil import cpu_model
    from benchmarks.bench_runtime import ensure_engine

    for precision in ("int8", "fp32"):
        ensure_engine(precision)
    tree = base_tree(args.base)
    ratios: dict[str, list[float]] = {k: [] for k in KEYS}
    try:
        for p in range(args.pairs):
            base, this = side(tree, args.gen), side(ROOT, args.gen)
            for k in KEYS:
                ratios[k].append(this[k] / base[k])
            print(f"pair {p + 1}/{args.pairs}: " + ", ".join(
                f"{k} {this[k]:.1f} / {base[k]:.1f} = {this[k] / base[k]:.2f}x" for k in KEYS), flush=True)
    finally:
        if not args.keep:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
            shutil.rmtree(tree, ignore_errors=True)
    print(f"cpu: {cpu_model()}; this tree over {args.base}, median of {args.pairs} pairs (tokens/s ratios):")
    for k in KEYS:
        print(f"  {k:10s} {float(np.median(ratios[k])):.2f}x  (pairs {', '.join(f'{r:.2f}' for r in ratios[k])})")


if __name__ == "__main__":
    main()
