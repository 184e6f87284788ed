#!/usr/bin/env python3
"""Whether an engine answers the demo question as its float32 model does, token for token.

    python tools/demo_answer.py ENGINE [--prompt "..."] [--max-new-tokens 32] [--check]

Asks ENGINE the question as a chat (greedy), asks transformers' float32 model of the checkpoint the
engine was built from (its manifest's ``source``) the same, and prints both answers and whether
they are the same tokens. ``make engine`` runs it after building. The default question is one
SmolLM2-135M is sure of: its float32 model's greedy answer leads the runner-up by at least
0.9 nats at every token, where 8-bit rounding moves a logit by a few hundredths (a question whose
first token wins by 0.08 nats, as "What is the capital of France?" does, is a coin toss for any
quantized engine). ``--check``: exit 1 when the answers differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEMO_PROMPT = "What is the capital of Japan?"


def float_answer(checkpoint: Path, prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' float32 greedy answer's token ids (EOS dropped) to ``prompt`` as a user message."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()

    tok = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False)
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [t for t in out[0, len(ids):].tolist() if t not in eos]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--prompt", default=DEMO_PROMPT)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--check", action="store_true", help="exit 1 when the answers differ")
    args = ap.parse_args()
    from autoglm_trt import native
    from autoglm_trt.runtime import Engine, SamplingParams

    lib, why = native.library()
    how = f"native library: the {native.variant_of(lib)} build" if lib is not None else f"no native library: {why}"

    manifest = json.loads((args.engine / "manifest.json").read_text())
    with Engine.load(args.engine) as engine:
        [res] = engine.generate([[{"role": "user", "content": args.prompt}]],
                                SamplingParams(max_new_tokens=args.max_new_tokens))
        ref = float_answer(Path(manifest["source"]["path"]), args.prompt, args.max_new_tokens)
        ref_text = engine.tokenizer.decode(ref)
    same = list(res.token_ids) == ref
    print(f"question: {args.prompt}")
    print(f"{manifest['precision']} engine: {res.text}" + (f" ({how})" if how else ""))
    print(f"float32 model (transformers): {ref_text}")
    print("the same answer, token for token" if same else "a different answer from the float32 model's")
    return 1 if args.check and not same else 0


if __name__ == "__main__":
    sys.exit(main())
