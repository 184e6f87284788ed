"""What an ONNX Runtime engine runs on this machine, for ``inspect`` and ``doctor``: the native
library's build, the graph the runner loads (its native graph, or its plain one and why), and for
attention, each kind of linear and the prefill's softmax, the native operator or ONNX Runtime's."""

from __future__ import annotations

from ...artifacts import EngineError, Manifest
from ...precisions import Form, Precision, precision


def engine_graph(manifest: Manifest, name: str):
    """The engine's graph ``name`` (its structure, no weights), or EngineError where it is missing or no ONNX."""
    import onnx

    path = manifest.dir / name
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - a missing file, or protobuf's several errors for a file that is no ONNX
        raise EngineError(f"{path} is missing or not an ONNX graph ({type(exc).__name__}); rebuild the engine, "
                          "`autoglm-trt doctor` lists what else differs") from exc


def decode_graph(manifest: Manifest, report: dict | None) -> dict:
    """Node counts of one decode step: of the graph the runner would load here."""

    from . import passes
    from .runner import native_graph_here

    graphs = manifest.ort_graphs
    why = native_graph_here(graphs, passes.Target.here())
    name = graphs.plain_graph if why else str(graphs.native_graph)
    counts = passes.decode_nodes(engine_graph(manifest, name))
    return {"graph": name, "why_plain": why, "nodes": sum(counts.values()), "nodes_by_op": counts,
            "saved_nodes": (report or {}).get("nodes_after"), "passes": graphs.passes,
            "passes_version": graphs.passes_version}


def inspect_lines(manifest: Manifest, decode: dict) -> list[str]:
    """``inspect``'s lines: the native library, the passes, the decode step's nodes, the encoder."""
    from ...native import int8_kernel, variant_of
    from ...native import library as native_library
    from .vision import vision_graph

    library, why = native_library()
    done = [f"{p['name']} x{p['applied']}" for p in decode["passes"] if p["applied"]]
    ops = sorted(decode["nodes_by_op"].items(), key=lambda kv: -kv[1])
    lines = ["native       " + (f"the {variant_of(library)} build of the native library (INT8 kernel "
                                f"{int8_kernel(library)}; {library})" if library is not None
                                else f"none: the graph's own nodes run ({why})"),
             f"passes       version {decode['passes_version']}: " + (", ".join(done) or "none applied"),
             f"decode step  {decode['nodes']} nodes as ONNX Runtime runs them here ({decode['graph']}"
             + (f", as {decode['why_plain']}" if decode["why_plain"] else "")
             + (f"; the optimized graph has {decode['saved_nodes']}" if decode["saved_nodes"] is not None else "")
             + "): " + ", ".join(f"{op} x{n}" for op, n in ops[:8])]
    built = manifest.vision_forms
    if built is not None:
        graph, why, _ = vision_graph(manifest)
        made = {**built.graphs, **{f"{k}, native attention": v for k, v in (built.native_graphs or {}).items()}}
        lines.append(f"vision       {built.linears} linears and {built.attention} attention "
                     "at build (" + ", ".join(f"{k}: {v}" for k, v in made.items()) + f"); here {graph}: {why}")
    return lines


def native_report(manifest: Manifest) -> list[str]:
    """``doctor``'s lines: the library's build, the graph, and what runs attention and the linears."""

    from ...native import float_kernel, variant_of
    from . import passes
    from .passes.common import all_nodes
    from .runner import native_graph_here

    graphs, target = manifest.ort_graphs, passes.Target.here()
    library = target.library
    why = native_graph_here(graphs, target)
    name = graphs.plain_graph if why else str(graphs.native_graph)
    ops = {n.op_type for n in all_nodes(engine_graph(manifest, name).graph)}
    attention = not why and graphs.attention == "native"
    kernel = float_kernel(library) if library is not None else None
    float_native = any(op.startswith("FloatLinear") for op in ops)
    return [
        "native library: " + (f"the {variant_of(library)} build ({library})" if library is not None
                              else f"none ({target.why})"),
        f"graph: {name}" + (f" (the plain graph: {why})" if why else " (native operators)"),
        "decode attention: " + (f"native PagedAttention operator ({library})" if attention
                                else f"the graph's own nodes, slower ({why or graphs.attention_why})"),
        *_quantized_lines(precision(manifest.precision), ops, library),
        "float linears: " + (f"native FloatLinear operator ({kernel} kernel; ONNX Runtime's MatMul's sums)" if float_native
                             else "ONNX Runtime's MatMul" + (" (this CPU has no fused multiply-add)"
                                                             if kernel == "portable C" else "")),
        _prefill_line(ops, attention, library),
    ]


def _quantized_lines(p: Precision, ops: set[str], library) -> list[str]:
    """What runs the quantized linears of precision ``p``: the native operator or ONNX Runtime's."""
    from ...native import block_kernel, int8_amx, int8_kernel, int8_pairs_saturate

    def native(prefix: str) -> bool:
        return library is not None and any(op.startswith(prefix) for op in ops)

    per_block = "activations quantized per block of 32 at run time"
    if p.model is Form.WEIGHT_ONLY and not p.dynamic_int8:
        return ["INT8 weights: " + (f"native Int8WeightLinear operator ({block_kernel(library)} kernel; activations "
                                    "quantized per block of 32 to 16 bits at run time)" if native("Int8WeightLinear")
                                    else f"ONNX Runtime's MatMulNBits ({per_block})")]
    if p.model is Form.WEIGHT_ONLY:
        return ["INT8 weights and activations: " + (f"native Int8BlockLinear operator ({block_kernel(library)} kernel; "
                                                    f"{per_block})" if native("Int8BlockLinear")
                                                    else f"ONNX Runtime's MatMulNBits ({per_block})")]
    if p.model is Form.INT4:
        return ["INT4 weights: " + (f"native Int4WeightLinear operator ({block_kernel(library)} kernel; {per_block})"
                                    if native("Int4WeightLinear")
                                    else "ONNX Runtime's 4-bit MatMulNBits (activations quantized per block at run time)")
                + "; the LM head's INT8: " + ("native Int8BlockLinear operator"
                                              if any(op.startswith("Int8BlockLinear") for op in ops) else "MatMulNBits")]
    if p.model is Form.INT8:
        saturates = ("; this CPU has no VNNI, where its 16-bit pair sums saturate and the answers drift from the "
                     "calibrated plan's: install a C compiler and reinstall autoglm-trt for the native operators"
                     if int8_pairs_saturate() else "")
        return ["INT8 linears: " + (f"native Int8Linear operator ({int8_kernel(library)} kernel"
                                    + ("; AMX for 16 rows and more)" if int8_amx(library) else ")")
                                    if native("Int8Linear") else "ONNX Runtime's MatMulIntegerToFloat" + saturates)]
    return []


def _prefill_line(ops: set[str], attention: bool, library) -> str:
    """doctor's line on what runs a prefill's attention."""
    from ...native import attention_bf16

    if "PrefillAttentionBf16" in ops:
        return ("prefill attention: native PrefillAttentionBf16 operator (online softmax; "
                + ("bfloat16 products on AMX)" if library is not None and attention_bf16(library)
                   else "float32 here: no AMX-BF16 on this CPU, or AUTOGLM_TRT_AMX=0)"))
    if "PrefillAttention" in ops:
        return "prefill attention: native PrefillAttention operator (online softmax, no score tensors)"
    return "prefill softmax: " + ("native MaskedSoftmax operator (ONNX Runtime's Softmax's bits)" if "MaskedSoftmax" in ops
                                  else "ONNX Runtime's Softmax" + (" (the library is not built for AVX-512F)"
                                                                   if attention else ""))
