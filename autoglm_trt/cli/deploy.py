"""Commands that deploy engines on Triton Inference Server: triton, triton-serve."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import _log, cli


@cli.command("triton")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(path_type=Path), help="Model repository to write.")
@click.option("--name", default=None, help="Model name [default: the engine directory's name].")
@click.option("--instances", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Model instances (each loads its own engine).")
@click.option("--threads", type=click.IntRange(0, 256), default=0, help="ONNX Runtime threads per instance (0: all).")
@click.option("--python-path", default=None,
              help="Where the model imports from, ':'-separated [default: .triton/site if present, this package, "
                   "this interpreter's site-packages].")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option("--force", is_flag=True, help="Replace an existing repository.")
def triton_cmd(engine_dir: Path, out_dir: Path, name: str | None, instances: int, threads: int,
               python_path: str | None, prefix_caching: bool, force: bool) -> None:
    """Write a Triton model repository that serves ENGINE_DIR (Python backend, decoupled)."""
    from ..triton.launcher import local_site
    from ..triton.repository import write_repository

    model = write_repository(engine_dir, out_dir, name, instances, threads,
                             python_path.split(":") if python_path else None, local_site(), prefix_caching, force)
    click.echo(f"model repository {out_dir}: model '{model.name}' ({instances} instance(s))")


@cli.command("triton-serve")
@click.argument("repository", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--ready-timeout", type=click.FloatRange(min=1), default=300.0, show_default=True)
def triton_serve_cmd(repository: Path, host: str, http_port: int, grpc_port: int, metrics_port: int,
                     ready_timeout: float) -> None:
    """Start tritonserver on a model REPOSITORY and wait for it (Ctrl-C or SIGTERM stops it)."""
    from ..triton.launcher import triton_serve

    code = triton_serve(repository, host, http_port, grpc_port, metrics_port, ready_timeout, log=_log)
    sys.exit(code)
