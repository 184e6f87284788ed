"""Prefill attention's scores computed query by query, and its join + mask + Softmax + split as
one ``MaskedSoftmax`` (``passes/prefill_scores.py``): the graph's bits, in fewer passes over the scores."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import step_all

from autoglm_trt.kvcache.step_inputs import SeqState


def _runner(engine_dir, by_row: bool, monkeypatch):
    from conftest import rewritten_runner

    from autoglm_trt.backends.onnxrt.passes import prefill_scores

    with monkeypatch.context() as m:
        if not by_row:
            m.setattr(prefill_scores, "by_row", lambda nodes, i, softmax=False: nodes)
        return rewritten_runner(engine_dir, threads=2)


@pytest.mark.parametrize("engine", ["tiny_engine", "tiny_int8_engine", "int8_kv_engine"])
def test_scores_by_row_give_the_graphs_logits_and_kv_bit_for_bit(engine, library, monkeypatch, request):
    """Prefill of two prompts (11 and 3 tokens), a second prefill of both over their past (4 and
    6 more tokens: scores over past and new keys), then a decode step: every step's logits and
    the K/V written back equal those of the graph's own key-by-key scores exactly (float32
    weights, INT8 weights, an INT8 KV cache)."""
    engine_dir = request.getfixturevalue(engine)
    runners = [_runner(engine_dir, by_row, monkeypatch) for by_row in (True, False)]
    states = [[SeqState(0, [0, 1]), SeqState(0, [2, 3])] for _ in runners]
    for new in ([[5, 9, 3, 7, 11, 2, 8, 4, 6, 10, 1], [12, 14, 13]], [[3, 1, 4, 1], [5, 9, 2, 6, 5, 3]], [[7], [8]]):
        np.testing.assert_array_equal(*step_all(runners, states, new))
        np.testing.assert_array_equal(runners[0].pools.data, runners[1].pools.data)
    for r in runners:
        r.close()


def test_the_prefill_branch_computes_scores_by_row_and_decode_is_untouched(tiny_engine, library):
    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt import passes
    from autoglm_trt.native import softmax_exact

    manifest = Manifest.read(tiny_engine)
    model = passes.rewrite(manifest.engine_path, manifest.spec, np.float32, passes.Target.here(), pack=False).model
    step = next(n for n in model.graph.node if n.op_type == "If")
    branches = {a.name: a.g.node for a in step.attribute}
    prefill, decode = branches["else_branch"], branches["then_branch"]
    layers = manifest.spec.num_layers
    assert [n.op_type for n in prefill].count("FusedMatMul") == 2 * layers
    perms = [list(a.ints) for n in prefill if n.op_type == "Transpose" for a in n.attribute if a.name == "perm"]
    assert [0, 1, 2, 4, 3] not in perms and perms.count([2, 0, 3, 1, 4]) == layers
    assert "FusedMatMul" not in [n.op_type for n in decode]
    ops = [n.op_type for n in prefill]
    if softmax_exact(library):  # join, mask, Softmax and split: one node a layer
        assert ops.count("MaskedSoftmax") == layers and "Softmax" not in ops
        assert not [n for n in prefill if n.op_type == "Slice" and n.output[0].endswith((".probs_past", ".probs_new"))]
    else:
        assert "MaskedSoftmax" not in ops and ops.count("Softmax") == layers


def test_a_layer_not_in_the_expected_form_is_left_alone(tiny_engine):
    import onnx

    from autoglm_trt.artifacts import Manifest
    from autoglm_trt.backends.onnxrt.passes.prefill_scores import by_row

    model = onnx.load(str(Manifest.read(tiny_engine).engine_path), load_external_data=False)
    nodes = list(model.graph.node)
    assert any(n.op_type == "FusedMatMul" for n in by_row(nodes, 0))  # the engine graph's own form: rewritten
    for n in nodes:
        for a in n.attribute if n.output[0] == "layers.0.scores_t" else []:
            a.i = 2  # joined along another axis: not the form this rewrite knows
    assert by_row(nodes, 0) == nodes
