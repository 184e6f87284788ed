#!/usr/bin/env python3
"""Serving under attack: the load test with crafted clients beside well-behaved streams, on a text
engine and an image-text engine, each against the same load alone.

    python -m benchmarks.bench_hardening [--engine engines/smollm2-int8] [--attackers 2]

Starts ``autoglm-trt serve`` on SmolLM2's INT8 engine, then on the small GLM-4.1V engine of
``bench_encode_overlap`` (SmolLM2's decoder shape, the small vision tower, int8-wo; a third of
its requests carry a 270 x 600 screenshot), and runs ``tools/load_test.py --quiet-first
--attackers N`` against each (bodies of at most 8 MiB): the well-behaved load alone, then with N clients sending image
bombs (image engine), a 240 KB grammar with n = 8, 16 stop strings of 1,024 characters, and
non-streamed n = 4 requests they leave. Prints each report (JSON) and a table: the well-behaved
streams' inter-token latency quiet and attacked, the attacks' statuses, the server's resident
memory, the engine loop's longest hold, and whether the load test's checks passed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .common import ROOT, machine

BODY_LIMIT = 8 << 20  # the server's and the load test's (its oversized bodies are just past it)


def serve(engine: Path, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(engine), "--port", str(port),
                             "--max-body-bytes", str(BODY_LIMIT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"serve {engine} exited with {proc.returncode}") from None
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"serve {engine} did not become ready")


def load(engine: Path, extra: list[str]) -> tuple[dict, int, list[str]]:
    from autoglm_trt.fileutil import free_port

    port = free_port()
    proc = serve(engine, port)
    try:
        out = subprocess.run([sys.executable, str(ROOT / "tools" / "load_test.py"), "--url", f"http://127.0.0.1:{port}",
                              "--quiet-first", "--max-body-bytes", str(BODY_LIMIT), *extra], capture_output=True,
                             text=True, timeout=3600)
    finally:
        proc.terminate()
        proc.wait(60)
    lines = out.stdout.splitlines()
    report = next((json.loads(line) for line in lines if line.startswith("{")), {})
    return report, out.returncode, [line for line in lines if line.startswith("FAIL")] + out.stderr.splitlines()[-5:]


def main() -> None:
    from .bench_encode_overlap import engine as glm4v_engine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", type=Path, default=ROOT / "engines" / "smollm2-int8")
    ap.add_argument("--glm4v-work", type=Path, default=ROOT / "engines" / "bench-glm4v-overlap")
    ap.add_argument("--attackers", type=int, default=2)
    args = ap.parse_args()
    runs = {
        "SmolLM2-135M int8": (args.engine, ["--requests", "240", "--concurrency", "16", "--gen-len", "48"]),
        "small GLM-4.1V int8-wo": (glm4v_engine(args.glm4v_work),
                                   ["--requests", "48", "--concurrency", "4", "--gen-len", "32", "--image", "270x600",
                                    "--image-share", "0.33"]),
    }
    rows = []
    for name, (engine, extra) in runs.items():
        report, code, fails = load(engine, [*extra, "--attackers", str(args.attackers)])
        print(f"{name}: {json.dumps(report)}")
        for line in fails:
            print(f"  {line}")
        quiet = report.get("quiet", {})
        attacks = "; ".join(f"{k} {v}" for k, v in report.get("attacks", {}).items())
        rows.append(f"| {name} | {quiet.get('itl_ms_p50')} / {quiet.get('itl_ms_p99')} | {report.get('itl_ms_p50')} / "
                    f"{report.get('itl_ms_p99')} | {report.get('itl_p99_over_quiet')}x | {attacks} | "
                    f"{report.get('statuses')} | {report.get('server_rss_mb')} | {report.get('loop_longest_hold_ms')} | "
                    f"{'passed' if code == 0 else 'FAILED'} |")
    print(f"\n{args.attackers} attackers beside the well-behaved streams; {machine()}")
    print("| engine | ITL ms p50 / p99 alone | with attackers | p99 ratio | attacks: statuses | well-behaved statuses "
          "| server RSS MB before / after | loop's longest hold, ms | load test checks |")
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
