"""The ASGI app: routing, auth, back-pressure and errors; the serving itself is in ``serving``.

    GET  /health               200 while the engine's loop is alive, 503 while draining
    GET  /metrics              Prometheus text format
    GET  /v1/models            the one served model
    POST /v1/completions       OpenAI completions (``prompt``: text or token ids), SSE when ``stream``
    POST /v1/chat/completions  OpenAI chat completions through the engine's chat template

With an API key, everything but ``/health`` needs ``Authorization: Bearer KEY``: without it a
401, before the body is read (``guard.Guard``, which also bounds the body: 413, and wants JSON:
415). Every error is OpenAI's JSON ``{"error": {"message", "type", "param", "code"}}``, unknown
routes (404) and methods (405) too: a client's mistake is a 4xx that says what was wrong, never
a 500.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from ..errors import AutoGLMError, BusyError
from ..runtime import Engine, ImageOptions
from .guard import CLIENT_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, Guard, default_max_body_bytes, error_json
from .metrics import ServerMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest
from .serving import Serving

ROUTES = "GET /health, GET /metrics, GET /v1/models, POST /v1/completions, POST /v1/chat/completions"


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
           headers: Mapping[str, str] | None = None) -> Response:
    return Response(error_json(message, type_, code, param), status, headers=headers, media_type="application/json")


@dataclass
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting: int = 256  # queued requests beyond this get 429
    request_timeout: float | None = None  # seconds; the response then ends with finish_reason "length"
    drain_seconds: float = 30.0  # SIGTERM: how long running requests may take to finish
    prefix_caching: bool = True
    images: ImageOptions | None = None  # an image-text engine's image limits
    max_body_bytes: int | None = None  # a larger body gets 413 before it is parsed (None: ``body_limit``)
    max_client_priority: int = 0  # the most urgent ``priority`` a client may ask for (lower runs first)
    client_timeout: float = CLIENT_TIMEOUT_S  # seconds a client may pause sending its body (408) or reading its answer
    max_image_memory: int | None = None  # bytes of image embeddings held by requests in flight (None: RAM / 4)


def body_limit(engine: Engine, configured: int | None = None) -> int:
    """The largest request body the server takes: ``configured``, else for an image-text engine its
    image limits' worth (``guard.default_max_body_bytes``: 10 PNG screenshots of 5,000,000 pixels are
    some 270 MB as base64), else ``DEFAULT_MAX_BODY_BYTES``."""
    if configured is not None:
        return configured
    if engine.images is None or engine.prompts.images is None:
        return DEFAULT_MAX_BODY_BYTES
    return default_max_body_bytes(engine.prompts.images.max_images, engine.images.config.max_pixels)


def create_app(engine: Engine, cfg: ServeConfig) -> FastAPI:
    # no redirects: /v1/models/ is a 404 in OpenAI's error JSON, not a 307 to /v1/models
    app = FastAPI(title="autoglm-trt", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    metrics = ServerMetrics(lambda: serving.stats())
    serving = Serving(engine, cfg.served_model_name, metrics, cfg.max_waiting, cfg.request_timeout,
                      cfg.max_client_priority, cfg.max_image_memory)
    app.state.serving = serving
    app.add_middleware(Guard, api_key=cfg.api_key, max_body_bytes=body_limit(engine, cfg.max_body_bytes),
                       rejected=lambda status: metrics.rejected.labels(str(status)).inc(), client_timeout=cfg.client_timeout)

    def check(request: Request, draining_ok: bool = False) -> None:
        if serving.draining and not draining_ok:
            raise ApiError(503, "the server is shutting down; retry on another replica", "service_unavailable")

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        metrics.rejected.labels(str(exc.status)).inc()
        return _error(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        metrics.rejected.labels(str(exc.status_code)).inc()
        if exc.status_code == 404:
            message, code = f"no route {request.method} {request.url.path}; this server has {ROUTES}", "not_found"
        elif exc.status_code == 405:
            message, code = f"{request.url.path} does not take {request.method}; this server has {ROUTES}", \
                "method_not_allowed"
        else:
            message, code = str(exc.detail), None
        return _error(exc.status_code, message, "invalid_request_error", code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            message, where = f"the request body is not valid JSON ({first.get('msg', '')})", ""
        else:
            message = f"{where or 'body'}: {first.get('msg', 'invalid value')}"
        metrics.rejected.labels("400").inc()
        return _error(400, message, "invalid_request_error", "invalid_value", where or None)

    @app.exception_handler(AutoGLMError)
    async def _engine_refused(request: Request, exc: AutoGLMError) -> Response:
        if isinstance(exc, BusyError):
            metrics.rejected.labels("429").inc()
            return _error(429, str(exc), "rate_limit_error", "busy", headers={"Retry-After": "1"})
        metrics.rejected.labels("400").inc()
        return _error(400, str(exc), "invalid_request_error", "invalid_value")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        """A bug: OpenAI's error JSON without the internals (uvicorn logs the traceback)."""
        metrics.rejected.labels("500").inc()
        return _error(500, f"internal server error ({type(exc).__name__}); the server's log has the details",
                      "server_error", "internal_error")

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
