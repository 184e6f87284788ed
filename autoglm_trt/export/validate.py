"""Parity of an exported graph with the transformers reference model.

Input: an export directory and the checkpoint it came from. Output: a report (a dict) with
the largest |logit difference| and argmax agreement, for two paths through the graph:

* ``prefill``: all prompts in one padded batch, logits at every position;
* ``decode``: all prompts fed one token per step, batched, through a paged KV cache
  (block size 16, block ids interleaved between sequences), compared at every position.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..backends.onnxrt.offline import text_only
from ..backends.onnxrt.session import make_session, run
from ..errors import ValidationError
from ..kvcache.block_pool import BlockPool
from ..kvcache.host_pools import KVPools
from ..kvcache.layout import blocks_needed
from ..kvcache.step_inputs import SeqState, step_inputs
from ..model.reference import hf_logits
from ..model.spec import ModelSpec

VALIDATION_TEXTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric "
    "effect, on Brownian motion, on special relativity, and on the equivalence of mass and energy.",
)
RANDOM_LENGTHS = (3, 17, 40)
BLOCK_SIZE = 16


def default_tolerance(dtype: str) -> float:
    return 1e-2 if dtype == "float32" else 0.25


def validation_prompts(checkpoint: Path, spec: ModelSpec, seed: int = 0) -> list[list[int]]:
    """Tokenized fixed texts when the checkpoint has a tokenizer, else seeded random ids."""
    if (checkpoint / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
        prompts = [tok.encode(t).ids for t in VALIDATION_TEXTS]
        if all(prompts):
            return prompts
    rng = np.random.default_rng(seed)
    return [rng.integers(0, spec.vocab_size, n).tolist() for n in RANDOM_LENGTHS]


def reference_logits(checkpoint: Path, prompts: list[list[int]], allow_pickle: bool = False) -> list[np.ndarray]:
    """transformers' float32 logits at every position of every prompt (each run alone)."""
    run_hf = hf_logits(checkpoint, allow_pickle)
    return [run_hf(np.asarray([ids], np.int64))[0] for ids in prompts]


def paged_decode_logits(session, spec: ModelSpec, prompts: list[list[int]], kv_dtype: str) -> list[np.ndarray]:
    """Logits at every position, one token per step for all prompts at once, via the pool."""
    total_blocks = sum(blocks_needed(len(p), BLOCK_SIZE) for p in prompts) + 1
    alloc = BlockPool(total_blocks, caching=False)
    alloc.allocate(1)  # keep block 0 unused so that a wrong table would read zeros, not data
    pools = KVPools(spec.num_layers, total_blocks, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, kv_dtype)
    states = [SeqState() for _ in prompts]
    out = [np.zeros((len(p), spec.vocab_size), np.float32) for p in prompts]
    for pos in range(max(len(p) for p in prompts)):
        active = [b for b, p in enumerate(prompts) if pos < len(p)]
        for b in active:  # grow block tables in step order: ids interleave between sequences
            if len(states[b].block_table) * BLOCK_SIZE < pos + 1:
                got = alloc.allocate(1)
                assert got is not None
                states[b].block_table += got
        feeds, slots = step_inputs([[prompts[b][pos]] for b in active], [states[b] for b in active], BLOCK_SIZE,
                                   **text_only(spec, len(active)))
        res = run(session, {**feeds, **pools.feeds()})
        pools.write(res, slots)
        for j, b in enumerate(active):
            out[b][pos] = res["logits"][j, 0]
            states[b].num_computed_tokens += 1
    return out


def prefill_logits(session, spec: ModelSpec, prompts: list[list[int]], kv_dtype: str) -> list[np.ndarray]:
    """Logits at every position of every prompt, all prompts in one padded prefill step."""
    pools = KVPools(spec.num_layers, 1 + sum(blocks_needed(len(p), BLOCK_SIZE) for p in prompts), BLOCK_SIZE,
                    spec.num_kv_heads, spec.head_dim, kv_dtype)
    alloc = BlockPool(pools.num_blocks, caching=False)
    states = []
    for p in prompts:
        table = alloc.allocate(blocks_needed(len(p), BLOCK_SIZE))
        assert table is not None
        states.append(SeqState(0, table))
    feeds, _ = step_inputs(prompts, states, BLOCK_SIZE, all_logits=True, **text_only(spec, len(prompts)))
    logits = run(session, {**feeds, **pools.feeds()})["logits"]
    return [logits[b, : len(p)] for b, p in enumerate(prompts)]


def compare(ref: np.ndarray, got: np.ndarray, tol: float) -> dict:
    """max |diff|, argmax agreement, and argmax mismatches that are not near-ties of the reference."""
    diff = float(np.max(np.abs(ref - got)))
    ref_top = np.argmax(ref, axis=-1)
    agree = ref_top == np.argmax(got, axis=-1)
    top2 = np.sort(ref, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]
    real_mismatches = int(np.sum(~agree & (gap > 2 * tol)))
    return {"max_abs_diff": diff, "positions": int(agree.size), "argmax_agree": int(agree.sum()),
            "argmax_mismatch_not_near_tie": real_mismatches}


def validate_export(export_dir: Path, checkpoint: Path, spec: ModelSpec, kv_dtype: str, tolerance: float,
                    allow_pickle: bool = False, log=print) -> dict:
    """Run the parity check; raise ``ValidationError`` with the report when it fails."""
    prompts = validation_prompts(checkpoint, spec)
    log(f"validating against transformers on {len(prompts)} prompts of lengths {[len(p) for p in prompts]}")
    ref = reference_logits(checkpoint, prompts, allow_pickle)
    session = make_session(export_dir / "model.onnx")
    pre = prefill_logits(session, spec, prompts, kv_dtype)
    dec = paged_decode_logits(session, spec, prompts, kv_dtype)
    report: dict = {
        "tolerance": tolerance,
        "prompt_lengths": [len(p) for p in prompts],
        "prefill": compare(np.concatenate(ref), np.concatenate(pre), tolerance),
        "decode": compare(np.concatenate(ref), np.concatenate(dec), tolerance),
    }
    worst = max(report["prefill"]["max_abs_diff"], report["decode"]["max_abs_diff"])
    bad_argmax = report["prefill"]["argmax_mismatch_not_near_tie"] + report["decode"]["argmax_mismatch_not_near_tie"]
    report["max_abs_diff"] = worst
    report["passed"] = bool(worst <= tolerance and bad_argmax == 0)
    log(f"parity: max |Δlogit| {worst:.3g} (tolerance {tolerance:g}), argmax agreement "
        f"{report['decode']['argmax_agree']}/{report['decode']['positions']} positions")
    if not report["passed"]:
        raise ValidationError(
            f"exported graph does not match transformers: max |Δlogit| {worst:.4g} > tolerance {tolerance:g} "
            f"or {bad_argmax} argmax mismatches that are not near-ties. Report: {report}"
        )
    return report
