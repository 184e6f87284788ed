"""Read the weights of ONNX Runtime's ``MatMulNBits`` nodes that the native weight-only linears
replace (``linears.py``): what its optimizer makes of a DequantizeLinear in blocks of 32 + MatMul
(``graph/qdq.py``'s INT8 and INT4).

- ``int8_blocks``: an 8-bit node, zero points 128 -> ``Int8WeightLinear``'s int8 weights and
  scales; ``int8_block_tiles`` lays them out for ``Int8BlockLinear``.
- ``int4_blocks``: a 4-bit node at accuracy level 4 (its activations quantized per block of 32
  to int8 at run time, as ``Int4WeightLinear`` quantizes them) -> that operator's tiles, scales
  and zero points (``csrc/block_linear.c``).

The operators hold each scale as float16 (and 4-bit zero points two to a byte): a node whose
float32 scales are not all float16 values (``quant.int4.half_scales`` makes this toolkit's so)
is left to ONNX Runtime, as is one of another block size or bit width, columns not a multiple of
16, or a ``g_idx``; either function then gives None. A bias (input 5) is left to the caller,
which adds it after. ``int4_parts`` and ``int8_parts`` check a node the same way and return
the inputs' shapes with a function that makes them (``BlockParts``): the linears pass lays out the
buffer first and reads each node's weights only as it packs them, so one node's are held at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from .common import MICROSOFT

QUANT_BLOCK = 32  # inputs per weight scale, every operator here (csrc/float_linear.c, csrc/block_linear.c)
INT8_ZERO = 128  # the zero point of 8-bit MatMulNBits weights when it has none
INT4_ZERO = 8  # and of 4-bit ones
INT4_PARTS = ("tiles4", "scales4", "zeros4")  # Int4WeightLinear's inputs 1-3, by name suffix
INT8_PARTS = ("tiles8", "scales8")  # Int8BlockLinear's inputs 1-2
Array = Callable[[onnx.TensorProto], np.ndarray]
Spec = tuple[tuple[int, ...], np.dtype]


@dataclass(frozen=True)
class BlockParts:
    """An operator's weight inputs by name suffix: their shapes and dtypes, and ``make`` (reads the
    node's weights and lays them out)."""

    specs: dict[str, Spec]
    make: Callable[[], dict[str, np.ndarray]]


def _node(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], bits: int) -> dict | None:
    """The attributes of a ``MatMulNBits`` of ``bits`` in blocks of ``QUANT_BLOCK`` over a multiple
    of 16 columns, whose weights are initializers and which has no ``g_idx``; else None."""
    if node.op_type != "MatMulNBits" or node.domain != MICROSOFT or len(node.input) not in (3, 4, 5, 6) or \
            any(name not in inits for name in node.input[1:4] if name) or (len(node.input) > 4 and node.input[4]):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    ok = attrs.get("bits") == bits and attrs.get("block_size") == QUANT_BLOCK and attrs.get("N", 0) % 16 == 0 and \
        attrs.get("N", 0) >= 16 and attrs.get("K", 0) >= 1
    return attrs if ok else None


def _zeros(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], array: Array) -> np.ndarray | None:
    return array(inits[node.input[3]]) if len(node.input) > 3 and node.input[3] else None


def half(scales: np.ndarray) -> np.ndarray | None:
    """float32 ``scales`` as float16 when each is a float16 value (finite), else None."""
    with np.errstate(over="ignore"):  # a scale past float16's range becomes inf, and is refused
        halves = scales.astype(np.float16)
    return halves if np.all(np.isfinite(halves)) and np.array_equal(halves.astype(np.float32), scales) else None


def _int8_checked(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
                  array: Array) -> tuple[int, int, np.ndarray] | None:
    """For an 8-bit node with zero points of 128 and float16 values as scales: (K, N, its scales as
    float16 ``[N, KB]``), its weights unread; else None."""
    attrs = _node(node, inits, 8)
    if attrs is None:
        return None
    k, n = attrs["K"], attrs["N"]
    blocks = -(-k // QUANT_BLOCK)
    weights, scales = inits[node.input[1]], array(inits[node.input[2]])
    if weights.data_type != TensorProto.UINT8 or tuple(weights.dims) != (n, blocks, QUANT_BLOCK) or \
            scales.dtype != np.float32 or scales.size != n * blocks:
        return None
    zeros = _zeros(node, inits, array)
    halves = half(scales)
    if halves is None or (zeros is not None and (zeros.size != n * blocks or np.any(zeros != INT8_ZERO))):
        return None
    return k, n, halves.reshape(n, blocks)


def _int8_weights(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], array: Array, k: int) -> np.ndarray:
    b = array(inits[node.input[1]])
    return (b.reshape(b.shape[0], -1)[:, :k] ^ np.uint8(INT8_ZERO)).view(np.int8)  # v - 128 as int8: v ^ 0x80


def int8_blocks(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
                array: Array) -> tuple[np.ndarray, np.ndarray] | None:
    """For an 8-bit node with zero points of 128 and float16 values as scales: (int8 weights
    ``[N, K]``, float16 scales ``[ceil(K / QUANT_BLOCK), N]``); else None."""
    checked = _int8_checked(node, inits, array)
    if checked is None:
        return None
    k, _, halves = checked
    return _int8_weights(node, inits, array, k), np.ascontiguousarray(halves.T)


def int8_parts(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], array: Array) -> BlockParts | None:
    """``int8_block_tiles`` of ``int8_blocks``, made when asked; None where ``int8_blocks`` is."""
    checked = _int8_checked(node, inits, array)
    if checked is None:
        return None
    k, n, halves = checked
    blocks = halves.shape[1]
    specs: dict[str, Spec] = {"tiles8": ((n // 16, blocks, QUANT_BLOCK // 2, 32), np.dtype(np.int8)),
                              "scales8": ((n // 16, blocks, 16), np.dtype(np.float16))}
    return BlockParts(specs, lambda: int8_block_tiles(_int8_weights(node, inits, array, k),
                                                      np.ascontiguousarray(halves.T)))


def int8_block_tiles(q: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """``int8_blocks``' weights ``[N, K]`` and scales ``[KB, N]`` as ``Int8BlockLinear``'s inputs 1-2
    by ``INT8_PARTS`` suffix: tiles int8 ``[N/16, KB, 16, 32]`` (pair of inputs p of tile t's block
    b at ``[t, b, p]``, byte 2c + e the weight of output 16t + c and input 32b + 2p + e; zeros past
    K) and scales float16 ``[N/16, KB, 16]`` (``scales``' values: float16 or float32 holding float16 values)."""
    n, k = q.shape
    blocks = scales.shape[0]
    padded = np.zeros((n, blocks * QUANT_BLOCK), np.int8)
    padded[:, :k] = q
    # a pair of inputs moved as one 16-bit word: numpy's copy of 2-byte pieces measured much slower
    pairs = padded.view(np.int16).reshape(n // 16, 16, blocks, QUANT_BLOCK // 2).transpose(0, 2, 3, 1)
    tiles = np.ascontiguousarray(pairs).view(np.int8).reshape(n // 16, blocks, QUANT_BLOCK // 2, 32)
    by_tile = scales.T.reshape(n // 16, 16, blocks).transpose(0, 2, 1)
    return dict(zip(INT8_PARTS, (tiles, np.ascontiguousarray(by_tile, dtype=np.float16))))


def int4_blocks(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], array: Array) -> dict[str, np.ndarray] | None:
    """For a 4-bit node at accuracy level 4 with float16 values as scales: ``Int4WeightLinear``'s
    inputs 1-3 by ``INT4_PARTS`` suffix (tiles uint8 ``[N/16, KB, 8, 32]``, scales float16 ``[N/16,
    KB, 16]``, zero points uint8 ``[N/16, KB, 8]``, two to a byte: outputs 2i and 2i + 1 of a
    tile's block in byte i's low and high nibble; KB = ceil(K / 32)); else None."""
    parts = int4_parts(node, inits, array)
    return None if parts is None else parts.make()


def int4_parts(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto], array: Array) -> BlockParts | None:
    """``int4_blocks``' inputs, made when asked; None where ``int4_blocks`` is."""
    attrs = _node(node, inits, 4)
    if attrs is None or attrs.get("accuracy_level") != 4:
        return None
    k, n = attrs["K"], attrs["N"]
    blocks = -(-k // QUANT_BLOCK)
    weights, scales = inits[node.input[1]], array(inits[node.input[2]])
    if weights.data_type != TensorProto.UINT8 or tuple(weights.dims) != (n, blocks, QUANT_BLOCK // 2) or \
            scales.dtype != np.float32 or scales.size != n * blocks:
        return None
    halves = half(scales)
    if halves is None:
        return None
    zeros = _zeros(node, inits, array)
    if zeros is None:
        zero = np.full((n, blocks), INT4_ZERO, np.uint8)
    elif zeros.dtype == np.uint8 and zeros.size == n * -(-blocks // 2):  # two to a byte, each row padded to a byte
        pairs = zeros.reshape(n, -1)
        zero = np.stack([pairs & 0x0F, pairs >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        return None

    def by_tile(a: np.ndarray) -> np.ndarray:  # [N, KB] -> [N/16, KB, 16]
        return np.ascontiguousarray(a.reshape(n // 16, 16, blocks).transpose(0, 2, 1))

    zero16 = by_tile(zero.astype(np.uint8))
    small = (by_tile(halves.reshape(n, blocks)), zero16[..., 0::2] | (zero16[..., 1::2] << 4))
    specs: dict[str, Spec] = {"tiles4": ((n // 16, blocks, 8, 32), np.dtype(np.uint8)),
                              "scales4": ((n // 16, blocks, 16), np.dtype(np.float16)),
                              "zeros4": ((n // 16, blocks, 8), np.dtype(np.uint8))}
    return BlockParts(specs, lambda: dict(zip(INT4_PARTS, (int4_tiles(array(weights)), *small))))


def _spread(v: np.ndarray) -> np.ndarray:
    """The four nibbles of the low 16 bits of each uint32 of ``v`` at bits 0, 8, 16 and 24."""
    v = (v | (v << 8)) & 0x00FF00FF
    return (v | (v << 4)) & 0x0F0F0F0F


def int4_tiles(b: np.ndarray) -> np.ndarray:
    """A 4-bit ``MatMulNBits``' weights ``b`` (uint8 ``[N, KB, 16]``: byte j of a block holds its
    inputs 2j, low nibble, and 2j + 1) as ``Int4WeightLinear``'s tiles (uint8 ``[N/16, KB, 8, 32]``):
    the operator's block is 4 vectors of 64 bytes, byte 4c + e of vector i holding output c's inputs
    8i + e (low nibble) and 8i + 4 + e (high) (``csrc/block_linear.c``). Bytes 4i .. 4i + 3 of a
    block, read as one little-endian uint32 x, hold inputs 8i .. 8i + 7 in its nibbles, in order: the
    vector's 4 bytes for output c are x's low 16 bits spread to the low nibbles and its high 16 bits
    to the high ones, then moved as one 32-bit word."""
    n, blocks = b.shape[0], b.shape[1]
    x = np.ascontiguousarray(b, dtype=np.uint8).view("<u4")  # [N, KB, 4]
    words = _spread(x & 0xFFFF) | (_spread(x >> 16) << 4)
    moved = words.reshape(n // 16, 16, blocks, 4).transpose(0, 2, 3, 1)  # [t, b, i, c]
    return np.ascontiguousarray(moved, dtype="<u4").view(np.uint8).reshape(n // 16, blocks, 8, 32)
