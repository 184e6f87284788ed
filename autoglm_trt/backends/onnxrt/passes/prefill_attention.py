"""A prefill's attention as one native ``PrefillAttention`` node (``csrc/prefill_attention.c``).

The graph's prefill attention (``graph/decoder.py``) writes each layer's scores over the past and
the new keys, joins them, adds the mask bias, takes the softmax, splits it and multiplies the two
parts by the past and new values: a [heads, tokens, context] tensor written and read back several
times a layer (36 MB a layer over a 1,000-token SmolLM2 prompt, and 16 times that over 4,000).
The operator computes the same attention with an online softmax (FlashAttention's), a block of
keys at a time, and skips the blocks the mask hides from a whole block of queries (a causal
prefill's upper triangle). Its sums run in another order than the graph's, so the native prefill
equals the plain graph's to float32's rounding, not bit for bit.

Only the prefill branch of ``attention.rewrite`` takes it, where the library has fused
multiply-add and the head size is a multiple of 64 (the kernel's vectors of values); elsewhere the
branch keeps the graph's attention with ``prefill_scores.by_row``.

``PrefillAttentionBf16`` (the same inputs) computes the two products in bfloat16 on Intel AMX where
the CPU has it, and is PrefillAttention elsewhere. The build gives it to the engines whose
activations are rounded to 8 bits anyway (``int8``, ``int8-dyn``, ``int4-awq``:
``builder.pipeline``), whose answers it does not move beyond their own quantization's noise
(docs/benchmarks.md, "Accuracy of the bfloat16 prefill attention"); ``fp32`` and ``int8-wo``, the
engines meant to answer as fp32 does, keep float32.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ....graph import names
from .common import DOMAIN, live_nodes

OP = "PrefillAttention"
BF16_OP = "PrefillAttentionBf16"


def fuse(nodes: list[onnx.NodeProto], i: int, output: str, bf16: bool = False) -> list[onnx.NodeProto] | None:
    """Layer ``i``'s prefill attention ``nodes`` (the branch's, whose result is ``output``) with
    the queries' transpose ... the weighted values' sum as one ``PrefillAttention`` node
    (``PrefillAttentionBf16`` with ``bf16``) and the nodes only they read gone; None where the
    nodes are not the graph's ``layers.<i>.q_t`` ... ``layers.<i>.context``."""
    p = names.layer(i) + "."
    producer = {o: n for n in nodes for o in n.output}
    q_t, past, new, masked, probs, context = (producer.get(p + name) for name in (
        names.Q_T, names.SCORES_PAST, names.SCORES_NEW, names.MASKED, names.PROBS, "context"))
    if q_t is None or past is None or new is None or masked is None or probs is None or context is None:
        return None
    ctx_past, ctx_new = (producer.get(x) for x in context.input) if len(context.input) == 2 else (None, None)
    if ctx_past is None or ctx_new is None:
        return None
    perm = [list(a.ints) for a in q_t.attribute if a.name == "perm"]
    if (q_t.op_type, past.op_type, new.op_type, masked.op_type, probs.op_type, context.op_type, ctx_past.op_type,
            ctx_new.op_type) != ("Transpose", "MatMul", "MatMul", "Add", "Softmax", "Add", "MatMul", "MatMul") or \
            perm != [[2, 0, 3, 4, 1]] or list(past.input[1:]) != [q_t.output[0]] or \
            list(new.input[1:]) != [q_t.output[0]] or masked.input[0] != p + names.SCORES or \
            list(probs.input) != [masked.output[0]] or ctx_past.input[0] != p + names.PROBS_PAST or \
            ctx_new.input[0] != p + names.PROBS_NEW:
        return None
    inputs = [q_t.input[0], past.input[0], new.input[0], ctx_past.input[1], ctx_new.input[1], masked.input[1]]
    node = helper.make_node(BF16_OP if bf16 else OP, inputs, [context.output[0]], name=p + "prefill_attention",
                            domain=DOMAIN)
    return live_nodes([node if n is context else n for n in nodes], {output})

