"""An INT8 KV cache, by rewriting any graph of the engine contract.

Input: an ONNX model (float32, float16 or INT8 Q/DQ) and either, per layer, the calibrated max
|K| (after rope) and max |V| of each KV head (static scales), or nothing (per-token scales).
Output: the same model with int8 pools. Static, per layer and per KV head (scale = amax / 127):

    new_key.<i>   QuantizeLinear(k, scale[kv_heads], axis=2) -> int8 [batch, new_tokens, kv_heads, head_dim]
    past_key.<i>  int8 [kv_heads, num_blocks, block_size, head_dim]
                  Gather by block table -> DequantizeLinear(scale[kv_heads], axis=0) -> the attention

Per token (``kv_amax`` None): each new token's K (and V) row of each KV head gets its own scale when
it is made, max |row| / 127 (``quantize_rows``, as llama.cpp's q8_0 cache does per block of 32),
which the runtime stores beside it in a float32 scale pool (``names.scale_of``):

    new_key.<i>         int8 [batch, new_tokens, kv_heads, head_dim]
    new_key_scale.<i>   float32 [batch, new_tokens, kv_heads]
    past_key_scale.<i>  float32 [kv_heads, num_blocks, block_size], gathered by the same block table;
                        the attention reads Cast(past) * scale

(the same for V). The attention over the step's own tokens keeps their float K/V; only what goes
through the pool is quantized.

TensorRT quantizes activations per tensor only (per-channel Q/DQ is for weights, ``IQuantizeLayer``
in NvInfer.h), so for it (``unit_scales``) each KV head's static scale is applied apart: K divided
by it, QuantizeLinear and DequantizeLinear with a scale of 1, the gathered past multiplied by it.
The same numbers: x / s rounds as QuantizeLinear's x / s does, q * 1 * s is q * s.

The rewrite touches only the tensors named by the contract, so it applies to every graph this
project writes, and the weights (external data) are not read.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..quant.kv import AMAX_FLOOR, kv_scale
from . import names


def int8_kv_graph(model: onnx.ModelProto, kv_amax: dict[str, list[float]] | None,
                  unit_scales: bool = False) -> onnx.ModelProto:
    """Rewrite ``model`` (in place, and returned) for an INT8 KV cache: with static scales from
    ``kv_amax`` (``new_key.<i>`` / ``new_value.<i>`` -> one amax per KV head), or with per-token
    scales when ``kv_amax`` is None. ``unit_scales``: the static scales outside the Q/DQ, whose
    own scale is 1 (TensorRT's form)."""
    g = model.graph
    compute = {o.name: o.type.tensor_type.elem_type for o in g.output}
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    outs: dict[str, list[float] | None] = dict(kv_amax) if kv_amax is not None else {
        o.name: None for o in g.output if o.name.startswith(("new_key.", "new_value."))}
    nodes = list(g.node)
    added_before: dict[int, list[onnx.NodeProto]] = {}
    for out_name, amax in outs.items():
        floating = _float_producer(g, nodes, out_name, compute[out_name])
        past = "past_" + out_name[len("new_"):]
        if amax is None:
            pool_input = next(i for i in g.input if i.name == past)
            pool = [d.dim_value or d.dim_param for d in pool_input.type.tensor_type.shape.dim]
            g.node.extend(_quantize_per_token(floating, out_name, opset))
            g.output.append(helper.make_tensor_value_info(names.scale_of(out_name), TensorProto.FLOAT,
                                                          ["batch", "new_tokens", pool[0]]))
            g.input.append(helper.make_tensor_value_info(names.scale_of(past), TensorProto.FLOAT, pool[:3]))
        else:
            g.node.extend(_quantize_static(g, floating, out_name, kv_scale(np.asarray(amax)), unit_scales))
        for k, n in enumerate(nodes):  # the gathered past: dequantized right after the Gather
            if n.op_type == "Gather" and n.input[0] == past:
                added_before.setdefault(k + 1, []).extend(
                    _dequantize_gathered(nodes, n, past, None if amax is not None else n.input[1], compute[out_name],
                                         unit_scales))
    # keep the node list topologically sorted: each dequantization right after its Gather
    ordered: list[onnx.NodeProto] = []
    for k, n in enumerate(nodes):
        ordered.extend(added_before.get(k, []))
        ordered.append(n)
    ordered.extend(added_before.get(len(nodes), []))
    ordered.extend(list(g.node)[len(nodes):])  # the quantizing nodes, after their producers
    del g.node[:]
    g.node.extend(ordered)
    for vi in [*g.input, *g.output]:
        if vi.name.startswith(("past_key.", "past_value.", "new_key.", "new_value.")):
            vi.type.tensor_type.elem_type = TensorProto.INT8
    return model


def _float_producer(g: onnx.GraphProto, nodes: list[onnx.NodeProto], out_name: str, dtype: int) -> str:
    """Rename the graph's K or V output ``out_name`` to ``<out_name>.float`` where it is made (the
    quantizing nodes will make ``out_name``); the float32 tensor to quantize (a Cast added for a
    float16 graph: QuantizeLinear takes float32 before opset 19)."""
    floating = f"{out_name}.float"
    for n in nodes:
        n.input[:] = [floating if x == out_name else x for x in n.input]
        n.output[:] = [floating if x == out_name else x for x in n.output]
    if dtype == TensorProto.FLOAT:
        return floating
    g.node.append(helper.make_node("Cast", [floating], [f"{floating}32"], name=f"{out_name}.kv_cast", to=TensorProto.FLOAT))
    return f"{floating}32"


def _quantize_static(g: onnx.GraphProto, x: str, out_name: str, s: np.ndarray, unit: bool) -> list[onnx.NodeProto]:
    """``x`` [batch, new_tokens, kv_heads, head_dim] quantized with KV head h's scale ``s[h]`` into
    ``out_name``: QuantizeLinear by head, or (``unit``) divided by s, then QuantizeLinear by 1."""
    scale, zero = f"{out_name}.kv_scale", f"{out_name}.kv_zero"
    if not unit:
        g.initializer.extend([numpy_helper.from_array(s, scale), numpy_helper.from_array(np.zeros(s.shape, np.int8), zero)])
        return [helper.make_node("QuantizeLinear", [x, scale, zero], [out_name], name=f"{out_name}.kv_q", axis=2)]
    one = f"{out_name}.kv_one"
    g.initializer.extend([numpy_helper.from_array(s[:, None], scale),
                          numpy_helper.from_array(np.array(1.0, np.float32), one),
                          numpy_helper.from_array(np.array(0, np.int8), zero)])
    return [helper.make_node("Div", [x, scale], [f"{out_name}.kv_scaled"], name=f"{out_name}.kv_scaled"),
            helper.make_node("QuantizeLinear", [f"{out_name}.kv_scaled", one, zero], [out_name], name=f"{out_name}.kv_q")]


def _quantize_per_token(x: str, out_name: str, opset: int) -> list[onnx.NodeProto]:
    """``quantize_rows`` as nodes: ``out_name`` (int8) and its scales ``names.scale_of(out_name)``."""
    p, scale = f"{out_name}.kv", names.scale_of(out_name)
    consts = [helper.make_node("Constant", [], [f"{p}_{n}"], name=f"{p}_{n}", value=numpy_helper.from_array(v))
              for n, v in (("floor", np.array(AMAX_FLOOR)), ("levels", np.array(127.0, np.float32)),
                           ("one", np.array(1.0, np.float32)), ("zero", np.array(0, np.int8)),
                           ("last", np.array([-1], np.int64)))]
    reduce = (helper.make_node("ReduceMax", [f"{p}_abs"], [f"{p}_amax"], name=f"{p}_amax", axes=[-1], keepdims=1)
              if opset < 18 else
              helper.make_node("ReduceMax", [f"{p}_abs", f"{p}_last"], [f"{p}_amax"], name=f"{p}_amax", keepdims=1))
    return [*consts,
            helper.make_node("Abs", [x], [f"{p}_abs"], name=f"{p}_abs"),
            reduce,
            helper.make_node("Max", [f"{p}_amax", f"{p}_floor"], [f"{p}_amax_floored"], name=f"{p}_amax_floored"),
            helper.make_node("Div", [f"{p}_amax_floored", f"{p}_levels"], [f"{p}_scale"], name=f"{p}_scale"),
            helper.make_node("Squeeze", [f"{p}_scale", f"{p}_last"], [scale], name=scale),
            helper.make_node("Div", [x, f"{p}_scale"], [f"{p}_scaled"], name=f"{p}_scaled"),
            helper.make_node("QuantizeLinear", [f"{p}_scaled", f"{p}_one", f"{p}_zero"], [out_name], name=f"{p}_q")]


def _dequantize_gathered(nodes: list[onnx.NodeProto], gather: onnx.NodeProto, past: str, table: str | None,
                         dtype: int, unit: bool = False) -> list[onnx.NodeProto]:
    """The nodes that turn the int8 past out of ``gather`` into ``dtype`` for every node that read
    it: with the layer's static scales (``table`` None; ``unit``: a DequantizeLinear by 1, then
    times the scales), or with the per-token scales gathered by the same block ``table``."""
    gathered = gather.output[0]
    dq = f"{gathered}.kv_dq"
    for m in nodes:
        if m is not gather:
            m.input[:] = [dq if x == gathered else x for x in m.input]
    f32 = dq if dtype == TensorProto.FLOAT else f"{dq}.f32"
    out_name = "new_" + past[len("past_"):]
    if table is None and unit:  # gathered [kv_heads, <the block table's dims>, block_size, head_dim]
        heads = helper.make_node("Constant", [], [f"{past}.kv_heads_shape"], name=f"{past}.kv_heads_shape",
                                 value=numpy_helper.from_array(np.array([-1, 1, 1, 1, 1], np.int64)))
        extra = [helper.make_node("DequantizeLinear", [gathered, f"{out_name}.kv_one", f"{out_name}.kv_zero"],
                                  [f"{gathered}.kv_unit"], name=f"{past}.kv_dq_unit"), heads,
                 helper.make_node("Reshape", [f"{out_name}.kv_scale", f"{past}.kv_heads_shape"], [f"{past}.kv_heads"],
                                  name=f"{past}.kv_heads"),
                 helper.make_node("Mul", [f"{gathered}.kv_unit", f"{past}.kv_heads"], [f32], name=f"{past}.kv_dq")]
    elif table is None:
        extra = [helper.make_node("DequantizeLinear", [gathered, f"{out_name}.kv_scale", f"{out_name}.kv_zero"], [f32],
                                  name=f"{past}.kv_dq", axis=0)]
    else:
        s = f"{gathered}.kv_scales"
        extra = [helper.make_node("Gather", [names.scale_of(past), table], [s], name=s, axis=1),
                 helper.make_node("Constant", [], [f"{s}_axis"], name=f"{s}_axis",
                                  value=numpy_helper.from_array(np.array([-1], np.int64))),
                 helper.make_node("Unsqueeze", [s, f"{s}_axis"], [f"{s}_col"], name=f"{s}_col"),
                 helper.make_node("Cast", [gathered], [f"{gathered}.kv_f32"], name=f"{past}.kv_cast_past",
                                  to=TensorProto.FLOAT),
                 helper.make_node("Mul", [f"{gathered}.kv_f32", f"{s}_col"], [f32], name=f"{past}.kv_dq")]
    if dtype != TensorProto.FLOAT:
        extra.append(helper.make_node("Cast", [f32], [dq], name=f"{past}.kv_dq_cast", to=dtype))
    return extra
