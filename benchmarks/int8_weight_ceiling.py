#!/usr/bin/env python3
"""How close 8-bit weights can bring SmolLM2's greedy answers to fp32's: the 100 chat prompts of
``chat_agreement`` answered by transformers' float32 model with its weights rounded in several
ways (fake-quantized, so every variant runs the same arithmetic otherwise), 16 greedy tokens each,
counted against the float32 model's own answers.

    python -m benchmarks.int8_weight_ceiling [--variants NAME,...] [--gptq-windows 64]

Variants: ``int8-wo`` (int8-wo's weights: symmetric blocks of 32 inputs, each block's scale the
clip of least squared error, ``quant.int8.quantize_weight_blocks``; the LM head too), ``blocks
of 16``, ``gptq`` (GPTQ's error feedback, Frantar et al. 2022, over each linear's inputs on
``--gptq-windows`` windows of 256 calibration tokens; blocks of 32 with max-abs scales; the LM
head float), INT8 on one part of the model only (the LM head, attention, the MLPs, the first five
layers), and every weight rounded to float16 (what an fp16 engine's weights lose). One line each.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from .chat_agreement import first_difference, read_prompts
from .common import ROOT, machine

SMOL = ROOT / "models" / "smollm2-135m"
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
VARIANTS = {  # name: (which linears by name part; None: all but the LM head), block, how
    "int8-wo": ((), 32, "blocks"), "blocks of 16": ((), 16, "blocks"), "gptq": (None, 32, "gptq"),
    "LM head only": (("lm_head",), 32, "blocks"), "attention only": (ATTENTION, 32, "blocks"),
    "MLPs only": (MLP, 32, "blocks"), "layers 0-4 only": (tuple(f"layers.{i}." for i in range(5)), 32, "blocks"),
    "float16": ((), 0, "float16"),
}


def load():
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(SMOL), dtype=torch.float32).eval()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: rounded alone
    return model


def answers(model, tok, prompts: list[str], tokens: int = 16) -> list[list[int]]:
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
            done = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            out.append(done[0, ids.shape[1]:].tolist())
    return out


def blocks(w, block: int):
    """``w`` [out, in] (torch) rounded as int8-wo rounds it, dequantized."""
    import torch

    from autoglm_trt.quant.int8 import quantize_weight_blocks

    q, scale = quantize_weight_blocks(np.ascontiguousarray(w.detach().numpy().T), block)
    return torch.from_numpy((q.astype(np.float32) * np.repeat(scale, block, axis=0)[: q.shape[0]]).T.copy())


def gptq(w, h, block: int = 32, damp: float = 0.01):
    """GPTQ's rounding of ``w`` [out, in] given its inputs' ``h`` = X^T X: input by input, the rest
    of each row corrected for the rounding error through the inverse Hessian's Cholesky factor."""
    import torch

    w, h = w.detach().double().clone(), h.clone()
    dead = torch.diag(h) == 0
    h[dead, dead], w[:, dead] = 1, 0
    h += damp * torch.mean(torch.diag(h)) * torch.eye(len(h), dtype=h.dtype)
    inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    out = torch.zeros_like(w)
    for b0 in range(0, w.shape[1], block):
        scale = w[:, b0:b0 + block].abs().amax(dim=1) / 127
        scale[scale == 0] = 1
        for c in range(b0, min(b0 + block, w.shape[1])):
            out[:, c] = torch.clamp(torch.round(w[:, c] / scale), -127, 127) * scale
            err = (w[:, c] - out[:, c]) / inv[c, c]
            w[:, c + 1:] -= err[:, None] * inv[c, c + 1:][None]
    return out.float()


def hessians(model, tok, windows: int) -> dict:
    """X^T X of each decoder linear's inputs over ``windows`` windows of 256 calibration tokens."""
    import torch

    text = "\n".join(f.read_text(encoding="utf-8") for f in sorted((ROOT / "autoglm_trt" / "calib" / "data").glob("*.txt")))
    ids = tok(text, return_tensors="pt")["input_ids"][0]
    starts = np.random.default_rng(0).permutation(len(ids) // 256)[:windows] * 256
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    h = {n: torch.zeros(m.in_features, m.in_features, dtype=torch.float64) for n, m in linears.items()}

    def keep(name):
        def hook(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()
            h[name] += x.T @ x
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in linears.items()]
    with torch.no_grad():
        for s in starts:
            model(ids[s:s + 256][None])
    for handle in handles:
        handle.remove()
    return h


def rounded(name: str, tok, windows: int):
    import torch

    parts, block, how = VARIANTS[name]
    model = load()
    h = hessians(model, tok, windows) if how == "gptq" else {}
    for n, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or (parts and not any(p in n for p in parts)) or \
                (parts is None and n == "lm_head"):
            continue
        m.weight.data = (m.weight.data.half().float() if how == "float16" else
                         gptq(m.weight.data, h[n], block) if how == "gptq" else blocks(m.weight, block))
    return model


def main() -> None:
    import torch
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--gptq-windows", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(str(SMOL))
    prompts = read_prompts(ROOT / "calibration" / "eval" / "prompts.txt")[:-1]
    print(machine(), flush=True)
    reference = answers(load(), tok, prompts)
    for name in args.variants.split(","):
        got = answers(rounded(name, tok, args.gptq_windows), tok, prompts)
        diffs = [first_difference(a, b) for a, b in zip(got, reference)]
        print(json.dumps({"variant": name, "prompts": len(prompts), "same_16_tokens": sum(d is None for d in diffs),
                          "same_first_token": sum(d is None or d > 0 for d in diffs)}), flush=True)


if __name__ == "__main__":
    main()
