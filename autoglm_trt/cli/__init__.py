"""The ``autoglm-trt`` command line: a thin click group over the library functions.

Every ``AutoGLMError`` becomes a one-line ``Error: ...`` and exit code 1, in one place
(``main``); anything else is a bug and keeps its traceback. The commands live in
``models`` (export, calibrate, eval, build, inspect, doctor), ``run`` (generate, bench,
serve) and ``deploy`` (triton, triton-serve); importing them registers them on the group.
"""

from __future__ import annotations

import sys

import click

from ..errors import AutoGLMError


def _log(msg: str) -> None:
    click.echo(msg, err=True)


@click.group()
@click.version_option(package_name="autoglm-trt")
def cli() -> None:
    """Export GLM/Llama checkpoints to ONNX, calibrate, build engines and generate."""


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds like Ctrl-C: half-written outputs are removed on the way out


def main(argv: list[str] | None = None) -> None:
    import signal

    signal.signal(signal.SIGTERM, _terminated)
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


from . import deploy, models, run  # noqa: E402, F401 - the commands register themselves on ``cli``

if __name__ == "__main__":
    main()
