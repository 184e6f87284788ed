"""Quantized linears in the graph: TensorRT's explicit Q/DQ placement of a plan (``quant.plan``).

Input: a plan (activation amax per linear, optional Hadamard rotation per linear). Output, for
each planned linear: a QuantizeLinear/DequantizeLinear pair on the activation input of the
MatMul (per-tensor symmetric scale ``amax / 127``) and a DequantizeLinear on its INT8 weight
(per-output-channel scales), the form TensorRT's explicit quantization and ONNX Runtime's
integer kernels both take. A rotated linear gets ``x R`` in the graph (blocks of ``b``, one
MatMul by a normalized Hadamard matrix) and ``R^T W`` offline.

A weight-only plan (``QuantPlan.weight_only``) puts a blocked DequantizeLinear (opset 21: one
scale per ``WEIGHT_BLOCK`` inputs of each output channel) on the weight alone and leaves the
activation float: TensorRT's weight-only INT8 form, and the pattern ONNX Runtime's optimizer
turns into its 8-bit ``MatMulNBits``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

from ..quant.gptq import gptq_int4_blocks
from ..quant.hadamard import hadamard, rotate_weight, rotate_weight_rows
from ..quant.int4 import Int4Blocks, half_scales, pack_nibbles, quantize_int4_blocks
from ..quant.int8 import act_scale, quantize_weight_blocks, quantize_weight_per_channel
from ..quant.plan import WEIGHT_BLOCK, QuantPlan
from . import names
from .builder import GraphBuilder

ROW_CHUNK = 8192  # rows of an [out, in] weight quantized at a time by ``quantized_rows_matmul``


def quantized_matmul(g: GraphBuilder, x: str, w: np.ndarray, name: str, plan: QuantPlan, rank: int = 3,
                     half: np.dtype | None = None) -> str:
    """``x @ w`` (float32 x, no bias) with Q/DQ on x and an INT8 per-channel w; x stays float in a
    weight-only plan. The product is float32, or with ``half`` (float16) of that type: x cast to it
    (after its rotation), its Q/DQ and the weight's DequantizeLinear in it, scales stored in it
    (TensorRT's form: W8A8, W4A16, W8A16 GEMMs with half activations)."""
    scales = _scale_dtype(plan, half)
    if plan.weight_only and plan.weight_bits == 4 and name != "lm_head" and name not in plan.int8_linears:
        w4 = int4_weight_dq(g, name, _int4_weight(w, name, plan), scales)
        if plan.switchable:  # the INT4 gate's search: INT4, or INT8 in blocks as the head and the kept kinds
            wq, ws = quantize_weight_blocks(w, WEIGHT_BLOCK)
            w8 = _weight_dq(g, g.weight(f"{name}.int8.weight_i8", wq), ws, f"{name}.int8")
            w4 = _select_weight(g, _mask_entry(g, name, plan), w4, w8, name)
        return g.op("MatMul", [_cast(g, x, scales, name), w4], name)
    if plan.weight_only:
        wq, ws = (quantize_weight_per_channel(w, half_values=True) if plan.int8_channels
                  else quantize_weight_blocks(w, WEIGHT_BLOCK))
        return g.op("MatMul", [_cast(g, x, scales, name),
                               _weight_dq(g, g.weight(f"{name}.weight_i8", wq), _stored(ws, scales), name)], name)
    if name in plan.rotate:
        x, w = rotate_input(g, x, plan.rotate[name], name, rank), rotate_weight(w, plan.rotate[name])
    wq, ws = quantize_weight_per_channel(w)
    x = _cast(g, x, scales, name)
    if not plan.switchable:
        xdq, wdq = _qdq(g, x, g.weight(f"{name}.weight_i8", wq), _stored(ws, scales), name, plan)
        return g.op("MatMul", [xdq, wdq], name)
    wq_name, ws = g.weight(f"{name}.weight_i8", wq), _stored(ws, scales)
    entry = _mask_entry(g, name, plan)
    x_sel = g.op("Add", [x, g.op("Mul", [entry, g.op("Sub", [_act_qdq(g, x, ws.dtype, name, plan), x])])],
                 f"{name}.switch_x")
    with g.apart() as int8:  # the weight dequantized only in a run that quantizes this linear
        yq = g.op("MatMul", [x_sel, _weight_dq(g, wq_name, ws, name)], f"{name}.int8")
    with g.apart() as kept:
        yf = g.op("MatMul", [x_sel, g.weight(f"{name}.weight", w.astype(np.float32))], f"{name}.float")
    return _switch(g, name, entry, (int8, yq), (kept, yf))


def _scale_dtype(plan: QuantPlan, half: np.dtype | None) -> np.dtype:
    """The type a plan's scales are stored in and its linears compute in: float32, or the graph's
    half type (a weight-only plan's block scales are float16 values, ``int4.half_scales``: stored
    exactly; a per-channel or activation scale is rounded to the nearest)."""
    if half is None:
        return np.dtype(np.float32)
    if plan.switchable:
        raise ValueError("a switchable graph (the accuracy gate's search) is written in float32")
    return np.dtype(half)


def _stored(scale: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Positive float32 scales in ``dtype``: float16 ones clipped to its range, so none is 0 or inf
    (TensorRT takes strictly positive scales; a float32 scale under 2^-24 quantizes weights that small)."""
    return scale if dtype == np.float32 else half_scales(scale).astype(dtype)


def _cast(g: GraphBuilder, x: str, dtype: np.dtype, name: str) -> str:
    """float32 ``x`` in ``dtype`` (a Cast where it is not float32)."""
    if dtype == np.float32:
        return x
    return g.op("Cast", [x], f"{name}.x_half", to=int(helper.np_dtype_to_tensor_dtype(dtype)))


def _mask_entry(g: GraphBuilder, name: str, plan: QuantPlan) -> str:
    """Linear ``name``'s entry of a switchable graph's ``quant_mask`` (1: quantized, 0: kept)."""
    idx = g.const(np.int64(plan.switch_order.index(name)), f"{name}.switch_idx")
    return g.op("Gather", ["quant_mask", idx], f"{name}.switch")


def _switch(g: GraphBuilder, name: str, entry: str, quantized: tuple[list, str], kept: tuple[list, str]) -> str:
    """The INT8 gate's product of linear ``name``: the ``quantized`` branch's where its
    ``quant_mask`` ``entry`` is 1, else the ``kept`` (float) one's. Each branch holds its MatMul and
    the quantized one its weight's DequantizeLinear: a run dequantizes only the weights of the
    linears it quantizes, and selects no whole weight matrix (``switchable_session`` runs it)."""
    on = g.op("Greater", [entry, g.const(np.float32(0.5), "half")], f"{name}.switch_on")
    return g.if_op(on, quantized, kept, TensorProto.FLOAT, name)


def _select_weight(g: GraphBuilder, entry: str, quantized: str, kept: str, name: str) -> str:
    """The INT4 gate's weight of linear ``name``: ``quantized`` (INT4) where its ``quant_mask``
    ``entry`` is 1, else ``kept`` (INT8 in blocks), a Where on the whole weights. Not an ``If``:
    the gate's session fuses the graph's other weight DequantizeLinear-MatMul pairs (the head's and
    the linears kept at INT8) into ``MatMulNBits``, as the INT4 graph it judges runs them, and that
    fusion fails on a pair inside a branch whose weight lies outside it."""
    return g.op("Where", [g.op("Greater", [entry, g.const(np.float32(0.5), "half")]), quantized, kept],
                f"{name}.switch_w")


def _int4_weight(w: np.ndarray, name: str, plan: QuantPlan) -> Int4Blocks:
    """A 4-bit plan's rounding of ``w``: rounded already, by GPTQ on its Gram matrix, or to nearest."""
    if name in plan.rounded:
        qw = plan.rounded[name]()
        if qw.q.shape != w.shape or qw.block != plan.weight_block:
            raise ValueError(f"{name}: weights rounded as {qw.q.shape} in blocks of {qw.block}, "
                             f"written as {w.shape} in blocks of {plan.weight_block}")
        return qw
    if name in plan.gram:
        qw = gptq_int4_blocks(w, plan.gram[name], plan.weight_block, plan.weight_symmetric)
        if plan.switchable:  # the INT4 gate's graph: kept for the graph written after it
            plan.rounded[name] = lambda: qw
        return qw
    return quantize_int4_blocks(w, plan.weight_block, plan.weight_symmetric)


def add_bias(g: GraphBuilder, y: str, b: np.ndarray | None, name: str, plan: QuantPlan) -> str:
    """``y + b`` (no bias: ``b`` None) of a planned linear, with its bias correction: folded into
    ``b``, or in a switchable graph added apart, times its ``quant_mask`` and ``bias_mask`` entries."""
    c = plan.bias_correction.get(name)
    if c is not None and not plan.switchable:
        b = c if b is None else b + c
    if b is not None:
        y = g.op("Add", [y, g.weight(f"{name}.bias", b.astype(np.float32))], f"{name}_bias")
    if c is not None and plan.switchable:
        idx = g.const(np.int64(plan.switch_order.index(name)), f"{name}.switch_idx")
        on = g.op("Mul", [g.op("Gather", ["quant_mask", idx]), g.op("Gather", ["bias_mask", idx])], f"{name}.bias_on")
        y = g.op("Add", [y, g.op("Mul", [on, g.weight(f"{name}.bias_correction", c.astype(np.float32))])],
                 f"{name}_corrected")
    return y


def quantized_rows_matmul(g: GraphBuilder, x: str, read_rows: Callable[[int, int], np.ndarray], n_out: int,
                          n_in: int, name: str, plan: QuantPlan, rank: int = 2, half: np.dtype | None = None) -> str:
    """``quantized_matmul`` of a weight read as ``[out, in]`` rows (an LM head of a large vocabulary),
    quantized chunk by chunk: memory holds the INT8 matrix once, never the float one."""
    scales = _scale_dtype(plan, half)
    b = None if plan.weight_only else plan.rotate.get(name)
    if b:
        x = rotate_input(g, x, b, name, rank)
    x = _cast(g, x, scales, name)
    q = np.empty((n_out, n_in), np.int8)
    blocks = plan.weight_only and not plan.int8_channels
    scale = np.empty((-(-n_in // WEIGHT_BLOCK), n_out) if blocks else n_out, np.float32)
    for a in range(0, n_out, ROW_CHUNK):
        rows = np.asarray(read_rows(a, min(a + ROW_CHUNK, n_out)), np.float32)
        if b:
            rows = rotate_weight_rows(rows, b)
        if blocks:
            qt, scale[:, a : a + len(rows)] = quantize_weight_blocks(rows.T, WEIGHT_BLOCK)
        else:
            qt, scale[a : a + len(rows)] = quantize_weight_per_channel(rows.T, half_values=plan.weight_only)
        q[a : a + len(rows)] = qt.T
    wq = g.weight_chunks(f"{name}.weight_i8", (n_in, n_out), np.dtype(np.int8),
                         (np.ascontiguousarray(q[:, h : h + 512].T) for h in range(0, n_in, 512)))
    if plan.weight_only:
        return g.op("MatMul", [x, _weight_dq(g, wq, _stored(scale, scales), name)], name)
    xdq, wdq = _qdq(g, x, wq, _stored(scale, scales), name, plan)
    return g.op("MatMul", [xdq, wdq], name)


def _qdq(g: GraphBuilder, x: str, wq: str, ws: np.ndarray, name: str, plan: QuantPlan) -> tuple[str, str]:
    """Q/DQ of the activation x (per tensor) and DQ of the INT8 weight ``wq`` (per output channel),
    in the type of ``ws``."""
    return _act_qdq(g, x, ws.dtype, name, plan), _weight_dq(g, wq, ws, name)


def _act_qdq(g: GraphBuilder, x: str, dtype: np.dtype, name: str, plan: QuantPlan) -> str:
    """Q/DQ of the activation x, per tensor, with its scale in ``dtype``."""
    x_scale = g.const(_stored(np.asarray(act_scale(plan.act_amax[name]), np.float32), dtype), f"{name}.act_scale")
    if plan.switchable:  # times the graph input ``scale_nudge``: the search's second rounding
        x_scale = g.op("Mul", [x_scale, "scale_nudge"], f"{name}.act_scale_nudged")
    zero = g.const(np.int8(0), "zero_i8")
    xq = g.op("QuantizeLinear", [x, x_scale, zero], f"{name}.act_q")
    return g.op("DequantizeLinear", [xq, x_scale, zero], f"{name}.act_dq")


def _weight_dq(g: GraphBuilder, wq: str, ws: np.ndarray, name: str) -> str:
    """DequantizeLinear of the INT8 weight ``wq`` ``[in, out]`` to the type of ``ws``: per output
    channel (``ws`` [out]), or in blocks of ``WEIGHT_BLOCK`` inputs (``ws`` [blocks, out], opset 21)."""
    zero = g.weight(f"{name}.weight_zero", np.zeros(ws.shape, np.int8))
    if ws.ndim == 2:
        return g.op("DequantizeLinear", [wq, g.weight(f"{name}.weight_scale", ws), zero], f"{name}.weight_dq",
                    axis=0, block_size=WEIGHT_BLOCK)
    return g.op("DequantizeLinear", [wq, g.weight(f"{name}.weight_scale", ws), zero], f"{name}.weight_dq", axis=1)


def rotate_input(g: GraphBuilder, x: str, b: int, name: str, rank: int = 3) -> str:
    """``x R`` over the last axis of x [..., n] (``rank`` dims): blocks of b, one MatMul by H."""
    keep = [0] * (rank - 1)
    blocks = g.op("Reshape", [x, g.ints([*keep, -1, b], names.blocks_shape(b, rank))], f"{name}.rot_blocks")
    rotated = g.op("MatMul", [blocks, g.const(hadamard(b), names.hadamard(b))], f"{name}.rot")
    return g.op("Reshape", [rotated, g.ints([*keep, -1], names.unblocks_shape(rank))], f"{name}.rotated")


def int4_weight_dq(g: GraphBuilder, name: str, qw: Int4Blocks, scale_dtype: np.dtype | type = np.float32) -> str:
    """DequantizeLinear (opset 21, axis 0, ``block_size``) of ``qw`` to ``[in, out]`` of the scales'
    type, ``scale_dtype`` (float32 or float16, which holds every ``half_scales`` value exactly)."""
    kind = TensorProto.INT4 if qw.zero is None else TensorProto.UINT4
    inputs = [g.packed_weight(f"{name}.weight_i4", qw.q.shape, kind, pack_nibbles(qw.q)),
              g.weight(f"{name}.weight_scale", qw.scale.astype(scale_dtype))]
    if qw.zero is not None:
        inputs.append(g.packed_weight(f"{name}.weight_zero", qw.zero.shape, kind, pack_nibbles(qw.zero)))
    return g.op("DequantizeLinear", inputs, f"{name}.weight_dq", axis=0, block_size=qw.block)
