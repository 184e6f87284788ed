"""``int4-awq``: a float32 export -> the same decoder with INT4 weights (AWQ-scaled), float activations.

Input: a float32 export directory and calibration text. Output directory (the build's cache)::

    model.int4.onnx, model.int4.onnx.data   every decoder linear as a DequantizeLinear of INT4
                                            weights in blocks along the input (opset 21), its
                                            AWQ scales folded into the norms and linears before
                                            it; the LM head INT8 in blocks of 32, as int8-wo's
    export.json                             the export's record, pointing at that graph;
                                            ``int4`` says how it was made
    tokenizer (and vision encoder) files

One batch of calibration windows runs through the float graph for each linear's input rows
(``calib.statistics.gather``); for a vision family (GLM-4.1V) one window per calibration image
follows them, the image's encoder output in its tokens' place (``calib.image_windows``, as the
INT8 calibration does), so the scales see image tokens' activations too. ``calib.awq`` picks
each linear's scales on them. More text windows follow in batches of the same size, and every
row's X^T X is summed per linear (while those Gram matrices fit ``GRAM_BYTES``): GPTQ
(``graph.gptq``) rounds each weight on its linear's Gram matrix as the AWQ-scaled graph feeds it;
past the budget, or with ``gptq`` off, weights are rounded to nearest. ONNX Runtime's optimizer
turns each DequantizeLinear + MatMul into its 4-bit ``MatMulNBits``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..artifacts import EXPORT_RECORD, ExportRecord, copy_tokenizer_files
from ..errors import AutoGLMError
from ..fileutil import staged_directory, write_json
from ..graph.decoder import write_int8_graph
from ..graph.int4 import quantize_int4_blocks
from ..graph.names import KINDS, kind_of
from ..graph.quant import QuantPlan
from ..model.spec import ModelSpec
from ..model.text import token_windows

GRAPH = "model.int4.onnx"
# What this code writes from the same export and settings; a cached result of another version is redone.
VERSION = 3
# The Gram matrices GPTQ needs (float32, in x in per linear) are summed only while they fit this;
# a larger model's INT4 weights are rounded to nearest, and its record says why.
GRAM_BYTES = 2 * 1024**3


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

    def check(self) -> None:
        if self.block < 16 or self.block & (self.block - 1):
            raise AutoGLMError(f"the INT4 block size must be a power of two of at least 16, got {self.block}")
        unknown = sorted(set(self.int8_kinds) - set(KINDS[:-1]))
        if unknown:
            raise AutoGLMError(f"unknown kind of linear {', '.join(unknown)} to keep at INT8; "
                               f"choose from {', '.join(KINDS[:-1])} (the LM head is INT8 always)")


def int4_export(export_dir: Path, out_dir: Path, data: Path, settings: Int4Settings = Int4Settings(),
                log: Callable[[str], None] = print, threads: int | None = None) -> Path:
    """Write (or reuse) the INT4 model of ``export_dir`` in ``out_dir``; returns ``out_dir``."""
    settings.check()
    export = ExportRecord.read(export_dir)
    if export.dtype != "float32" or export.precision != "fp32":
        raise AutoGLMError(f"{export_dir} is not a float32 export; int4-awq is made from one "
                           "(autoglm-trt export CHECKPOINT -o DIR, or build from the checkpoint)")
    spec = export.spec
    separator = spec.eos_token_ids[0] if spec.eos_token_ids else None
    windows = token_windows(data, export_dir, settings.windows, settings.seq_len, separator)
    from ..calib.image_windows import calibration_images, image_digest, then_text, with_image_windows
    from ..calib.statistics import quantizable_inputs

    images = calibration_images(data) if spec.vision else []
    inputs = quantizable_inputs(export_dir, False, [])
    int8_linears = tuple(sorted(n for n in inputs if kind_of(n) in settings.int8_kinds))
    gptq, rounding = gptq_linears(spec, [n for n in inputs if n != "lm_head" and n not in int8_linears], settings)
    more = token_windows(data, export_dir, settings.gram_windows, settings.seq_len, separator) if gptq else None
    made = {"source": export.identity(), "version": VERSION, "settings": asdict(settings),
            "data_sha256": windows.sha256, "images_sha256": [image_digest(i) for i in images],
            "gram_data_sha256": more.sha256 if more else None}
    if (out_dir / EXPORT_RECORD).is_file() and _same(ExportRecord.read(out_dir).data.get("int4", {}), made):
        log(f"reusing the INT4 model in {out_dir} (its export, data and settings match)")
        return out_dir
    from ..calib.statistics import gather

    t0 = time.perf_counter()
    rows, shown = (windows.windows, None) if not images else with_image_windows(export_dir, windows.windows, images)
    first = len(rows)  # the first batch: AWQ's rows are taken from it
    if more is not None:
        rows, shown = then_text(rows, shown, more.windows)
    st = gather(export_dir, spec, rows, inputs, {}, None, first, threads, 1024**3, images=shown, gram=gptq)
    log(f"linear inputs of {len(rows)} windows ({len(images)} with an image) gathered in "
        f"{time.perf_counter() - t0:.1f} s")
    scales, report = awq_scales(spec, st, settings, log) if settings.awq else ({}, {})
    if gptq and not st.stats.gram:
        rounding = "to nearest (the layer-by-layer statistics pass sums no Gram matrices)"
    log(f"INT4 rounding: {rounding}" + (f"; GPTQ rounds {len(st.stats.gram)} linears as the graph is written"
                                        if st.stats.gram else ""))
    from ..calib.smooth import SmoothedWeights

    weights = SmoothedWeights(st.weights.base, spec, scales)
    plan = QuantPlan.weights_only(sorted([*inputs, "lm_head"]), bits=4, block=settings.block,
                                  symmetric=settings.symmetric, int8_linears=int8_linears,
                                  gram=scaled_grams(st.stats.gram, scales))
    with staged_directory(out_dir, True) as tmp:
        t1 = time.perf_counter()
        write_int8_graph(tmp, GRAPH, spec, weights, plan, export.max_seq_len)
        log(f"INT4 graph written in {time.perf_counter() - t1:.1f} s")
        record = export.derived(file=GRAPH, data_file=GRAPH + ".data", precision="int4-awq")
        record["int4"] = {**made, "linears": len(inputs), "seconds": round(time.perf_counter() - t0, 1),
                          "weights": f"{'int4 symmetric' if settings.symmetric else 'uint4 with zero points'}, "
                                     f"one scale per {settings.block} inputs of each output; LM head "
                                     + "".join(f"and {k} " for k in settings.int8_kinds) + "int8 per 32",
                          "rounding": rounding, "awq": report}
        copy_tokenizer_files(export_dir, tmp)
        write_json(tmp / EXPORT_RECORD, record)
    return out_dir


def gptq_linears(spec: ModelSpec, names: list[str], settings: Int4Settings) -> tuple[tuple[str, ...], str]:
    """The linears whose weights GPTQ rounds (all of ``names``, or none), and how the record says
    the weights were rounded."""
    from ..graph.names import input_channels

    if not settings.gptq:
        return (), "to nearest (gptq off)"
    need = sum(4 * input_channels(spec, n) ** 2 for n in names)
    if need > GRAM_BYTES:
        return (), (f"to nearest (GPTQ's Gram matrices would take {need / 1024**3:.1f} GiB, over "
                    f"{GRAM_BYTES / 1024**3:.0f} GiB)")
    return tuple(sorted(names)), (f"GPTQ, Gram matrices over {settings.windows} + {settings.gram_windows} windows "
                                  f"of {settings.seq_len} calibration tokens")


def scaled_grams(grams: dict[str, np.ndarray], scales: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each Gram matrix X^T X as the INT4 linear sees its input, X / s under AWQ's scales s: divided
    by s s^T (in place)."""
    for name, gram in grams.items():
        if name in scales:
            inv = (1.0 / scales[name]).astype(np.float32)
            gram *= inv[:, None]
            gram *= inv[None, :]
    return grams


def _same(have: dict, made: dict) -> bool:
    return json.dumps({k: have.get(k) for k in made}, sort_keys=True) == json.dumps(made, sort_keys=True)


def awq_scales(spec: ModelSpec, st, settings: Int4Settings, log: Callable[[str], None]) -> tuple[dict, dict]:
    """Every decoder linear's AWQ scales on its sampled input rows, and what the search found."""
    from ..calib.awq import awq_scale
    from ..calib.smooth import expand_groups, group_shared
    from ..calib.thresholds import linear_matrix

    def dequantized(w: np.ndarray) -> np.ndarray:
        return quantize_int4_blocks(w, settings.block, settings.symmetric).dequantized()

    def kv_shared(m: np.ndarray) -> np.ndarray:
        return expand_groups(group_shared(m, spec), spec)

    scales, alphas, gains = {}, {}, []
    t0 = time.perf_counter()
    names = sorted(n for n in st.stats.sample if n != "lm_head")
    for k, name in enumerate(names):
        choice = awq_scale(st.stats.sample[name], linear_matrix(st.weights, name, {}), dequantized,
                           kv_shared if name.endswith(".o_proj") else None)
        scales[name], alphas[name] = choice.scale, choice.alpha
        gains.append(choice.rtn_error / max(choice.error, 1e-30))
        if (k + 1) % max(1, len(names) // 10) == 0 or k + 1 == len(names):
            log(f"  AWQ search: {k + 1}/{len(names)} linears ({time.perf_counter() - t0:.1f} s)")
    log(f"AWQ: output error of plain rounding / with the scales, median {np.median(gains):.2f}x over "
        f"{len(names)} linears")
    return scales, {"alpha": alphas, "median_error_ratio": float(np.median(gains))}
