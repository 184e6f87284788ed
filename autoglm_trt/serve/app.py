"""The ASGI app: routing, auth, back-pressure and errors; the serving itself is in ``serving``.

    GET  /health               200 while the engine's loop is alive, 503 while draining
    GET  /metrics              Prometheus text format
    GET  /v1/models            the one served model
    POST /v1/completions       OpenAI completions (``prompt``: text or token ids), SSE when ``stream``
    POST /v1/chat/completions  OpenAI chat completions through the engine's chat template

With an API key, everything but ``/health`` needs ``Authorization: Bearer KEY`` (401 without).
Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``: a client's
mistake is a 4xx that says what was wrong, never a 500.
"""

from __future__ import annotations

import hmac
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import AutoGLMError
from ..runtime import Engine, ImageOptions
from .metrics import ServerMetrics
from .protocol import ChatCompletionRequest, CompletionRequest, error_body
from .serving import ApiError, Serving


@dataclass
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # queued requests beyond this get 429
    request_timeout: float | None = None  # seconds; the response then ends with finish_reason "length"
    drain_seconds: float = 30.0  # SIGTERM: how long running requests may take to finish
    prefix_caching: bool = True
    images: ImageOptions | None = None  # an image-text engine's image limits


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    app = FastAPI(title="autoglm-trt", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = ServerMetrics(engine.stats)
    serving = Serving(engine, cfg.served_model_name, metrics, cfg.max_waiting, cfg.request_timeout)
    app.state.serving = serving

    def check(request: Request, draining_ok: bool = False) -> None:
        if cfg.api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {cfg.api_key}".encode()):
                raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", "invalid_api_key")
        if serving.draining and not draining_ok:
            raise ApiError(503, "the server is shutting down; retry on another replica", "service_unavailable")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.rejected.labels(str(exc.status)).inc()
        return JSONResponse(error_body(exc.message, exc.type, exc.code, exc.param), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message, where = f"the request body is not valid JSON ({first.get('msg', '')})", ""
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
        metrics.rejected.labels("400").inc()
        return JSONResponse(error_body(message, "invalid_request_error", "invalid_value", where or None), 400)

    @app.exception_handler(AutoGLMError)
    async def _engine_refused(request: Request, exc: AutoGLMError) -> JSONResponse:
        metrics.rejected.labels("400").inc()
        return JSONResponse(error_body(str(exc), "invalid_request_error", "invalid_value"), 400)

    @app.get("/health")
    async def health() -> Response:
        if serving.draining:
            return JSONResponse({"status": "draining"}, 503)
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        check(request, draining_ok=True)
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        check(request)
        return JSONResponse({"object": "list", "data": [{"id": cfg.served_model_name, "object": "model",
                                                          "created": int(time.time()), "owned_by": "autoglm-trt"}]})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check(request)
        return await serving.complete(request, body, body.prompt, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        check(request)
        return await serving.complete(request, body, [m.as_engine_message() for m in body.messages], chat=True)

    return app
