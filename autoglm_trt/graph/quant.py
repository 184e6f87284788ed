"""INT8 in the graph: the quantization plan and TensorRT's explicit Q/DQ placement.

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
from dataclasses import dataclass, field, replace

import numpy as np
from onnx import helper

from . import names
from .builder import GraphBuilder
from .gptq import gptq_int4_blocks
from .hadamard import hadamard, rotate_weight, rotate_weight_rows
from .int4 import Int4Blocks, half_scales, int4_weight_dq, quantize_int4_blocks

WEIGHT_BLOCK = 32  # inputs per weight scale of a weight-only plan (docs/native.md: why not one per channel)
# clips of a block's absolute max tried for its scale (least squared error wins): SmolLM2 int8-wo
# answers more chat prompts as fp32 does with the clip than with the max alone (docs/native.md)
CLIPS = (1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93, 0.92, 0.91, 0.90)
ROW_CHUNK = 8192  # rows of an [out, in] weight quantized at a time by ``quantized_rows_matmul``


@dataclass(frozen=True)
class QuantPlan:
    """INT8 plan: activation amax (absolute max after calibration) per linear, by name.

    With ``switchable`` (calibration's sensitivity search only), each planned linear computes
    both paths and a graph input ``quant_mask`` (float [len(switch_order)], 1 = INT8) picks
    one per linear, so many plans can be tried with one session; a scalar input ``scale_nudge``
    multiplies every activation scale (1: the plan's own).
    """

    act_amax: dict[str, float]
    switchable: bool = False
    # linear name -> Hadamard block size: its input is rotated in the graph and its weight
    # offline (see ``hadamard``); the amax is then that of the rotated input
    rotate: dict[str, int] = field(default_factory=dict)

    # the DequantizeLinear on the weights alone, the activations float; ``act_amax`` then only
    # names the linears (its values are unused)
    weight_only: bool = False
    # linear name -> [out] float32 added to its output: the mean INT8 output error on calibration
    # rows (``calib.thresholds.bias_corrections``); in a switchable graph each is scaled by its
    # linear's ``quant_mask`` and ``bias_mask`` entries
    bias_correction: dict[str, np.ndarray] = field(default_factory=dict)
    # a weight-only plan's linears but the LM head: 8 (blocks of ``WEIGHT_BLOCK``) or 4 bits
    # (``int4``: blocks of ``weight_block``, symmetric or with zero points); the head stays 8-bit
    weight_bits: int = 8
    weight_block: int = WEIGHT_BLOCK
    weight_symmetric: bool = True
    int8_linears: tuple[str, ...] = ()  # a 4-bit plan's linears kept at 8 bits, as the head
    # a weight-only plan's 8-bit weights with one scale per output channel instead of per block:
    # TensorRT's form, whose Dequantize takes blocks of INT4, FP4 and FP8 only (NvInfer.h)
    int8_channels: bool = False
    # a 4-bit plan's linear name -> the Gram matrix X^T X of its inputs as the graph feeds them
    # (after AWQ's scaling): its weights rounded by GPTQ (``gptq``) instead of to nearest
    gram: dict[str, np.ndarray] = field(default_factory=dict)
    # a 4-bit plan's linear name -> its weights already rounded (GPTQ layer by layer, or GPTQ's
    # roundings as a switchable graph was written, for the final graph), read when written
    rounded: dict[str, Callable[[], Int4Blocks]] = field(default_factory=dict)
    # a weight-only plan's token embedding as INT8 rows in blocks of ``WEIGHT_BLOCK`` (the LM head's
    # quantization; ``embedding_rows``), gathered and scaled in the graph; else float
    int8_embedding: bool = False

    @classmethod
    def weights_only(cls, linears: list[str], bits: int = 8, block: int = WEIGHT_BLOCK,
                     symmetric: bool = True, int8_linears: tuple[str, ...] = (),
                     gram: dict[str, np.ndarray] | None = None, int8_embedding: bool = False,
                     rounded: dict[str, Callable[[], Int4Blocks]] | None = None,
                     int8_channels: bool = False) -> QuantPlan:
        return cls(dict.fromkeys(linears, 0.0), weight_only=True, weight_bits=bits, weight_block=block,
                   weight_symmetric=symmetric, int8_linears=int8_linears, gram=gram or {},
                   int8_embedding=int8_embedding, rounded=rounded or {}, int8_channels=int8_channels)

    @property
    def switch_order(self) -> list[str]:
        return sorted(self.act_amax)

    def without(self, keep_float: list[str]) -> QuantPlan:
        """The same plan with the named linears left in float."""
        return replace(self, act_amax={n: a for n, a in self.act_amax.items() if n not in keep_float},
                       bias_correction={n: c for n, c in self.bias_correction.items() if n not in keep_float})

    def corrected(self, linears: list[str]) -> QuantPlan:
        """The same plan with the bias corrections of the named linears only."""
        return replace(self, bias_correction={n: c for n, c in self.bias_correction.items() if n in linears})


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
            w4, _ = _switch(g, name, plan, w4, _weight_dq(g, g.weight(f"{name}.int8.weight_i8", wq), ws, f"{name}.int8"))
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
    xdq, wdq = _qdq(g, x, g.weight(f"{name}.weight_i8", wq), _stored(ws, scales), name, plan)
    if plan.switchable:
        wdq, on = _switch(g, name, plan, wdq, g.weight(f"{name}.weight", w.astype(np.float32)))
        xdq = g.op("Add", [x, g.op("Mul", [on, g.op("Sub", [xdq, x])])], f"{name}.switch_x")
    return g.op("MatMul", [xdq, wdq], name)


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


def _switch(g: GraphBuilder, name: str, plan: QuantPlan, quantized: str, kept: str) -> tuple[str, str]:
    """A switchable graph's weight of linear ``name`` (``quantized`` where its ``quant_mask`` entry
    is 1, else ``kept``: float, or INT8 in an INT4 plan) and that entry."""
    idx = g.const(np.int64(plan.switch_order.index(name)), f"{name}.switch_idx")
    on = g.op("Gather", ["quant_mask", idx], f"{name}.switch")
    return g.op("Where", [g.op("Greater", [on, g.const(np.float32(0.5), "half")]), quantized, kept],
                f"{name}.switch_w"), on


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


def embedding_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Embedding rows ``[n, hidden]`` as a weight-only LM head quantizes them (one scale per
    ``WEIGHT_BLOCK`` of a row's values, ``quantize_weight_blocks``): (int8 ``[n, hidden]``, float32
    scales ``[n, hidden / WEIGHT_BLOCK, 1]``). A tied model's embedding and head get the same values."""
    q, scale = quantize_weight_blocks(np.asarray(rows, np.float32).T, WEIGHT_BLOCK)
    return np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)[:, :, None]


def _qdq(g: GraphBuilder, x: str, wq: str, ws: np.ndarray, name: str, plan: QuantPlan) -> tuple[str, str]:
    """Q/DQ of the activation x (per tensor) and DQ of the INT8 weight ``wq`` (per output channel),
    in the type of ``ws``."""
    x_scale = g.const(_stored(np.asarray(act_scale(plan.act_amax[name]), np.float32), ws.dtype), f"{name}.act_scale")
    if plan.switchable:  # times the graph input ``scale_nudge``: the search's second rounding
        x_scale = g.op("Mul", [x_scale, "scale_nudge"], f"{name}.act_scale_nudged")
    zero = g.const(np.int8(0), "zero_i8")
    xq = g.op("QuantizeLinear", [x, x_scale, zero], f"{name}.act_q")
    xdq = g.op("DequantizeLinear", [xq, x_scale, zero], f"{name}.act_dq")
    return xdq, _weight_dq(g, wq, ws, name)


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


def act_scale(amax: float) -> float:
    """Symmetric INT8 scale of an activation whose calibrated absolute max is ``amax``."""
    return max(float(amax), 1e-8) / 127.0


def quantize_weight_per_channel(w: np.ndarray, half_values: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-output-channel INT8 of a ``[in, out]`` matrix: (int8 weights, float32 scales).
    ``half_values`` (a weight-only plan's ``int8_channels``): each scale rounded to a float16 value
    first (``int4.half_scales``), so that a float16 graph stores the scales the weights were rounded with."""
    amax = np.max(np.abs(w), axis=0).astype(np.float32)
    scale = np.where(amax > 0, amax / np.float32(127.0), np.float32(1.0)).astype(np.float32)
    if half_values:
        scale = half_scales(scale)
    q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
    return q, scale


def quantize_weight_blocks(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric INT8 of a ``[in, out]`` matrix with one scale per ``block`` inputs of each output
    (the last block may be shorter): (int8 weights ``[in, out]``, float32 scales ``[blocks, out]``).
    Each block's scale is ``c * amax / 127`` rounded to a float16 value (``int4.half_scales``), with
    the clip ``c`` of ``CLIPS`` that gives the least squared error over the block (ties: the larger ``c``)."""
    n_in, n_out = w.shape
    blocks = -(-n_in // block)
    padded = np.zeros((blocks * block, n_out), np.float32)
    padded[:n_in] = w
    grouped = padded.reshape(blocks, block, n_out)
    amax = np.max(np.abs(grouped), axis=1)
    best_scale = best_err = None
    for clip in CLIPS:
        scale = half_scales(np.where(amax > 0, np.float32(clip) * amax / np.float32(127.0), np.float32(1.0)))
        q = np.clip(np.rint(grouped / scale[:, None]), -127, 127)
        err = np.sum(np.square(q * scale[:, None] - grouped, dtype=np.float32), axis=1)
        if best_scale is None:
            best_scale, best_err = scale, err
        else:
            better = err < best_err
            best_scale, best_err = np.where(better, scale, best_scale), np.where(better, err, best_err)
    assert best_scale is not None
    q = np.clip(np.rint(grouped / best_scale[:, None]), -127, 127).astype(np.int8).reshape(-1, n_out)[:n_in]
    return q, best_scale.astype(np.float32)
