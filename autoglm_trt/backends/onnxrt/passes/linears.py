"""Give the engine graph's INT8 linears the native ``Int8Linear`` operator.

Input: the ONNX Runtime engine's graph after the ``hadamard_quantize`` pass, where each INT8
linear is a ``HadamardQuantize`` (rotation + uint8 quantization of its input) read only by a
``com.microsoft.MatMulIntegerToFloat`` with int8 weights ``[K, N]``, per-column scales and zero
weight zero points. Output: each such pair as one ``autoglm.trt.Int8Linear``
(``csrc/int8_linear.c``; ``Int8LinearSplit``, with two outputs, where its only reader is a
``Split`` into two halves: a fused gate/up projection), whose weights are repacked
(``pack_weights``) so that one 64-byte load feeds 16 outputs x 4 inputs of the CPU's 8-bit
dot-product instruction. The packed weights are
not serialized into the graph: they come back as arrays, all in one buffer on huge pages
(``weights_arena.py``), which the session reads in place (``SessionOptions.add_initializer``,
``backends.onnxrt.session``), and the graph declares them as external data of their type and shape. The
original weights leave the graph, so the process holds one copy of them, as before.

With ``fma`` (the native library has fused multiply-add), each float linear (``MatMul`` or
``Gemm`` over a constant float32 matrix of whole 16-column tiles) becomes
``autoglm.trt.FloatLinear`` (``csrc/float_linear.c``; ``FloatLinearSplit`` before a ``Split`` into
halves), its weights as 16-column tiles in the same buffer, and a gate/up projection followed by
SiLU(gate) * up (``QuickGelu`` and ``Mul``) becomes one ``Int8LinearSiluMul`` or
``FloatLinearSiluMul``. They compute what ONNX Runtime's nodes do, so the outputs do not change.

Like every pass in this package it is for ONNX Runtime alone, run when the engine is built into
its native graph; the engine's plain graph and the graph TensorRT builds keep
``MatMulIntegerToFloat`` and ``MatMul``. The packed weights are saved beside the native graph
(``loader.save_native``) and read back into one huge-page buffer when the engine loads.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .. import weights_arena
from . import linear_epilogues, nbits
from .common import DOMAIN, graph_inputs, use_domain

OP = "Int8Linear"
FLOAT_OP = "FloatLinear"
WEIGHT_OP = "Int8WeightLinear"
INT4_OP = "Int4WeightLinear"
BLOCK_OP = "Int8BlockLinear"
INT8_MAX_K = 65536  # Int8Linear's inputs at most (csrc/int8_linear.c MAX_K: its integer sums fit 32 bits)
LINEAR_OPS = (OP, FLOAT_OP, WEIGHT_OP, INT4_OP, BLOCK_OP)  # and their Split, SiluMul and SkipNorm forms
# Where the graph says the packed weights lie: the weights folder itself, which ONNX Runtime checks
# exists but never reads, because the session is handed each array in place (``add_initializer``);
# were it ever read, a folder is not a file, and loading fails rather than reading other bytes.
IN_PLACE = "."


def packed_shapes(k: int, n: int) -> tuple[tuple[int, int, int, int], tuple[int]]:
    """Shapes of ``pack_weights``' two arrays for weights ``[k, n]``."""
    return (-(-n // 16), -(-k // 4), 16, 4), (16 * -(-n // 16),)


def pack_weights(w: np.ndarray, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """int8 ``w [K, N]`` as ``[ceil(N/16), ceil(K/4), 16, 4]`` (``W[k, n]`` at ``[n // 16, k // 4,
    n % 16, k % 4]``, zeros past ``N`` and ``K``) and its column sums, int32 ``[16 * ceil(N/16)]``;
    written into ``out`` (arrays of ``packed_shapes``) if given."""
    if w.dtype != np.int8 or w.ndim != 2:
        raise ValueError(f"expected int8 weights [K, N], got {w.dtype} {w.shape}")
    k, n = w.shape
    shape, sums_shape = packed_shapes(k, n)
    kp, np_ = 4 * shape[1], 16 * shape[0]
    padded = np.zeros((kp, np_), np.int8)
    padded[:k, :n] = w
    packed, sums = out if out is not None else (np.empty(shape, np.int8), np.empty(sums_shape, np.int32))
    packed[...] = padded.reshape(kp // 4, 4, np_ // 16, 16).transpose(2, 0, 3, 1)
    np.sum(padded, axis=0, dtype=np.int32, out=sums)
    return packed, sums


def float_tiles_shape(k: int, n: int) -> tuple[int, int, int]:
    """Shape of ``FloatLinear``'s weights for float ``[k, n]`` (``n`` a multiple of 16)."""
    return n // 16, k, 16


def _pack_all(weights: dict[str, onnx.TensorProto], floats: dict[str, tuple[onnx.TensorProto, bool]],
              array, block_parts: dict[str, nbits.BlockParts] | None = None) -> dict[str, np.ndarray]:
    """Each int8 ``[K, N]`` weight packed, with its column sums, each float weight as 16-column
    tiles (``[N / 16, K, 16]``; ``floats`` says whether the tensor holds ``W`` transposed, as a
    ``Gemm``'s ``transB``), and the inputs of each ``Int4WeightLinear``, ``Int8BlockLinear`` and
    ``Int8WeightLinear`` (``nbits``, each made as it is copied), all into one buffer of
    ``weights_arena`` (huge pages where the system has them); by initializer name."""
    names: list[str] = []
    specs: list[tuple[tuple[int, ...], np.dtype]] = []
    for name, t in weights.items():
        shape, sums_shape = packed_shapes(int(t.dims[0]), int(t.dims[1]))
        names += [f"{name}.packed", f"{name}.col_sums"]
        specs += [(shape, np.dtype(np.int8)), (sums_shape, np.dtype(np.int32))]
    for name, (t, transposed) in floats.items():
        k, n = (int(t.dims[1]), int(t.dims[0])) if transposed else (int(t.dims[0]), int(t.dims[1]))
        names.append(f"{name}.tiles")
        specs.append((float_tiles_shape(k, n), np.dtype(np.float32)))
    block_parts = block_parts or {}
    for name, parts in block_parts.items():
        names += [f"{name}.{part}" for part in parts.specs]
        specs += list(parts.specs.values())
    buf = weights_arena.allocate(weights_arena.layout(specs)[1])
    out = dict(zip(names, weights_arena.views(buf, specs)))

    def int8(name: str, t: onnx.TensorProto) -> None:
        pack_weights(array(t), (out[f"{name}.packed"], out[f"{name}.col_sums"]))

    def float_tiles(name: str, t: onnx.TensorProto, transposed: bool) -> None:
        w = array(t)
        tiles = out[f"{name}.tiles"]
        tiles[...] = (w.reshape(tiles.shape[0], 16, tiles.shape[1]).transpose(0, 2, 1) if transposed
                      else w.reshape(tiles.shape[1], tiles.shape[0], 16).transpose(1, 0, 2))

    def blocked(name: str, parts: nbits.BlockParts) -> None:
        for part, arr in parts.make().items():
            if (arr.shape, arr.dtype) != parts.specs[part]:
                raise ValueError(f"{name}.{part}: made as {arr.dtype} {arr.shape}, laid out as {parts.specs[part]}")
            out[f"{name}.{part}"][...] = arr

    jobs = [partial(int8, name, t) for name, t in weights.items()] + \
        [partial(float_tiles, name, t, transposed) for name, (t, transposed) in floats.items()] + \
        [partial(blocked, name, parts) for name, parts in block_parts.items()]
    # each linear's weights read and laid out on a thread of their own (numpy and file reads let go
    # of the GIL), into parts of the buffer no other job writes
    with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
        list(pool.map(lambda job: job(), jobs))  # each job's error, if any, raised here
    weights_arena.settle(buf)
    return out


def rewrite(model: onnx.ModelProto, weights_dir: Path, pack: bool = True,
            fma: bool = False, dynamic_int8: bool = False) -> dict[str, np.ndarray]:
    """Fuse in place, reading the int8 weights (external data under ``weights_dir``, or inline);
    the packed weights and column sums by initializer name (empty: nothing fused). ``fma``: the
    native library was built with fused multiply-add (``native.float_kernel``;
    ``passes.Target`` says), so it computes what ONNX Runtime does for float linears
    too (``MatMul`` or ``Gemm`` over a constant float32 matrix of a multiple of 16 columns:
    ``FloatLinear``) and for SiLU(gate) * up after a gate/up projection (``*SiluMul``). With
    ``pack`` False (``inspect``, which only counts nodes) no weight is read or packed and the
    graph is left unloadable. An 8-bit ``MatMulNBits`` becomes ``Int8BlockLinear`` (activations
    quantized per block to int8, as the node itself does) with ``dynamic_int8`` or beside INT4
    linears (an int4-awq engine's LM head), else ``Int8WeightLinear`` (to int16)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    old = list(graph.node)  # holds the nodes' wrappers, so the id()s below stay theirs
    readers: dict[str, int] = {}
    for node in old:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    rotation = {n.output[0]: n for n in old if n.op_type == "HadamardQuantize" and n.domain == DOMAIN}

    def array(t: onnx.TensorProto) -> np.ndarray:
        return numpy_helper.to_array(t, base_dir=str(weights_dir))

    def int8_matrix(name: str) -> bool:
        t = inits.get(name)
        return t is not None and t.data_type == TensorProto.INT8 and len(t.dims) == 2

    def fusable(mm: onnx.NodeProto) -> onnx.NodeProto | None:
        rot = rotation.get(mm.input[0]) if mm.op_type == "MatMulIntegerToFloat" else None
        if rot is None or len(mm.input) != 6 or readers.get(mm.input[0]) != 1 or mm.input[2] != rot.input[2]:
            return None
        zero_w, scale_w = inits.get(mm.input[5]), inits.get(mm.input[3])
        if zero_w is None or scale_w is None or np.any(array(zero_w)) or \
                scale_w.data_type != TensorProto.FLOAT or len(scale_w.dims) != 1:
            return None
        zero_mm, zero_rot = inits.get(mm.input[4]), inits.get(rot.input[3])
        if zero_mm is None or zero_rot is None or not np.array_equal(array(zero_mm), array(zero_rot)):
            return None
        return rot

    weights: dict[str, onnx.TensorProto] = {}
    float_weights: dict[str, tuple[onnx.TensorProto, bool]] = {}
    block_weights: dict[str, nbits.BlockParts] = {}  # Int4WeightLinear's, Int8BlockLinear's, Int8WeightLinear's
    dynamic_int8 = dynamic_int8 or any(n.op_type == "MatMulNBits" and any(a.name == "bits" and a.i == 4
                                                                       for a in n.attribute) for n in old)
    added: dict[int, onnx.NodeProto] = {}  # a node to put after the one replaced
    widths: dict[str, int] = {}  # a fused linear's output: its columns
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for mm in old:
        int4 = nbits.int4_parts(mm, inits, array) if fma else None
        if int4 is not None:
            block_weights[mm.input[1]] = int4
            names = [f"{mm.input[1]}.{part}" for part in nbits.INT4_PARTS]
            _replace_nbits(mm, INT4_OP, names, widths, replaced, added)
            continue
        blocked = nbits.int8_parts(mm, inits, array) if fma else None
        if blocked is not None:
            block_weights[mm.input[1]] = blocked
            names = [f"{mm.input[1]}.{part}" for part in nbits.INT8_PARTS]
            _replace_nbits(mm, BLOCK_OP if dynamic_int8 else WEIGHT_OP, names, widths, replaced, added)
            continue
        transposed = _float_matrix(mm, inits) if fma else None
        if transposed is not None:
            t = inits[mm.input[1]]
            float_weights[mm.input[1]] = (t, transposed)
            widths[mm.output[0]] = int(t.dims[0 if transposed else 1])
            replaced[id(mm)] = helper.make_node(FLOAT_OP, [mm.input[0], f"{mm.input[1]}.tiles"], [mm.output[0]],
                                                name=f"{mm.name}.float_linear", domain=DOMAIN)
            continue
        rot = fusable(mm)
        if rot is None or not int8_matrix(mm.input[1]) or inits[mm.input[1]].dims[0] > INT8_MAX_K:
            continue
        packed_name, sums_name = f"{mm.input[1]}.packed", f"{mm.input[1]}.col_sums"
        weights[mm.input[1]] = inits[mm.input[1]]
        replaced[id(mm)] = helper.make_node(
            OP, [rot.input[0], rot.input[1], rot.input[2], rot.input[3], packed_name, sums_name, mm.input[3]],
            [mm.output[0]], name=f"{mm.name}.int8_linear", domain=DOMAIN)
        widths[mm.output[0]] = int(inits[mm.input[3]].dims[0])
        dropped.add(id(rot))
    if not replaced:
        return {}
    nodes = [m for n in old if id(n) not in dropped for m in (replaced.get(id(n), n), added.get(id(n))) if m is not None]
    nodes = _split_halves(nodes, inits, readers, widths)
    if fma:
        nodes = linear_epilogues.silu_mul(nodes, readers)
    del graph.node[:]
    graph.node.extend(nodes)
    if not pack:
        return {}
    arrays = _pack_all(weights, float_weights, array, block_weights)
    used = graph_inputs(graph)
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    for name, arr in arrays.items():  # declared as external data; the session is handed the arrays instead
        t = graph.initializer.add()
        t.name, t.data_type, t.data_location = name, helper.np_dtype_to_tensor_dtype(arr.dtype), TensorProto.EXTERNAL
        t.dims.extend(arr.shape)
        for key, value in (("location", IN_PLACE), ("offset", "0"), ("length", str(arr.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
    use_domain(model)
    return arrays


def _replace_nbits(mm: onnx.NodeProto, op: str, weights: list[str], widths: dict[str, int],
                   replaced: dict[int, onnx.NodeProto], added: dict[int, onnx.NodeProto]) -> None:
    """A ``MatMulNBits`` as ``op`` over its input and ``weights``, and an ``Add`` after it for the
    bias ONNX Runtime folded into it (input 5)."""
    bias = mm.input[5] if len(mm.input) > 5 else ""
    out = f"{mm.output[0]}.before_bias" if bias else mm.output[0]
    widths[out] = {a.name: helper.get_attribute_value(a) for a in mm.attribute}["N"]
    replaced[id(mm)] = helper.make_node(op, [mm.input[0], *weights], [out], name=f"{mm.name}.{op}", domain=DOMAIN)
    if bias:
        added[id(mm)] = helper.make_node("Add", [out, bias], [mm.output[0]], name=f"{mm.name}.bias")


def _float_matrix(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto]) -> bool | None:
    """For a ``MatMul`` or ``Gemm`` that ``FloatLinear`` computes bit for bit (x times a constant
    float32 matrix of a multiple of 16 columns; a ``Gemm`` without C, alpha 1, ``transA`` 0),
    whether the constant holds ``W`` transposed (``transB``); else None."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) != 2:
        return None
    t = inits.get(node.input[1])
    if t is None or t.data_type != TensorProto.FLOAT or len(t.dims) != 2:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    transposed = node.op_type == "Gemm" and attrs.get("transB", 0) == 1
    if node.op_type == "Gemm" and (attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0):
        return None
    return transposed if int(t.dims[0 if transposed else 1]) % 16 == 0 else None


def _split_halves(nodes: list[onnx.NodeProto], inits: dict[str, onnx.TensorProto],
                  readers: dict[str, int], widths: dict[str, int]) -> list[onnx.NodeProto]:
    """Each ``Int8Linear`` or ``FloatLinear`` read only by a ``Split`` of its last axis into two
    equal halves (a fused gate/up projection) as one ``Int8LinearSplit`` or ``FloatLinearSplit``
    with the halves as its outputs, where each half is a whole number of 16-column tiles.
    ``widths``: each linear's columns, by its output."""
    linears = {n.output[0]: n for n in nodes if n.op_type in LINEAR_OPS and n.domain == DOMAIN}
    merged: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for split in nodes:
        linear = linears.get(split.input[0]) if split.op_type == "Split" and split.input else None
        if linear is None or readers.get(split.input[0]) != 1 or len(split.output) != 2:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in split.attribute}
        sizes = attrs.get("split")
        if len(split.input) > 1 and split.input[1]:
            t = inits.get(split.input[1])
            sizes = numpy_helper.to_array(t).tolist() if t is not None and t.data_location != TensorProto.EXTERNAL else []
        n = widths[linear.output[0]]
        halves = sizes is None or list(sizes) == [n // 2, n // 2]
        if attrs.get("axis") != -1 or not halves or n % 32:
            continue
        fused = onnx.NodeProto.FromString(linear.SerializeToString())
        fused.op_type, fused.name = f"{linear.op_type}Split", f"{linear.name}.split"
        fused.output[:] = list(split.output)
        merged[id(linear)] = fused
        dropped.add(id(split))
    return [merged.get(id(n), n) for n in nodes if id(n) not in dropped]
