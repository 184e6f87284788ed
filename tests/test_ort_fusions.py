"""The load-time fusion of residual Add + RMSNorm for ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx

from autoglm_trt.artifacts import Manifest
from autoglm_trt.backends.onnxrt.fusions import skip_rms_norm
from autoglm_trt.graph.paged_kv import KVPools, SeqState, step_inputs
from autoglm_trt.graph.session import make_session


def test_residual_add_and_rms_norm_become_one_node_with_the_same_outputs(tiny_engine):
    manifest = Manifest.read(tiny_engine)
    spec = manifest.spec
    plain = onnx.load(str(manifest.engine_path), load_external_data=False)
    fused = onnx.load(str(manifest.engine_path), load_external_data=False)
    norms = sum(n.op_type == "SimplifiedLayerNormalization" for n in plain.graph.node)
    # every layer's MLP norm reads attn_residual, every layer's input norm but the first reads
    # the previous mlp_residual; the final norm reads the gathered last tokens
    assert skip_rms_norm(fused) == 2 * spec.num_layers - 1
    ops = [n.op_type for n in fused.graph.node]
    assert ops.count("SkipSimplifiedLayerNormalization") == 2 * spec.num_layers - 1
    assert ops.count("SimplifiedLayerNormalization") == norms - (2 * spec.num_layers - 1)
    pools = KVPools(spec.num_layers, 8, manifest.kv["block_size"], spec.num_kv_heads, spec.head_dim)
    pools.data[:] = np.random.default_rng(0).standard_normal(pools.data.shape, np.float32)
    feeds, _ = step_inputs([[3, 5, 7, 9], [11]], [SeqState(5, [0, 1]), SeqState(9, [2, 3])],
                           manifest.kv["block_size"])
    feeds.update(pools.feeds())
    outputs = []
    for model in (plain, fused):
        session = make_session(model.SerializeToString(), threads=1, external_data_dir=manifest.dir)
        outputs.append(session.run(None, feeds))
    for a, b in zip(*outputs):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
