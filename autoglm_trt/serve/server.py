"""``autoglm-trt serve``: one engine behind uvicorn, with a graceful SIGTERM drain.

SIGTERM (Kubernetes' stop signal) starts a drain instead of an immediate stop: ``/health``
answers 503 so that load balancers take the replica out, new requests get 503, running ones
finish (for at most ``drain_seconds``), then uvicorn shuts down, the engine is closed and the
process exits 0. A second SIGTERM or a SIGINT (Ctrl-C) stops at once.
"""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from ..errors import require


def serve(engine_dir: Path, host: str, port: int, cfg, threads: int = 0, log=print,
          spinning: bool = True) -> None:
    for module in ("uvicorn", "fastapi", "prometheus_client"):
        require(module, "autoglm-trt[serve]", "autoglm-trt serve")
    import uvicorn

    from ..runtime import Engine
    from .app import create_app

    engine = Engine.load(engine_dir, threads=threads, prefix_caching=cfg.prefix_caching, images=cfg.images,
                         spinning=spinning)
    app = create_app(engine, cfg)
    serving = app.state.serving

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame) -> None:  # type: ignore[no-untyped-def]
            if sig == signal.SIGTERM and not serving.draining:
                serving.draining = True
                log(f"SIGTERM: draining {serving.inflight} running requests (at most {cfg.drain_seconds:.0f} s)")
                threading.Thread(target=self._drain, daemon=True).start()
                return
            super().handle_exit(sig, frame)

        def _drain(self) -> None:
            deadline = time.monotonic() + cfg.drain_seconds
            while serving.inflight > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            self.should_exit = True

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5,
                            lifespan="off")
    server = DrainingServer(config)
    log(f"serving {engine_dir} as '{cfg.served_model_name}' on http://{host}:{port} "
        f"(auth {'on' if cfg.api_key else 'off'}; /v1/completions, /v1/chat/completions, /health, /metrics)")
    try:
        server.run()
    finally:
        engine.close()
    log("server stopped")
