"""``int8-wo``: a float export -> the same decoder with INT8 weights and float activations.

Input: a float32 export directory, or a float16 one (its weights widened to float32 as they are
read: a bfloat16 checkpoint's export in half the disk of float32's, which a 9B needs on a small
disk). Output directory (the build's cache)::

    model.int8wo.onnx, model.int8wo.onnx.data   every linear (the LM head too) as a
                                                DequantizeLinear of its INT8 weight (symmetric,
                                                one scale per 32 inputs of each output, a
                                                float16 value (``quant.int4.half_scales``); opset
                                                21) into a float MatMul; the token embedding
                                                INT8 the same way (rows gathered, then scaled),
                                                unless ``int8_embedding`` is off (TensorRT).
                                                For TensorRT (``int8_channels``, ``dtype``
                                                float16) one scale per output channel, the
                                                weights dequantized to float16 GEMMs (W8A16),
                                                float16 attention and KV cache
    export.json                                 the export's record, pointing at that graph;
                                                ``weight_only.source`` is the export's identity
    tokenizer (and vision encoder) files

No calibration data is read: weight scales come from the weights alone. TensorRT's Dequantize takes
INT8 per tensor or per channel, blocks only of INT4, FP4 and FP8 (``IDequantizeLayer`` in NvInfer.h),
hence its per-channel form; ONNX Runtime's optimizer turns each
DequantizeLinear + MatMul into its ``MatMulNBits`` (8-bit, blocks of 32), which the native
``Int8WeightLinear`` replaces (``backends/onnxrt/passes/linears.py``): it rounds each block of 32
activations to 16 bits (2^-16 of the block's largest, finer than float16) and sums exactly in
integers (``csrc/block_linear.c``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..artifacts import EXPORT_RECORD, ExportRecord, copy_tokenizer_files
from ..errors import AutoGLMError
from ..fileutil import staged_directory
from ..graph.decoder import write_int8_graph
from ..graph.exported_weights import ExportedWeights
from ..precisions import precision
from ..quant.plan import WEIGHT_BLOCK, QuantPlan

GRAPH = "model.int8wo.onnx"
# What this code writes from the same export; a cached result of another version is redone.
VERSION = 3


def _reusable(out_dir: Path, source: str, int8_embedding: bool, dtype: str, int8_channels: bool) -> bool:
    if not (out_dir / EXPORT_RECORD).is_file():
        return False
    record = ExportRecord.read(out_dir)
    made = record.made_by("weight_only")
    return (made.get("source") == source and made.get("version") == VERSION
            and made.get("int8_embedding") == int8_embedding and record.dtype == dtype
            and made.get("int8_channels", False) == int8_channels)


def weight_only_export(export_dir: Path, out_dir: Path, log: Callable[[str], None] = print,
                       int8_embedding: bool = True, dtype: str = "float32", int8_channels: bool = False) -> Path:
    """Write (or reuse) the weight-only INT8 model of ``export_dir`` in ``out_dir``; returns ``out_dir``.
    ``int8_embedding``: the token embedding as INT8 rows in blocks of 32 (as the LM head's weights;
    a quarter of float32's bytes), else float. ``dtype``: the graph's GEMMs, attention and KV cache,
    float32 or float16 (TensorRT's W8A16: the weights dequantized to float16). ``int8_channels``:
    one scale per output channel instead of per block of 32 (TensorRT's form)."""
    export = ExportRecord.read(export_dir)
    if export.dtype not in ("float32", "float16") or precision(export.precision).quantized:
        raise AutoGLMError(f"{export_dir} is not a float export; int8-wo is made from a float32 or float16 one "
                           "(autoglm-trt export CHECKPOINT -o DIR, or build from the checkpoint)")
    source = export.identity()
    if _reusable(out_dir, source, int8_embedding, dtype, int8_channels):
        log(f"reusing the weight-only INT8 model in {out_dir} (its export matches)")
        return out_dir
    import onnx

    from ..calib.collect import linear_inputs

    linears = sorted(linear_inputs(onnx.load(str(export.graph_file), load_external_data=False)))
    scales = "per output channel" if int8_channels else f"(a float16 value) per {WEIGHT_BLOCK} inputs of each output"
    widen = export.dtype == "float16"
    log(f"quantizing {len(linears)} linears' weights to INT8 (one scale {scales}) from {export_dir}"
        + (" (a float16 export: its weights widened to float32 as they are read)" if widen else ""))
    with staged_directory(out_dir, True) as tmp:
        plan = QuantPlan.weights_only(linears, int8_embedding=int8_embedding, int8_channels=int8_channels)
        write_int8_graph(tmp, GRAPH, export.spec, ExportedWeights(export_dir, widen=widen), plan, export.max_seq_len, dtype)
        record = export.derived(file=GRAPH, data_file=GRAPH + ".data", precision="int8-wo", dtype=dtype)
        record["weight_only"] = {"source": source, "version": VERSION, "linears": len(linears),
                                 "int8_embedding": int8_embedding,
                                 "weights": f"int8, symmetric, one scale {scales}, dequantized to {dtype}"
                                 + ("; token embedding int8 per 32" if int8_embedding else "")}
        if int8_channels:
            record["weight_only"]["int8_channels"] = True
        copy_tokenizer_files(export_dir, tmp)
        ExportRecord.write(tmp, record)
    return out_dir
