"""``autoglm-trt triton-serve``: find a tritonserver, start it on a model repository, wait for ready.

The binary is ``tritonserver`` on ``PATH`` (NVIDIA's containers) or the one ``make triton``
installs in ``.triton/`` (tritonserver 2.51 from PyPI's ``nvidia-pytriton`` wheel, with its
Python backend). Servers bind 127.0.0.1 unless ``--host`` says otherwise. SIGTERM and SIGINT
are passed on to tritonserver, which finishes its in-flight requests and exits.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from ..errors import AutoGLMError

LOCAL = Path(__file__).resolve().parents[2] / ".triton"
INSTALL_HINT = "install one with `make triton` (python tools/install_triton.py) or use NVIDIA's tritonserver container"


def find_tritonserver() -> tuple[Path, Path | None]:
    """(binary, backend directory or None for the binary's default)."""
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path), None
    local = LOCAL / "pytriton" / "tritonserver"
    if (local / "bin" / "tritonserver").is_file():
        return local / "bin" / "tritonserver", local / "backends"
    raise AutoGLMError(f"no tritonserver found on PATH or in {LOCAL}; {INSTALL_HINT}")


def local_site() -> Path | None:
    """The numpy 1.x that the local install keeps for the Python backend, if any."""
    return LOCAL / "site" if (LOCAL / "site").is_dir() else None


def command(repo: Path, host: str, http_port: int, grpc_port: int, metrics_port: int) -> list[str]:
    binary, backends = find_tritonserver()
    cmd = [str(binary), f"--model-repository={Path(repo).resolve()}", f"--http-address={host}",
           f"--grpc-address={host}", f"--metrics-address={host}", f"--http-port={http_port}",
           f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}", "--log-verbose=0"]
    if backends is not None:
        cmd.append(f"--backend-directory={backends}")
    return cmd


def wait_ready(proc: subprocess.Popen, host: str, http_port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{host}:{http_port}/v2/health/ready"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AutoGLMError(f"tritonserver exited with code {proc.returncode} before it was ready (see its log)")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AutoGLMError(f"tritonserver was not ready within {timeout:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a running tritonserver (it drains), and kill it if it has not exited within ``grace_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def triton_serve(repo: Path, host: str, http_port: int, grpc_port: int, metrics_port: int, ready_timeout: float,
                 log=print) -> int:
    if not Path(repo).is_dir():
        raise AutoGLMError(f"model repository {repo} does not exist; write one with `autoglm-trt triton ENGINE -o DIR`")
    proc = subprocess.Popen(command(repo, host, http_port, grpc_port, metrics_port))
    forward = lambda sig, frame: proc.send_signal(signal.SIGTERM)  # noqa: E731
    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        wait_ready(proc, host, http_port, ready_timeout)
        log(f"tritonserver ready: http://{host}:{http_port} (generate: /v2/models/NAME/generate[_stream]), "
            f"grpc {host}:{grpc_port}, metrics http://{host}:{metrics_port}/metrics")
        return proc.wait()
    finally:
        stop(proc, 60)
        for s, h in old.items():
            signal.signal(s, h)
