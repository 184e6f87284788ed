"""Serving: one OpenAI request -> engine calls; engine output -> a response or SSE chunks.

The engine's loop thread stays the only owner of sequences. A request is prepared in a worker
thread (tokenization and chat templates are bounded, but not free; images are decoded and
encoded there: a request with images on one of ``IMAGE_WORKERS`` threads of its own, so those
waiting for the encoder, which takes one image at a time, never hold every thread of Starlette's
pool that text requests are prepared on), submitted with a sink that hands each text piece to
the event loop (``call_soon_threadsafe``), and awaited there. A request with an output guide is
submitted from a worker thread too, as its grammar is compiled then (``runtime.guided``).
A client that disconnects cancels its request (its KV blocks are freed): a stream by the
cancellation of its generator, a plain request by a look at the connection every
``DISCONNECT_POLL_S`` whatever the model is producing (a plain request's sink carries only its
end), a request whose images are being prepared likewise (``Engine.prepare``'s ``cancel``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import AsyncGenerator, Callable

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from ..errors import AutoGLMError
from ..runtime import Engine
from ..runtime.guided import GRAMMAR_WORKERS, MAX_QUEUED_GRAMMARS, GuideError
from ..runtime.images import PREPARED_AT_ONCE, PreparedPrompt
from ..runtime.request import Prompt
from ..runtime.request import Request as EngineRequest
from .guard import ARRIVED
from .image_memory import ImageMemory, Reservation, default_image_memory
from .metrics import ServerMetrics
from .protocol import (
    ApiError,
    ChatCompletionRequest,
    _Sampling,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    new_id,
    tool_calls,
    usage,
    usage_chunk,
)
from .tool_parsers import ToolFormat, detect

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.25
# threads preparing requests with images: as many as the engine lets decode and preprocess
# their images at once (more would only wait there, holding a thread)
IMAGE_WORKERS = PREPARED_AT_ONCE
# threads submitting requests with an output guide (waiting while the engine compiles it): the
# engine's grammar workers and its queue, no more
GUIDED_SUBMITS = GRAMMAR_WORKERS + MAX_QUEUED_GRAMMARS


class _LoopSink:
    """Pieces from the engine thread into an asyncio queue (never blocks the engine); without
    ``text``, only the end (None). It also carries its request's phases before submission and
    when its headers came (``ServerMetrics.observe``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, text: bool = True, phases: dict[str, float] | None = None,
                 arrived: float | None = None):
        self.loop, self.queue, self.text = loop, asyncio.Queue[str | None](), text
        self.phases, self.arrived = phases, arrived

    def put(self, item: str | None) -> None:
        if item is not None and not self.text:
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


class _Stream(StreamingResponse):
    """A streamed answer whose request is let go however the response ends: its events run to the
    end, or the client left (Starlette cancels the stream), or a send raised (``guard.ClientGone``,
    where Starlette leaves the events' generator suspended); the generator is closed and ``ended``
    runs once, even if the stream never started."""

    def __init__(self, events: AsyncGenerator[str, None], ended: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._events, self._ended = events, ended

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._ended()


def _stopped(reservation: Reservation, job: asyncio.Future) -> None:
    """A request's preparation stopped after its client left: its reservation ends, its outcome
    (``Cancelled``, as a rule) goes unread."""
    reservation.ended = True
    if not job.cancelled():
        job.exception()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class Serving:
    def __init__(self, engine: Engine, model: str, metrics: ServerMetrics, max_waiting: int,
                 request_timeout: float | None, max_client_priority: int = 0, max_image_memory: int | None = None):
        self.engine, self.model, self.metrics = engine, model, metrics
        self.max_waiting, self.request_timeout = max_waiting, request_timeout
        self.max_client_priority = max_client_priority
        self.tool_format = detect(engine.tokenizer)  # the model's own tool calls, for tool_choice "auto"
        self.draining = False
        self.inflight = 0
        self.image_requests = 0  # requests with images not yet submitted: waiting for a worker, or in prepare
        self._image_workers: anyio.CapacityLimiter | None = None  # made in the event loop, on first use
        self._guided: anyio.CapacityLimiter | None = None  # threads submitting requests with a guide
        self.image_memory = ImageMemory(max_image_memory if max_image_memory is not None else default_image_memory())

    def stats(self) -> dict:
        """The engine's stats, with ``images_preparing`` counting the requests with images that wait
        for one of this server's image workers too."""
        stats = self.engine.stats()
        return {**stats, "images_preparing": max(self.image_requests, stats.get("images_preparing", 0))}

    async def complete(self, request: Request, body: _Sampling, prompt: Prompt, chat: bool) -> Response:
        reservation = Reservation()  # of its images' embeddings, made as they are prepared
        try:
            return await self._complete(request, body, prompt, chat, reservation)
        finally:
            reservation.ended = not reservation.outlived  # what its request did not take over is let go

    async def _complete(self, request: Request, body: _Sampling, prompt: Prompt, chat: bool,
                        reservation: Reservation) -> Response:
        if body.model != self.model:
            raise ApiError(404, f"model '{body.model}' is not served here; this server serves '{self.model}'",
                           "invalid_request_error", "model_not_found", "model")
        if body.priority < self.max_client_priority:
            raise ApiError(400, f"priority {body.priority} is more urgent than this server lets clients ask for "
                                f"(lower runs first; at least {self.max_client_priority}: serve --max-client-priority)",
                           param="priority", code="priority_not_allowed")
        stats = self.stats()  # a request whose images are being encoded waits too
        if stats["waiting"] + stats["images_preparing"] >= self.max_waiting:
            raise ApiError(429, f"{self.max_waiting} requests are already waiting; retry shortly",
                           "rate_limit_error", "queue_full", headers={"Retry-After": "1"})
        # tokens, and images decoded and encoded, off the event loop; RequestError -> 400
        tools = body.template_tools() if isinstance(body, ChatCompletionRequest) else None
        called = body.called_tool() if isinstance(body, ChatCompletionRequest) else None
        auto = body.auto_tools() if isinstance(body, ChatCompletionRequest) else []
        if auto and self.tool_format is None:
            raise ApiError(400, 'tool_choice "auto" (the default with tools) needs the model\'s own tool-call format, '
                                "and this model's chat template writes none that this server parses (GLM-4's, "
                                'GLM-4.5\'s, Hermes\'); use "required", a named function, or "none"', param="tool_choice")
        parse = (self.tool_format, auto) if auto and self.tool_format is not None else None
        if body.stream and (body.n > 1 or body.beam_width > 1):  # before any work on the prompt
            raise ApiError(400, "stream carries one choice: n > 1 and beam_width > 1 need stream false",
                           param="stream")
        images = isinstance(body, ChatCompletionRequest) and body.carries_images()
        if images:
            self.image_memory.check_room()  # full already: refused before its images are decoded and encoded
        started = time.perf_counter()
        prepared = await (self._prepare_images(request, prompt, tools, reservation) if images
                          else run_in_threadpool(self.engine.prepare, prompt, None, tools))
        if prepared is None:  # the client left while its images were prepared
            self.metrics.finished.labels("cancelled").inc()
            return Response(status_code=499)
        arrived = getattr(request.state, ARRIVED, started)
        phases = {"read": started - arrived}
        if images:  # the preparation's own phases, and the rest of its time: waits for a thread and a slot
            phases.update(prepared.seconds, images_wait=time.perf_counter() - started - sum(prepared.seconds.values()))
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:
            room = max(1, self.engine.max_seq_len - len(prepared.ids))  # a prompt too long is refused by submit
            max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, room) if not chat else room
        params = body.sampling(max_tokens, self.request_timeout)
        # a stream's sink carries its text; a plain request's only its end (the others are awaited after)
        sink = _LoopSink(asyncio.get_running_loop(), body.stream, phases, arrived)
        req = None
        try:
            if params.guide is not None:  # compiled on the engine's grammar workers: this waits, off the event loop
                if self._guided is None:
                    self._guided = anyio.CapacityLimiter(GUIDED_SUBMITS)
                req = await anyio.to_thread.run_sync(self.engine.submit, prepared, params, sink, limiter=self._guided)
            else:
                req = self.engine.submit(prepared, params, sink)
        finally:
            self.image_memory.submitted(reservation, req)
        self.inflight += 1
        rid = new_id("chatcmpl" if chat else "cmpl")
        if body.stream:
            def ended(req: EngineRequest = req) -> None:  # a client that went away cancels its request
                self._cancel(req)
                self.inflight -= 1

            return _Stream(self._events(req, sink, rid, chat, body.include_usage, called, parse), ended)
        try:
            return await self._whole(request, req, sink, rid, chat, called, parse)
        finally:
            self.inflight -= 1

    async def _prepare_images(self, request: Request, prompt: Prompt, tools: list[dict] | None,
                              reservation: Reservation) -> PreparedPrompt | None:
        """The prompt with its images decoded and encoded on an image worker (their embeddings' bytes
        reserved for ``reservation`` first: ``ImageMemory``), or None if the client left meanwhile (the
        preparation then stops at its next wait or image)."""
        if self._image_workers is None:
            self._image_workers = anyio.CapacityLimiter(IMAGE_WORKERS)
        cancel = threading.Event()
        self.image_requests += 1  # the event loop's thread alone counts
        try:
            job = asyncio.ensure_future(anyio.to_thread.run_sync(
                functools.partial(self.engine.prepare, prompt, None, tools, cancel,
                                  functools.partial(self.image_memory.reserve, reservation)),
                limiter=self._image_workers))
            while True:
                done, _ = await asyncio.wait({job}, timeout=DISCONNECT_POLL_S)
                if done:
                    return job.result()
                if await request.is_disconnected():
                    cancel.set()
                    reservation.outlived = True  # what it reserved is held until it stops
                    job.add_done_callback(functools.partial(_stopped, reservation))
                    return None
        finally:
            self.image_requests -= 1

    async def _whole(self, request: Request, req: EngineRequest, sink: _LoopSink, rid: str, chat: bool,
                     called: str | None, parse: tuple[ToolFormat, list[str]] | None = None) -> Response:
        while True:  # the sink carries only the end: the connection is looked at every DISCONNECT_POLL_S
            try:
                await asyncio.wait_for(sink.queue.get(), DISCONNECT_POLL_S)
                break
            except TimeoutError:  # asyncio.wait_for's, from Python 3.11 on (requires-python)
                if await request.is_disconnected():
                    self._cancel(req)
                    return Response(status_code=499)
        while not all(r.done.is_set() for r in req.children):  # further samples, made when the prompt was in
            if await request.is_disconnected():
                self._cancel(req)
                return Response(status_code=499)
            await asyncio.sleep(0.01)
        try:
            res = self._finished(req, sink)
        except GuideError as exc:  # the client's grammar hit one of llguidance's limits while generating
            raise ApiError(400, str(exc), code="guide_failed") from exc
        except AutoGLMError as exc:  # the engine failed or closed under this request: not the client's fault
            raise ApiError(503 if not self.engine.alive else 500, str(exc), "server_error", "generation_failed") from exc
        # off the event loop: n choices of thousands of tokens, with their log-probabilities, take a while
        return await run_in_threadpool(self._response, res, rid, chat, called, parse)

    def _response(self, res, rid: str, chat: bool, called: str | None,
                  parse: tuple[ToolFormat, list[str]] | None) -> JSONResponse:
        """A whole request's answer, made and serialized."""
        use = usage(res.prompt_tokens, sum(len(c.token_ids) for c in res.choices))
        if chat:
            body = chat_response(rid, self.model, [(c.text, c.finish_reason, chat_logprobs(c.logprobs, self._token))
                                                   for c in res.choices], use)
            for out, c in zip(body["choices"], res.choices):
                calls = tool_calls(c.text, called) if called is not None else None
                content, found = (None, calls) if parse is None else (parse[0].parse(c.text, parse[1]) or (c.text, None))
                if found is not None:  # a call (guided, or the model's own): OpenAI's tool_calls
                    out["message"] = {"role": "assistant", "content": content, "tool_calls": found}
                    out["finish_reason"] = "tool_calls"
        else:
            body = completion_response(rid, self.model, [(c.text, c.finish_reason,
                                                          completion_logprobs(c.logprobs, self._token))
                                                         for c in res.choices], use)
        return JSONResponse(body)

    def _token(self, token: int) -> str:
        """A token's own text (special tokens included), for logprobs."""
        tok = self.engine.tokenizer
        return tok.token_text(token) if tok is not None else str(token)

    async def _events(self, req: EngineRequest, sink: _LoopSink, rid: str, chat: bool, include_usage: bool,
                      called: str | None = None,
                      parse: tuple[ToolFormat, list[str]] | None = None) -> AsyncGenerator[str, None]:
        """Server-sent events of a streamed request; a tool call goes out whole, as one
        ``delta.tool_calls``, once its text is complete. With ``parse`` (tool_choice "auto"), the
        text is held back while it may still begin a call of the model's own, and goes out as text
        as soon as it cannot."""
        wanted = req.seq.params.logprobs is not None
        covered, pieces, offset = 0, 0, 0
        held: str | None = "" if parse is not None else None

        def chunk(text: str, finish: str | None, upto: int) -> dict:
            """A chunk of ``text`` with the log-probabilities of the tokens up to ``upto`` not yet sent."""
            nonlocal covered, offset
            entries = req.logprobs[covered:upto] if wanted else None
            covered = max(covered, upto)
            if chat:
                return chat_chunk(rid, self.model, {"content": text} if text else {}, finish,
                                  chat_logprobs(entries, self._token))
            lp = completion_logprobs(entries, self._token, offset)
            offset += len(text)
            return completion_chunk(rid, self.model, text, finish, lp)

        if chat:
            yield _sse(chat_chunk(rid, self.model, {"role": "assistant", "content": ""}, None))
        while (piece := await sink.queue.get()) is not None:
            pieces += 1
            if called is not None:
                continue
            if held is not None and parse is not None:
                held += piece
                if parse[0].could_start(held, parse[1]):
                    continue
                piece, held = held, None  # not a call: what was held goes out now
            yield _sse(chunk(piece, None, req.marks[pieces - 1] if wanted else 0))
        try:
            res = self._finished(req, sink)
        except GuideError as exc:
            yield _sse(error_body(str(exc), "invalid_request_error", "guide_failed"))
        except AutoGLMError as exc:
            yield _sse(error_body(str(exc), "server_error", "generation_failed"))
        else:
            calls = tool_calls(res.text, called) if called is not None else None
            if held is not None and parse is not None:  # held to the end: the model's own call, or text
                content, calls = parse[0].parse(held, parse[1]) or (held, None)
                if content:
                    yield _sse(chunk(content, None, covered if calls is not None else len(req.logprobs)))
            if calls is not None:
                delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
                yield _sse(chat_chunk(rid, self.model, delta, None, chat_logprobs(req.logprobs[covered:] or None,
                                                                                  self._token) if wanted else None))
                yield _sse(chat_chunk(rid, self.model, {}, "tool_calls"))
            else:
                if called is not None and res.text:  # a call cut short: its text, as it is
                    yield _sse(chunk(res.text, None, len(req.logprobs)))
                yield _sse(chunk("", res.finish_reason, len(req.logprobs)))
            if include_usage:
                obj = "chat.completion.chunk" if chat else "text_completion"
                yield _sse(usage_chunk(rid, self.model, obj, usage(res.prompt_tokens, len(res.token_ids))))
        yield _sse("[DONE]")

    def _cancel(self, req: EngineRequest) -> None:
        """Cancel the request and every further sample of it still running (the first may have ended)."""
        if not all(r.done.is_set() for r in [req, *req.children]):
            self.engine.cancel(req)
            self.metrics.finished.labels("cancelled").inc()

    def _finished(self, req: EngineRequest, sink: _LoopSink):
        res = self.engine.outcome(req)
        self.metrics.observe(res.finish_reason, res.prompt_tokens, res.token_times, res.submitted,
                             time.perf_counter(), sink.phases, sink.arrived)
        return res
