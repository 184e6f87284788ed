"""Commands that make and inspect models: export, calibrate, eval, build, inspect, doctor."""

from __future__ import annotations

from pathlib import Path

import click

from ..backends.registry import AUTO, names
from ..errors import AutoGLMError
from ..precisions import NAMES, TABLE
from . import _log, cli


@cli.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Output directory (must not exist unless --force).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Type of the weights, GEMMs and KV cache (norms, softmax and logits stay float32).")
@click.option("--max-seq-len", type=int, default=None,
              help="Longest sequence the graph allows [default: min(max_position_embeddings, 8192)].")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Compare with transformers after export and fail beyond tolerance.")
@click.option("--tolerance", type=float, default=None,
              help="Largest accepted |logit difference| [default: 1e-2 for float32, 0.25 for float16].")
@click.option("--allow-pickle", is_flag=True, help="Accept pickled pytorch_model*.bin weights (trusted sources only).")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
def export_cmd(checkpoint: Path, out_dir: Path, dtype: str, max_seq_len: int | None, validate: bool,
               tolerance: float | None, allow_pickle: bool, force: bool) -> None:
    """Export a Hugging Face CHECKPOINT directory to a paged-KV ONNX graph."""
    from ..export.pipeline import ExportConfig, export_checkpoint

    result = export_checkpoint(
        ExportConfig(checkpoint=checkpoint, out_dir=out_dir, dtype=dtype, max_seq_len=max_seq_len,
                     validate=validate, tolerance=tolerance, allow_pickle=allow_pickle, force=force),
        log=_log,
    )
    click.echo(f"exported to {result.out_dir} in {result.seconds:.1f} s")


@cli.command("calibrate")
@click.argument("export_dir", type=click.Path(path_type=Path))
@click.option("--calib", "data", type=click.Path(path_type=Path), default=None,
              help="Directory of .txt/.jsonl calibration text "
                   "[default: the set shipped with the package, autoglm_trt/calib/data].")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=Path))
@click.option("--method", type=click.Choice(["entropy", "max", "percentile", "auto"]), default="entropy",
              show_default=True, help="Activation threshold search (auto: per tensor, least INT8 output error).")
@click.option("--calib-samples", "num_samples", type=int, default=128, show_default=True)
@click.option("--calib-seq-len", "seq_len", type=int, default=128, show_default=True)
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option("--percentile", type=float, default=99.99, show_default=True)
@click.option("--hist-row-stride", type=int, default=2, show_default=True,
              help="The activation histograms take one token row in this many of each window (1: every row).")
@click.option("--smoothquant", "alpha", type=float, default=0.8, show_default=True,
              help="SmoothQuant migration strength alpha; 0 turns it off.")
@click.option("--quantize-lm-head/--float-lm-head", default=True, show_default=True,
              help="Offer the LM head to INT8 (the accuracy gate still decides).")
@click.option("--rotate", default="all", show_default=True,
              help="Linear kinds (qkv, o_proj, gate_up, down, lm_head) whose input gets a Hadamard rotation, "
                   "comma-separated; 'all' or 'none'.")
@click.option("--keep-float", multiple=True, help="Linear to keep in float, e.g. layers.3.down (repeatable).")
@click.option("--gate/--no-gate", default=True, show_default=True,
              help="Check accuracy against the float graph and keep the fewest linears in float until it holds.")
@click.option("--bias-correction/--no-bias-correction", default=True, show_default=True,
              help="Offer each INT8 linear's mean output error as a bias; the gate keeps a kind's where it helps.")
@click.option("--target-ppl-ratio", type=float, default=1.015, show_default=True,
              help="The gate's bound on the expected perplexity ratio against the float graph, exp(mean KL), on "
                   "held-back calibration windows.")
@click.option("--target-top1", type=float, default=0.91, show_default=True,
              help="The gate's bound on top-1 agreement with the float graph on the same windows.")
@click.option("--graph-memory", "graph_gb", type=click.FloatRange(min=0.001), default=1.0, show_default=True,
              help="GiB of weights per statistics graph: a larger model is calibrated layer by layer, in groups of "
                   "layers up to this size.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where the statistics pass runs (cuda needs onnxruntime-gpu).")
@click.option("--force", is_flag=True, help="Replace an output made from another model or data.")
def calibrate_cmd(export_dir: Path, data: Path | None, out_dir: Path, method: str, num_samples: int, seq_len: int,
                  batch_size: int, percentile: float, hist_row_stride: int, alpha: float, quantize_lm_head: bool,
                  rotate: str, keep_float: tuple[str, ...], gate: bool, bias_correction: bool, target_ppl_ratio: float,
                  target_top1: float, graph_gb: float, device: str, force: bool) -> None:
    """INT8-calibrate a float32 EXPORT_DIR: Q/DQ ONNX, TensorRT calibration cache, calib.json."""
    from ..calib.pipeline import DEFAULT_DATA, CalibConfig, calibrate

    if data is None:
        data = DEFAULT_DATA
        _log(f"no --calib given: using the default calibration set {data}")
    calibrate(CalibConfig(export_dir=export_dir, data=data, out_dir=out_dir, method=method, num_samples=num_samples,
                          seq_len=seq_len, batch_size=batch_size, percentile=percentile,
                          hist_row_stride=hist_row_stride,
                          smoothquant_alpha=alpha or None, quantize_lm_head=quantize_lm_head,
                          rotate=_rotate_kinds(rotate),
                          keep_float=list(keep_float), gate=gate, bias_correction=bias_correction,
                          target_ppl_ratio=target_ppl_ratio,
                          target_top1=target_top1, max_graph_bytes=int(graph_gb * 1024**3), device=device,
                          force=force), log=_log)
    click.echo(f"calibrated model written to {out_dir}")


def _rotate_kinds(value: str) -> list[str]:
    from ..graph.names import KINDS

    if value == "all":
        return list(KINDS)
    return [] if value == "none" else [k.strip() for k in value.split(",") if k.strip()]


@cli.command("eval")
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--text", required=True, type=click.Path(path_type=Path), help="UTF-8 text (file or directory).")
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="Hugging Face checkpoint or model directory to compare with.")
@click.option("--seq-len", type=int, default=256, show_default=True)
@click.option("--max-chunks", type=int, default=None)
@click.option("--max-ppl-ratio", type=float, default=None, help="Fail (exit 1) if ppl / ref_ppl is above this.")
@click.option("--min-top1", type=float, default=None, help="Fail (exit 1) if top-1 agreement is below this.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--step-tokens", type=click.IntRange(1), default=None,
              help="Feed each window N tokens per step through the paged KV pool (1: pure decode), so that "
                   "every step reads its past from the pool [default: one prefill per window].")
def eval_cmd(model: Path, text: Path, reference: Path | None, seq_len: int, max_chunks: int | None,
             max_ppl_ratio: float | None, min_top1: float | None, as_json: bool, step_tokens: int | None) -> None:
    """Perplexity of MODEL (export, calibration or engine directory) on a text, optionally against a reference."""
    import json

    from ..evaluate import evaluate, gate_failures

    if (max_ppl_ratio is not None or min_top1 is not None) and reference is None:
        raise AutoGLMError("--max-ppl-ratio and --min-top1 need --reference")
    res = evaluate(model, text, reference, seq_len=seq_len, max_chunks=max_chunks, log=None if as_json else _log,
                   step_tokens=step_tokens)
    if as_json:
        click.echo(json.dumps(res))
    else:
        click.echo(f"perplexity {res['ppl']:.4f} over {res['tokens']} predicted tokens")
        if reference is not None:
            click.echo(f"reference perplexity {res['ref_ppl']:.4f}, ratio {res['ppl_ratio']:.4f}, top-1 agreement "
                       f"{res['top1_agreement']:.4f}, mean KL {res['kl']:.5f} nats")
    failures = gate_failures(res, max_ppl_ratio, min_top1) if reference is not None else []
    if failures:
        raise AutoGLMError("accuracy gate failed: " + "; ".join(failures))


@cli.command("build")
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--precision", type=click.Choice(NAMES), default="int8", show_default=True,
              help="; ".join(f"{p.name}: {p.help}" for p in TABLE) + ".")
@click.option("--calib", type=click.Path(path_type=Path), default=None,
              help="Calibration text for int8 and int4-awq [default: the set shipped with the package, "
                   "autoglm_trt/calib/data].")
@click.option("--backend", type=click.Choice([AUTO, *names()]), default=AUTO, show_default=True)
@click.option("--config", "config_file", type=click.Path(path_type=Path), default=None, help="Build config (YAML).")
@click.option("-o", "--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Engine directory [default: engines/<source name>-<precision>].")
@click.option("--max-batch-size", type=int, default=None)
@click.option("--max-input-len", type=int, default=None)
@click.option("--max-seq-len", type=int, default=None)
@click.option("--kv-block-size", type=int, default=None)
@click.option("--kv-num-blocks", type=int, default=None)
@click.option("--kv-memory-bytes", type=int, default=None)
@click.option("--workspace-bytes", type=int, default=None)
@click.option("--opt-level", "builder_optimization_level", type=int, default=None,
              help="TensorRT builder optimization level (0-5).")
@click.option("--threads", type=int, default=None, help="ONNX Runtime intra-op threads (0: all cores).")
@click.option("--kv-cache-dtype", type=click.Choice(["float32", "float16", "int8"]), default=None,
              help="KV cache storage [default: the engine's float dtype].")
@click.option("--kv-scales", type=click.Choice(["head", "token"]), default=None,
              help="int8 KV cache: calibrated static scales per KV head (TensorRT builds them), or a scale "
                   "made with each token and KV head (closer to float; ONNX Runtime) [default: head].")
@click.option("--max-pixels", type=int, default=None,
              help="Image-text models: the most pixels an image is resized to [default: the checkpoint's "
                   "preprocessor_config.json; Open-AutoGLM serves with 5000000].")
@click.option("--max-images", type=int, default=None, help="Image-text models: images per prompt [default: 10].")
@click.option("--int4-block", type=int, default=None,
              help="int4-awq: inputs per weight scale (a power of two, at least 16; TensorRT takes 64 or 128) "
                   "[default: 32 on ONNX Runtime; on TensorRT the larger of 128 and 64 that divides the model's "
                   "widths].")
@click.option("--int4-int8", default="", metavar="KINDS",
              help="int4-awq: kinds of linear kept at INT8 (comma-separated of qkv, o_proj, gate_up, down), "
                   "as the LM head is [default: none].")
@click.option("--int4-gate", type=float, default=None, metavar="RATIO",
              help="int4-awq: keep the fewest most sensitive linears at INT8 for the expected perplexity ratio "
                   "against float on calibration text to be at most RATIO, e.g. 1.04 [default: no gate].")
@click.option("--int4-rounding", type=click.Choice(["awq", "nearest"]), default="awq", show_default=True,
              help="int4-awq: awq: AWQ's scales and GPTQ's rounding on calibration text (hours for a 9B on a few "
                   "cores); nearest: each weight rounded to nearest in its block, no calibration, from a float32 "
                   "or float16 export (minutes; less accurate).")
@click.option("--print-config", is_flag=True, help="Print the effective build config and exit.")
@click.option("--force", is_flag=True, help="Replace an existing engine directory.")
def build_cmd(source: Path, precision: str, calib: Path | None, backend: str, config_file: Path | None,
              out_dir: Path | None, int4_block: int | None, int4_int8: str, int4_gate: float | None,
              int4_rounding: str, print_config: bool, force: bool, **overrides) -> None:
    """Build an engine from a Hugging Face checkpoint or an export directory SOURCE."""
    from ..builder.config import dump_config, load_config
    from ..builder.pipeline import BuildRequest, build_engine

    cfg = load_config(config_file, overrides)
    if print_config:
        click.echo(dump_config(cfg), nl=False)
        return
    out = out_dir or Path("engines") / f"{source.name}-{precision}"
    build_engine(BuildRequest(source=source, out_dir=out, precision=precision, calib=calib, backend=backend,
                              config=cfg, force=force, int4_block=int4_block,
                              int4_int8=tuple(k for k in int4_int8.split(",") if k), int4_gate=int4_gate,
                              int4_rounding=int4_rounding), log=_log)
    click.echo(f"engine: {out}")


@cli.command("inspect")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def inspect_cmd(engine_dir: Path, as_json: bool) -> None:
    """Summarise an engine: manifest, KV layout, fusion report."""
    import json

    from ..artifacts import Manifest
    from ..backends.registry import backend
    from ..builder.report import load_report, summary

    manifest = Manifest.read(engine_dir)
    report = load_report(manifest)
    record, lines = backend(manifest.backend).inspect(manifest, report)
    if as_json:
        click.echo(json.dumps({"manifest": manifest.data, "fusion_report": report, "decode_graph": record}, indent=1))
        return
    click.echo(summary(manifest, report))
    for line in lines:
        click.echo(line)


@cli.command("doctor")
@click.argument("engine_dir", type=click.Path(path_type=Path))
def doctor_cmd(engine_dir: Path) -> None:
    """Check that ENGINE_DIR is intact and can run on this machine."""
    from ..artifacts import Manifest
    from ..backends import backend_problems, engine_file_problems
    from ..backends.registry import backend

    manifest = Manifest.read(engine_dir)
    checks = [("files and hashes", manifest.verify_files()), ("backend", backend_problems(manifest)),
              ("engine file", engine_file_problems(manifest))]
    bad = False
    for what, problems in checks:
        if problems:
            bad = True
            for p in problems:
                click.echo(f"PROBLEM  {what}: {p}")
        else:
            click.echo(f"ok       {what}")
    if bad:
        raise AutoGLMError(f"{engine_dir} cannot be used on this machine as it is (see above)")
    for line in backend(manifest.backend).findings(manifest) + _vision_report(manifest):
        click.echo("info     " + line)
    click.echo(f"{engine_dir}: {manifest.backend} {manifest.precision} engine is ready to run here")


def _vision_report(manifest) -> list[str]:
    """An image-text engine's vision encoder: what runs it, and the images its defaults take."""
    from ..artifacts import ExportRecord
    from ..backends.registry import backend
    from ..model.image import ImageConfig
    from ..runtime.images import ImageOptions, image_options
    from ..serve.guard import default_max_body_bytes

    vision = ExportRecord.read(manifest.dir).vision()
    if vision is None:
        return []
    options = image_options(manifest, ImageOptions())
    pixels = ImageConfig.from_dir(manifest.dir, **({} if options.max_pixels is None
                                                   else {"max_pixels": options.max_pixels})).max_pixels
    patches = vision.max_patches(pixels)
    runs = backend(manifest.backend).vision_runs(manifest)
    body = default_max_body_bytes(options.max_images or 0, pixels)
    return [f"vision encoder: {runs}; by default images of up to {pixels:,} pixels ({patches:,} patches, "
            f"{patches // vision.merge_size ** 2:,} image tokens), {options.max_images} a prompt, encoded one at a time",
            f"serve takes request bodies of up to {body:,} bytes by default ({options.max_images} PNG images of "
            f"{pixels:,} pixels, uncompressed RGBA, as base64; serve --max-body-bytes to change)"]
