"""The quantization plan: which linears of a decoder are quantized, and how.

``QuantPlan`` is what calibration (``calib``), the INT4 and weight-only builds (``builder``) make
and what the graph writer (``graph.qdq``) places: activation ranges, rotations, bias
corrections, weight-only bits and blocks, GPTQ's Gram matrices or its rounded weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from .int4 import Int4Blocks

WEIGHT_BLOCK = 32  # inputs per weight scale of a weight-only plan (docs/native.md: why not one per channel)


@dataclass(frozen=True)
class QuantPlan:
    """INT8 plan: activation amax (absolute max after calibration) per linear, by name.

    With ``switchable`` (calibration's sensitivity search only), a graph input ``quant_mask``
    (float [len(switch_order)], 1 = INT8) picks each planned linear's quantized or kept form
    (``graph.qdq``), so many plans can be tried with one session; a scalar input ``scale_nudge``
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
