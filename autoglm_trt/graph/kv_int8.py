"""An INT8 KV cache, by rewriting any graph of the engine contract.

Input: an ONNX model (float32, float16 or INT8 Q/DQ) and, per layer, the calibrated max |K|
(after rope) and max |V| of each KV head. Output: the same model with int8 pools:

    new_key.<i>   QuantizeLinear(k, scale[kv_heads], axis=2) -> int8 [batch, new_tokens, kv_heads, head_dim]
    past_key.<i>  int8 [kv_heads, num_blocks, block_size, head_dim]
                  Gather by block table -> DequantizeLinear(scale[kv_heads], axis=0) -> the attention

(the same for V). Symmetric, static, per layer and per KV head (scale = amax / 127): the
explicit-quantization form TensorRT accepts. The attention over the step's own tokens keeps
their float K/V; only what goes through the pool is quantized. The rewrite touches only the
tensors named by the contract, so it applies to every graph this project writes, and the
weights (external data) are not read.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def kv_scale(amax: np.ndarray) -> np.ndarray:
    return (np.maximum(np.asarray(amax, np.float32), 1e-6) / np.float32(127.0)).astype(np.float32)


def int8_kv_graph(model: onnx.ModelProto, kv_amax: dict[str, list[float]]) -> onnx.ModelProto:
    """Rewrite ``model`` (in place, and returned) for an INT8 KV cache with the given amaxes
    (``new_key.<i>`` / ``new_value.<i>`` -> one value per KV head)."""
    g = model.graph
    compute = {o.name: o.type.tensor_type.elem_type for o in g.output}
    nodes = list(g.node)
    added_before: dict[int, list[onnx.NodeProto]] = {}
    for out_name, amax in kv_amax.items():
        kind, layer = out_name[len("new_"):].split(".")
        past = f"past_{kind}.{layer}"
        scale, zero = f"{out_name}.kv_scale", f"{out_name}.kv_zero"
        s = kv_scale(np.asarray(amax))
        g.initializer.extend([numpy_helper.from_array(s, scale), numpy_helper.from_array(np.zeros(s.shape, np.int8), zero)])
        # the producer of new_K now yields a float tensor that a QuantizeLinear turns into the output
        floating = f"{out_name}.float"
        for n in nodes:
            n.input[:] = [floating if x == out_name else x for x in n.input]
            n.output[:] = [floating if x == out_name else x for x in n.output]
        if compute[out_name] != TensorProto.FLOAT:  # QuantizeLinear takes float32 input before opset 19
            g.node.append(helper.make_node("Cast", [floating], [f"{floating}32"], name=f"{out_name}.kv_cast",
                                           to=TensorProto.FLOAT))
            floating = f"{floating}32"
        g.node.append(helper.make_node("QuantizeLinear", [floating, scale, zero], [out_name], name=f"{out_name}.kv_q",
                                       axis=2))
        # the gathered past: dequantized right after the Gather, before anything reads it
        for k, n in enumerate(nodes):
            if n.op_type == "Gather" and n.input[0] == past:
                gathered = n.output[0]
                dq = f"{gathered}.kv_dq"
                for m in nodes:
                    if m is not n:
                        m.input[:] = [dq if x == gathered else x for x in m.input]
                extra = [helper.make_node("DequantizeLinear", [gathered, scale, zero], [dq if compute[out_name]
                                          == TensorProto.FLOAT else f"{dq}.f32"], name=f"{past}.kv_dq", axis=0)]
                if compute[out_name] != TensorProto.FLOAT:
                    extra.append(helper.make_node("Cast", [f"{dq}.f32"], [dq], name=f"{past}.kv_dq_cast",
                                                  to=compute[out_name]))
                added_before.setdefault(k + 1, []).extend(extra)
    # keep the node list topologically sorted: each dequantization right after its Gather
    ordered: list[onnx.NodeProto] = []
    for k, n in enumerate(nodes):
        ordered.extend(added_before.get(k, []))
        ordered.append(n)
    ordered.extend(added_before.get(len(nodes), []))
    ordered.extend(list(g.node)[len(nodes):])  # the QuantizeLinear nodes, after their producers
    del g.node[:]
    g.node.extend(ordered)
    for vi in [*g.input, *g.output]:
        if vi.name.startswith(("past_key.", "past_value.", "new_key.", "new_value.")):
            vi.type.tensor_type.elem_type = TensorProto.INT8
    return model
