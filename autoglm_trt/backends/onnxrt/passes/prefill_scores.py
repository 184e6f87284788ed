"""Prefill attention's scores in the layout the mask and Softmax read, and its softmax as one
node, for ONNX Runtime.

The engine graph computes a layer's prefill scores key by key (``MatMul(keys, queries^T)``, once
over the past and once over the new tokens), joins the two along the keys, and transposes the
result to [..., query, key] for the mask and Softmax: over a 1,000-token prompt that transpose
alone moves 36 MB a layer. Here each score ``MatMul`` becomes ``com.microsoft.FusedMatMul(queries,
keys, transB=1)``, whose output is already [..., query, key], the two join along the last axis,
and the transpose goes. Each score is the same sum of the same products in the same order (ONNX
Runtime's GEMM adds a head's 64 products as one chain of fused multiply-adds from zero, whichever
operand holds the queries), so scores and logits are the graph's bit for bit: checked on the
SmolLM2 engines over prompts of 1,000, 300 + 120 and 17 + 5 + 2 tokens, and chunks after a past,
and by ``tests/native/test_prefill_scores.py`` on the tiny engines. A 1,000-token prefill measured
faster this way on the SmolLM2 INT8 and fp32 engines, and faster again with ``MaskedSoftmax``
(below) too (docs/benchmarks.md, "A prefill's attention, every way", times one layer's forms).

Where the native library's ``MaskedSoftmax`` repeats ONNX Runtime's Softmax bit for bit (an
AVX-512F build, ``csrc/masked_softmax.c``), the join, the mask ``Add``, the ``Softmax`` and the two
``Slice`` nodes that split the probabilities back into past and new become that one node, which
reads the two score blocks and the mask once and writes the two parts once: the same bits again
(the same SmolLM2 prefills, and ``tests/test_masked_softmax.py`` against ONNX Runtime's
own nodes).

Only the prefill branch of ``attention.rewrite`` takes this form: its steps have two or more
new tokens, while a one-row product may take one of ONNX Runtime's other GEMM kernels, whose
order was not checked.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ....graph import names
from .common import DOMAIN as NATIVE
from .common import MICROSOFT

DOMAIN, NATIVE_DOMAIN = MICROSOFT, NATIVE


def by_row(nodes: list[onnx.NodeProto], i: int, softmax: bool = False) -> list[onnx.NodeProto]:
    """Layer ``i``'s prefill attention ``nodes`` with its scores computed query by query, and with
    ``softmax`` (a library whose ``MaskedSoftmax`` gives Softmax's bits) the join, mask, Softmax
    and split as that one node; the nodes unchanged where they are not the graph's
    ``layers.<i>.q_t`` ... ``layers.<i>.scores``."""
    p = names.layer(i) + "."
    producer = {o: n for n in nodes for o in n.output}
    q_t, new, past, joined, scores = (producer.get(p + name) for name in
                                      (names.Q_T, names.SCORES_NEW, names.SCORES_PAST, names.SCORES_T, names.SCORES))
    if q_t is None or new is None or past is None or joined is None or scores is None:
        return nodes
    perm = [list(a.ints) for a in q_t.attribute if a.name == "perm"]
    readers = [n for n in nodes if q_t.output[0] in n.input]
    if (q_t.op_type, new.op_type, past.op_type, joined.op_type, scores.op_type) != \
            ("Transpose", "MatMul", "MatMul", "Concat", "Transpose") or perm != [[2, 0, 3, 4, 1]] or \
            [a.i for a in joined.attribute if a.name == "axis"] != [3] or list(new.input[1:]) != [q_t.output[0]] or \
            list(past.input[1:]) != [q_t.output[0]] or list(joined.input) != [past.output[0], new.output[0]] or \
            list(scores.input) != [joined.output[0]] or len(readers) != 2:
        return nodes
    rows = p + "q_rows"  # [Hkv, B, G, T, D]: the queries, one row each
    replaced = {
        id(q_t): helper.make_node("Transpose", [q_t.input[0]], [rows], name=p + "q_rows", perm=[2, 0, 3, 1, 4]),
        id(past): helper.make_node("FusedMatMul", [rows, past.input[0]], [p + "scores_past_rows"],
                                   name=p + "scores_past_rows", domain=DOMAIN, alpha=1.0, transA=0, transB=1),
        id(new): helper.make_node("FusedMatMul", [rows, new.input[0]], [p + "scores_new_rows"],
                                  name=p + "scores_new_rows", domain=DOMAIN, alpha=1.0, transA=0, transB=1),
        id(joined): helper.make_node("Concat", [p + "scores_past_rows", p + "scores_new_rows"], [scores.output[0]],
                                     name=p + "scores", axis=4),
    }
    out = [replaced.get(id(n), n) for n in nodes if n is not scores]
    return _masked_softmax(out, p) if softmax else out


def _masked_softmax(nodes: list[onnx.NodeProto], p: str) -> list[onnx.NodeProto]:
    """``nodes`` with the join of the score blocks (``<p>scores``), the mask ``Add``, the
    ``Softmax`` and the two ``Slice`` nodes back into past and new as one ``MaskedSoftmax``
    (``csrc/masked_softmax.c``); unchanged where they are not in that form."""
    producer = {o: n for n in nodes for o in n.output}
    joined, masked, probs, past, new = (producer.get(p + name) for name in
                                        (names.SCORES, names.MASKED, names.PROBS, names.PROBS_PAST, names.PROBS_NEW))
    if joined is None or masked is None or probs is None or past is None or new is None:
        return nodes

    def readers(name: str) -> list[onnx.NodeProto]:
        return [n for n in nodes if name in n.input]

    if (joined.op_type, masked.op_type, probs.op_type, past.op_type, new.op_type) != \
            ("Concat", "Add", "Softmax", "Slice", "Slice") or \
            [a.i for a in probs.attribute if a.name == "axis"] not in ([-1], [4]) or \
            masked.input[0] != joined.output[0] or list(probs.input) != [masked.output[0]] or \
            readers(joined.output[0]) != [masked] or readers(masked.output[0]) != [probs] or \
            {id(n) for n in readers(probs.output[0])} != {id(past), id(new)} or \
            past.input[0] != probs.output[0] or new.input[0] != probs.output[0] or \
            past.input[2] != new.input[1] or past.input[3:] != new.input[3:]:
        return nodes
    fused = helper.make_node("MaskedSoftmax", [*joined.input, masked.input[1]], [past.output[0], new.output[0]],
                             name=p + "masked_softmax", domain=NATIVE_DOMAIN)
    first = next(n for n in nodes if n is past or n is new)  # before every reader of either part
    gone = {id(n) for n in (joined, masked, probs, past, new)} - {id(first)}
    return [fused if n is first else n for n in nodes if id(n) not in gone]
