"""``int4-awq``: a float32 export -> the same decoder with INT4 weights (AWQ-scaled), float activations.

Input: a float32 export directory and calibration text (or, rounding to nearest without
calibration, ``Int4Settings.calibrated`` False: a float32 or float16 export alone, ``_nearest``).
Output directory (the build's cache)::

    model.int4.onnx, model.int4.onnx.data   every decoder linear as a DequantizeLinear of INT4
                                            weights in blocks along the input (opset 21), its
                                            AWQ scales folded into the norms and linears before
                                            it; the LM head INT8 in blocks of 32, as int8-wo's,
                                            and the token embedding INT8 the same way (rows
                                            gathered, then scaled; float for TensorRT). For
                                            TensorRT the graph is float16 (``dtype``): weights
                                            dequantized to float16 GEMMs (W4A16), float16
                                            attention and KV cache
    export.json                             the export's record, pointing at that graph;
                                            ``int4`` says how it was made
    tokenizer (and vision encoder) files

One batch of calibration windows runs through the float graph for each linear's input rows
(``calib.statistics.gather``); for a vision family (GLM-4.1V) one window per calibration image
follows them, the image's encoder output in its tokens' place (``calib.image_windows``, as the
INT8 calibration does), so the scales see image tokens' activations too. ``calib.awq`` picks
each linear's scales on them. More text windows follow in batches of the same size, and every
row's X^T X is summed per linear: GPTQ (``quant.gptq``) rounds each weight on its linear's Gram
matrix as the AWQ-scaled graph feeds it. A float32 export over ``GRAPH_BYTES`` runs through
the pass group of layers by group of layers, and each group is searched and rounded as soon as
its windows are through (``int4_rounding.LayerRounding``), so one group's Gram matrices are held
at a time; where those (or, on the whole model's pass, all of them) exceed ``GRAM_BYTES``, or
with ``gptq`` off, weights are rounded to nearest. ONNX Runtime's optimizer turns each
DequantizeLinear + MatMul into its 4-bit ``MatMulNBits``. With a ``gate``, the most sensitive
linears are kept at INT8 until the model's expected perplexity ratio against float is at most
that (``int4_gate``).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..artifacts import EXPORT_RECORD, ExportRecord, copy_tokenizer_files
from ..calib.collect import CalibPlan
from ..calib.smooth import SmoothedWeights
from ..errors import AutoGLMError
from ..fileutil import remove_stale_siblings, scratch_prefix, staged_directory
from ..graph.decoder import write_int8_graph
from ..graph.exported_weights import OpenedExport
from ..graph.names import KINDS, kind_of
from ..model.spec import ModelSpec
from ..model.text import TokenWindows, token_windows
from ..precisions import precision
from ..quant.plan import QuantPlan
from .int4_gate import GATE_SEQ_LEN, GATE_WINDOWS, gated_plan
from .int4_rounding import AwqSearch, LayerRounding, scaled

GRAPH = "model.int4.onnx"
# What this code writes from the same export and settings; a cached result of another version is redone.
VERSION = 7
# The Gram matrices GPTQ needs (float32, in x in per linear) are summed only while they fit this;
# a larger model's INT4 weights are rounded to nearest, and its record says why.
GRAM_BYTES = 2 * 1024**3
# A float32 export over this runs through the statistics pass group of layers by group of layers.
GRAPH_BYTES = 1024**3


@dataclass(frozen=True)
class Int4Settings:
    block: int = 32  # inputs per scale (and zero point)
    symmetric: bool = False  # False: uint4 with a zero point per block; True: int4 in [-7, 7]
    awq: bool = True  # False: no AWQ scales (the ablation)
    gptq: bool = True  # False: each weight rounded to nearest, not by GPTQ (the ablation)
    windows: int = 8  # calibration windows of ``seq_len`` tokens run for the linears' input rows (AWQ's)
    gram_windows: int = 64  # and for GPTQ's Gram matrices: these too, in batches of ``windows``
    seq_len: int = 128
    int8_kinds: tuple[str, ...] = ()  # kinds of linear (``graph.names.kind_of``) kept at INT8, blocks of 32
    int8_embedding: bool = True  # the token embedding INT8 in blocks of 32, as the LM head (else float32)
    # the accuracy gate (``int4_gate``): the fewest most sensitive linears kept at INT8 for the expected
    # perplexity ratio against the float graph to be at most this (None: no gate)
    gate: float | None = None
    # the graph's GEMMs, attention and KV cache: float32 (ONNX Runtime), or float16 with the weights
    # dequantized to it (TensorRT's W4A16); measured in float32 either way
    dtype: str = "float32"
    # the 8-bit linears (the LM head, ``int8_kinds``, the gate's) with one scale per output channel
    # instead of per block of 32: TensorRT's form (``QuantPlan.int8_channels``)
    int8_channels: bool = False

    @property
    def calibrated(self) -> bool:
        """Whether the build runs the float graph on calibration text: for AWQ's search, GPTQ's Gram
        matrices or the gate (else each weight is rounded to nearest, from the weights alone)."""
        return self.awq or self.gptq or self.gate is not None

    def check(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise AutoGLMError(f"the INT4 block size must be a power of two of at least 16, got {self.block}")
        if self.dtype not in ("float32", "float16"):
            raise AutoGLMError(f"the INT4 graph is written in float32 or float16, not {self.dtype}")
        unknown = sorted(set(self.int8_kinds) - set(KINDS[:-1]))
        if unknown:
            raise AutoGLMError(f"unknown kind of linear {', '.join(unknown)} to keep at INT8; "
                               f"choose from {', '.join(KINDS[:-1])} (the LM head is INT8 always)")
        if self.gate is not None and not self.gate >= 1.0:
            raise AutoGLMError(f"the INT4 gate's target is an expected perplexity ratio against float, at least 1.0 "
                               f"(1.04: at most 4 % above float's perplexity), got {self.gate}")


def int4_export(export_dir: Path, out_dir: Path, data: Path, settings: Int4Settings = Int4Settings(),
                log: Callable[[str], None] = print, threads: int | None = None) -> Path:
    """Write (or reuse) the INT4 model of ``export_dir`` in ``out_dir``; returns ``out_dir``."""
    settings.check()
    export = _float_export(export_dir, settings)
    if not settings.calibrated:
        return _nearest(OpenedExport.of(export, widen=True), out_dir, settings, log)
    opened = OpenedExport.of(export)
    spec = export.spec
    separator = spec.eos_token_ids[0] if spec.eos_token_ids else None
    windows = token_windows(data, export_dir, settings.windows, settings.seq_len, separator)
    from ..calib.image_windows import calibration_images, image_digest, then_text, with_image_windows
    from ..calib.statistics import quantizable_inputs

    images = calibration_images(data) if spec.vision else []
    inputs = quantizable_inputs(export_dir, False, [])
    int8_linears = tuple(sorted(n for n in inputs if kind_of(n) in settings.int8_kinds))
    layers = layer_groups(opened)
    if settings.gate is not None and layers is not None:
        raise AutoGLMError(f"the INT4 gate runs the whole float graph and a switchable INT4 graph at once; {export_dir} "
                           f"holds over {GRAPH_BYTES / 1024**3:.0f} GiB of float32 weights, which the INT4 build "
                           "takes layer by layer: build without --int4-gate (or keep kinds at INT8 with --int4-int8)")
    gptq, rounding = gptq_linears(spec, [n for n in inputs if n != "lm_head" and n not in int8_linears], settings,
                                  layers)
    more = token_windows(data, export_dir, settings.gram_windows, settings.seq_len, separator) if gptq else None
    held = token_windows(data, export_dir, GATE_WINDOWS, GATE_SEQ_LEN, separator) if settings.gate else None
    made = {"source": export.identity(), "version": VERSION, "settings": _identity(settings),
            "data_sha256": windows.sha256, "images_sha256": [image_digest(i) for i in images],
            "gram_data_sha256": more.sha256 if more else None, "gate_data_sha256": held.sha256 if held else None}
    if _cached(out_dir, made, "its export, data and settings", log):
        return out_dir
    t0 = time.perf_counter()
    rows, shown = (windows.windows, None) if not images else with_image_windows(opened, windows.windows, images)
    first = len(rows)  # the first batch: AWQ's rows are taken from it
    if more is not None:
        rows, shown = then_text(rows, shown, more.windows)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_siblings(out_dir):
        log(f"removed {stale}, left by a run that was killed")
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=scratch_prefix(out_dir)) as scratch:
        stats_plan = CalibPlan(inputs, gram=gptq, batch_size=first, threads=threads, max_graph_bytes=GRAPH_BYTES)
        weights, plan, report = _round(opened, stats_plan, (rows, shown), int8_linears, settings,
                                       Path(scratch) if layers else None, log)
        log(f"linear inputs of {len(rows)} windows ({len(images)} with an image) gathered and rounded in "
            f"{time.perf_counter() - t0:.1f} s; INT4 rounding: {rounding}")
        with staged_directory(out_dir, True) as tmp:
            t1 = time.perf_counter()
            plan, gate = _write(Path(scratch), tmp, export_dir, weights, plan, export.max_seq_len, held, settings,
                                threads, log)
            log(f"INT4 graph written in {time.perf_counter() - t1:.1f} s")
            _finish(tmp, export, settings, {**made, "linears": len(inputs), "seconds": round(time.perf_counter() - t0, 1),
                                            "weights": _weights_text(settings, len(plan.int8_linears) - len(int8_linears)),
                                            "int8_linears": list(plan.int8_linears), "rounding": rounding,
                                            "awq": report, "gate": gate})
    return out_dir


def _float_export(export_dir: Path, settings: Int4Settings) -> ExportRecord:
    """The record of the float export the INT4 model is made from: float32 for the calibrated
    rounding (which runs its graph), float32 or float16 for rounding to nearest; else the reason."""
    export = ExportRecord.read(export_dir)
    if precision(export.precision).quantized or export.dtype not in ("float32", "float16"):
        raise AutoGLMError(f"{export_dir} is not a float export; int4-awq is made from a float32 one "
                           "(autoglm-trt export CHECKPOINT -o DIR, or build from the checkpoint)")
    if settings.calibrated and export.dtype != "float32":
        raise AutoGLMError(f"{export_dir} is a {export.dtype} export; int4-awq's calibration runs the float32 graph "
                           "(autoglm-trt export CHECKPOINT -o DIR --dtype float32), or build with --int4-rounding "
                           "nearest, which reads a float16 export's weights alone")
    return export


def _nearest(opened: OpenedExport, out_dir: Path, settings: Int4Settings, log: Callable[[str], None]) -> Path:
    """The INT4 model without calibration (``settings.calibrated`` False): each weight rounded to
    nearest in its block, no AWQ scales, the float graph never run; a float16 export's weights
    widened to float32 as they are read (exact), as int8-wo reads them."""
    from ..calib.statistics import quantizable_inputs

    export, spec = opened.record, opened.spec
    inputs = quantizable_inputs(opened.dir, False, [])
    int8_linears = tuple(sorted(n for n in inputs if kind_of(n) in settings.int8_kinds))
    made = {"source": export.identity(), "version": VERSION, "settings": _identity(settings), "data_sha256": None,
            "images_sha256": [], "gram_data_sha256": None, "gate_data_sha256": None}
    if _cached(out_dir, made, "its export and settings", log):
        return out_dir
    t0 = time.perf_counter()
    log(f"rounding {len(inputs)} linears' weights to INT4 to nearest (no calibration)"
        + (" from a float16 export, widened to float32 as they are read" if export.dtype == "float16" else ""))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_siblings(out_dir):
        log(f"removed {stale}, left by a run that was killed")
    plan = QuantPlan.weights_only(sorted([*inputs, "lm_head"]), bits=4, block=settings.block,
                                  symmetric=settings.symmetric, int8_linears=int8_linears, gram={},
                                  int8_embedding=settings.int8_embedding, int8_channels=settings.int8_channels)
    weights = SmoothedWeights(opened.weights, spec, {})
    with staged_directory(out_dir, True) as tmp:
        write_int8_graph(tmp, GRAPH, spec, weights, plan, export.max_seq_len, settings.dtype)
        log(f"INT4 graph written in {time.perf_counter() - t0:.1f} s")
        _finish(tmp, export, settings, {**made, "linears": len(inputs), "seconds": round(time.perf_counter() - t0, 1),
                                        "weights": _weights_text(settings, 0), "int8_linears": list(int8_linears),
                                        "rounding": "to nearest (--int4-rounding nearest: no calibration, no AWQ "
                                                    "scales)", "awq": {}, "gate": None})
    return out_dir


def _cached(out_dir: Path, made: dict, what: str, log: Callable[[str], None]) -> bool:
    """Whether ``out_dir`` holds the INT4 model that ``made`` describes already (and if so, says so)."""
    if (out_dir / EXPORT_RECORD).is_file() and _same(ExportRecord.read(out_dir).made_by("int4"), made):
        log(f"reusing the INT4 model in {out_dir} ({what} match)")
        return True
    return False


def _finish(tmp: Path, export: ExportRecord, settings: Int4Settings, made: dict) -> None:
    """The INT4 model's record (``export``'s, for its graph, with how it was ``made``) and the
    tokenizer files, into its staged directory ``tmp``."""
    record = export.derived(file=GRAPH, data_file=GRAPH + ".data", precision="int4-awq", dtype=settings.dtype)
    record["int4"] = made
    copy_tokenizer_files(export.dir, tmp)
    ExportRecord.write(tmp, record)


def _identity(settings: Int4Settings) -> dict:
    """The settings as the cache compares them: ``int8_channels`` only where set, so the models
    cached before it existed keep their identity."""
    made = asdict(settings)
    if not settings.int8_channels:
        del made["int8_channels"]
    return made


def _write(scratch: Path, out: Path, export_dir: Path, weights: SmoothedWeights, plan: QuantPlan, max_seq_len: int,
           held: TokenWindows | None, settings: Int4Settings, threads: int | None,
           log: Callable[[str], None]) -> tuple[QuantPlan, dict | None]:
    """The INT4 graph written in ``out`` in ``settings.dtype``: gated on the windows ``held`` where the
    settings say so (the gate judges the float32 graph); the plan written and the gate's report
    (None: no gate)."""
    gate = None
    if held is not None and settings.gate is not None:
        plan, gate = gated_plan(scratch, out, GRAPH, export_dir, weights, plan, max_seq_len, held.windows,
                                settings.gate, threads, log)
    if gate is None or settings.dtype != "float32":
        write_int8_graph(out, GRAPH, weights.spec, weights, plan, max_seq_len, settings.dtype)
    return plan, gate


def _round(opened: OpenedExport, stats_plan: CalibPlan, batches: tuple, int8_linears: tuple[str, ...],
           settings: Int4Settings, scratch: Path | None,
           log: Callable[[str], None]) -> tuple[SmoothedWeights, QuantPlan, dict]:
    """The statistics pass (``batches``: the windows and their images; the plan's batch is the
    first one, from which AWQ takes its rows) with AWQ's search and GPTQ's rounding of the plan's
    ``gram`` linears: on each group of layers as the pass finishes it when ``scratch`` (a folder for
    the rounded weights) is given, else after the whole model's pass. Returns the AWQ-scaled
    weights, the plan that writes the graph and AWQ's report."""
    from ..calib.statistics import gather

    rows, shown = batches
    spec, inputs = opened.spec, stats_plan.inputs
    decoder = [n for n in inputs if n != "lm_head"]
    awq = AwqSearch(spec, settings.block, settings.symmetric, len(decoder), log) if settings.awq else None
    rounder = LayerRounding(opened, awq, settings.block, settings.symmetric, scratch) if scratch is not None else None
    st = gather(opened, rows, stats_plan, shown, on_group=rounder)
    if awq is not None:  # the whole model's pass (the layer by layer one searched each group as it went)
        awq.add(st.stats.sample, st.weights, [n for n in decoder if n in st.stats.sample])
    scales = awq.scales if awq is not None else {}
    plan = QuantPlan.weights_only(sorted([*inputs, "lm_head"]), bits=4, block=settings.block,
                                  symmetric=settings.symmetric, int8_linears=int8_linears,
                                  gram=scaled_grams(st.stats.gram, scales), int8_embedding=settings.int8_embedding,
                                  int8_channels=settings.int8_channels,
                                  rounded=rounder.loaders() if rounder is not None else None)
    if rounder is not None and rounder.files:
        log(f"GPTQ rounded {len(rounder.files)} linears layer by layer ({rounder.seconds:.1f} s with AWQ's search)")
    return SmoothedWeights(st.weights.base, spec, scales), plan, awq.report() if awq is not None else {}


def _weights_text(settings: Int4Settings, gated: int) -> str:
    return (f"{'int4 symmetric' if settings.symmetric else 'uint4 with zero points'}, one scale (a float16 "
            f"value) per {settings.block} inputs of each output, dequantized to {settings.dtype}; LM head "
            + "".join(f"and {k} " for k in settings.int8_kinds)
            + (f"and {gated} linears the gate kept " if gated else "")
            + ("int8 per output channel" if settings.int8_channels else "int8 per 32")
            + ("; token embedding int8 per 32" if settings.int8_embedding else ""))


def layer_groups(opened: OpenedExport) -> list[list[int]] | None:
    """The groups of layers the statistics pass takes at a time (``calib.layerwise``), or None
    where it runs the whole float graph at once."""
    from ..calib.layerwise import layer_groups as groups

    weights = opened.weights
    return groups(weights, opened.spec.num_layers, GRAPH_BYTES) if weights.total_bytes() > GRAPH_BYTES else None


def gptq_linears(spec: ModelSpec, names: list[str], settings: Int4Settings,
                 layers: list[list[int]] | None = None) -> tuple[tuple[str, ...], str]:
    """The linears whose weights GPTQ rounds (all of ``names``, or none), and how the record says
    the weights were rounded. ``layers``: the layer by layer pass's groups, whose Gram matrices are
    held one group at a time (None: all at once)."""
    from ..graph.names import input_channels, layer_of

    if not settings.gptq:
        return (), "to nearest (gptq off)"
    held = max(sum(4 * input_channels(spec, n) ** 2 for n in names if layer_of(n) in group)
               for group in layers or [list(range(spec.num_layers))])
    if held > GRAM_BYTES:
        return (), (f"to nearest (GPTQ's Gram matrices would take {held / 1024**3:.1f} GiB"
                    + (" for one group of layers" if layers else "") + f", over {GRAM_BYTES / 1024**3:.0f} GiB)")
    return tuple(sorted(names)), ("GPTQ" + (" layer by layer" if layers else "")
                                  + f", Gram matrices over {settings.windows} + {settings.gram_windows} windows "
                                  f"of {settings.seq_len} calibration tokens")


def scaled_grams(grams: dict[str, np.ndarray], scales: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each Gram matrix X^T X as the INT4 linear sees its input, X / s under AWQ's scales s: divided
    by s s^T (in place)."""
    return {name: scaled(gram, scales.get(name)) for name, gram in grams.items()}


def _same(have: dict, made: dict) -> bool:
    return json.dumps({k: have.get(k) for k in made}, sort_keys=True) == json.dumps(made, sort_keys=True)
