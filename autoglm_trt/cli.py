"""The ``autoglm-trt`` command line: a thin click group over the library functions.

Every ``AutoGLMError`` becomes a one-line ``Error: ...`` and exit code 1, in one place
(``main``); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .errors import AutoGLMError


def _log(msg: str) -> None:
    click.echo(msg, err=True)


@click.group()
@click.version_option(package_name="autoglm-trt")
def cli() -> None:
    """Export GLM/Llama checkpoints to ONNX, calibrate, build engines and generate."""


@cli.command("export")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=Path),
              help="Output directory (must not exist unless --force).")
@click.option("--dtype", type=click.Choice(["float32", "float16"]), default="float32", show_default=True,
              help="Type of the weights, GEMMs and KV cache (norms, softmax and logits stay float32).")
@click.option("--max-seq-len", type=int, default=None,
              help="Longest sequence the graph allows [default: min(max_position_embeddings, 8192)].")
@click.option("--logits", type=click.Choice(["last", "all"]), default="last", show_default=True,
              help="Logits of each sequence's last new token, or of every new token.")
@click.option("--validate/--no-validate", default=True, show_default=True,
              help="Compare with transformers after export and fail beyond tolerance.")
@click.option("--tolerance", type=float, default=None,
              help="Largest accepted |logit difference| [default: 1e-2 for float32, 0.25 for float16].")
@click.option("--allow-pickle", is_flag=True, help="Accept pickled pytorch_model*.bin weights (trusted sources only).")
@click.option("--force", is_flag=True, help="Replace the output directory if it exists.")
def export_cmd(checkpoint: Path, out_dir: Path, dtype: str, max_seq_len: int | None, logits: str, validate: bool,
               tolerance: float | None, allow_pickle: bool, force: bool) -> None:
    """Export a Hugging Face CHECKPOINT directory to a paged-KV ONNX graph."""
    from .export.pipeline import ExportConfig, export_checkpoint

    result = export_checkpoint(
        ExportConfig(checkpoint=checkpoint, out_dir=out_dir, dtype=dtype, max_seq_len=max_seq_len, logits=logits,
                     validate=validate, tolerance=tolerance, allow_pickle=allow_pickle, force=force),
        log=_log,
    )
    click.echo(f"exported to {result.out_dir} in {result.seconds:.1f} s")


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="autoglm-trt", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except AutoGLMError as exc:
        click.echo(f"Error: {exc}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Interrupted; nothing was left half-written.", err=True)
        sys.exit(130)


if __name__ == "__main__":
    main()
