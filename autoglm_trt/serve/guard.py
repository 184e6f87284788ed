"""What every HTTP request meets before the app reads it: the API key, then the body's size and type.

``Guard`` is plain ASGI middleware in front of the FastAPI app, so an unauthenticated client
gets a 401 before a byte of its body is read or parsed (whatever the route, known or not;
``/health`` stays open for load balancers), a body over ``max_body_bytes`` gets a 413 (from
its Content-Length at once, else as soon as that many bytes have come), and a body that is not
JSON by its Content-Type a 415. The body is read here, bounded, and handed to the app whole;
the bodies of all requests in flight together are bounded too (twice the largest body, 256 MiB
at least: past it a 429), as each holds its body until it is answered. A body's bytes are
counted as they come (a declared size that cannot fit now is a 429 at once, but is not
reserved), and a body that pauses for ``CLIENT_TIMEOUT_S`` is a 408: a client that declares a
body and sends nothing holds nothing, and not for long. A refusal before the whole body came
reads and drops the rest first if it comes soon (``DRAIN_BYTES``, within ``DRAIN_S``), so the client,
still sending, reads the answer and keeps its connection; past that the answer closes the
connection (a close with bytes unread can reset it before the client reads the answer: RFC 9112,
9.6). A client that stops reading its answer for as
long is gone (``_Client``): its request is cancelled and the server drops the connection, so it
does not hold its body's place either.
A body of more than ``MAX_JSON_VALUES`` values (counted from its bytes) is a 400 before it is
parsed. Every refusal is OpenAI's error JSON. ``body_problem`` finds, in a parsed body, nesting deeper
than ``MAX_DEPTH`` and a string that cannot be UTF-8 (a lone surrogate, which JSON's ``\\ud800``
escapes can carry).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

_log = logging.getLogger(__name__)
OPEN_PATHS = ("/health",)
CLOSE = (b"connection", b"close")  # a refusal before the whole body came, whose rest is not read
# of a body refused before it came whole, this much more is read and dropped, for this long at most in
# all and with pauses this short at most (nginx's lingering_time and lingering_timeout: 30 s and 5 s)
DRAIN_BYTES = 64 << 20
DRAIN_S, DRAIN_PAUSE_S = 10.0, 5.0
ARRIVED = "arrived"  # the request state's key for when its headers came (time.perf_counter())
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a text engine's, and an image-text engine's at least
TEXT_ROOM_BYTES = 1 << 20  # beside the images: the system prompt, the history, the fields
MIN_INFLIGHT_BYTES = 256 << 20  # bodies held by requests in flight, at least this much is allowed
# a body's JSON values, at most (a prompt of 65,536 token ids has as many): parsing and validating
# many tiny values holds the event loop
MAX_JSON_VALUES = 100_000
MAX_DEPTH = 64  # a request body's nesting (a JSON schema or tool arguments need a few levels)
# the longest a client may pause sending its body, or reading its answer (nginx's client_body_timeout
# and send_timeout, shorter)
CLIENT_TIMEOUT_S = 30.0
MIN_READ_RATE = 64 << 10  # bytes a second: after a large message of an answer, the next may wait as much longer

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def image_body_bytes(max_pixels: int) -> int:
    """The largest a data: URL of an image of ``max_pixels`` pixels may be: a PNG of 8-bit RGBA (what a
    phone's screenshot is) that does not compress (4 bytes a pixel, a filter byte a row, 0.1% for
    zlib's and PNG's framing), as base64 (4 characters per 3 bytes), with its URL's head."""
    png = int(max_pixels * 4 * 1.001) + 4096
    return -(-png // 3) * 4 + 64


def default_max_body_bytes(max_images: int, max_pixels: int | None) -> int:
    """A request body the server takes by default: ``max_images`` of the largest images at
    ``max_pixels`` (``image_body_bytes``) and ``TEXT_ROOM_BYTES`` of text, at least
    ``DEFAULT_MAX_BODY_BYTES`` (a text engine's: ``max_pixels`` None)."""
    if max_pixels is None or max_images == 0:
        return DEFAULT_MAX_BODY_BYTES
    return max(DEFAULT_MAX_BODY_BYTES, max_images * image_body_bytes(max_pixels) + TEXT_ROOM_BYTES)


def error_json(message: str, type_: str, code: str | None = None, param: str | None = None) -> bytes:
    """OpenAI's error body, as ASCII JSON (so any text in it encodes)."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


async def reply(send: Send, status: int, body: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class Guard:
    def __init__(self, app: Callable, api_key: str | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 rejected: Callable[[int], None] = lambda status: None, client_timeout: float = CLIENT_TIMEOUT_S):
        self.app, self.max_body_bytes, self.rejected = app, max_body_bytes, rejected
        self.client_timeout = client_timeout
        self.expected = api_key.encode() if api_key is not None else None
        # the bodies of the requests in flight, in all (a request holds its body until it is answered)
        self.max_inflight_bytes = max(2 * max_body_bytes, MIN_INFLIGHT_BYTES)
        self.inflight_bytes = 0  # the event loop's thread alone counts

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope.setdefault("state", {})[ARRIVED] = time.perf_counter()  # request.state.arrived: phases start here
        headers = dict(scope["headers"])  # names arrive lower-cased
        declared = headers.get(b"content-length")
        unread = int(declared) if declared is not None and declared.isdigit() else None  # of the body, to come
        # a client that waits for "100 Continue" (sent as the body is first read) sends nothing on a refusal
        waits = b"100-continue" in (e.strip() for e in headers.get(b"expect", b"").lower().split(b","))
        if self.expected is not None and scope["path"] not in OPEN_PATHS and not self._authorized(
                headers.get(b"authorization", b"")):
            await self._refuse(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                               "authentication_error", "invalid_api_key",
                               ((b"www-authenticate", b"Bearer"), *await self._drain(receive, unread, waits)))
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        kind = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
        if kind not in (b"application/json", b"") and not kind.endswith(b"+json"):
            await self._refuse(send, 415, f"the body must be JSON (Content-Type: application/json), not "
                                          f"{kind.decode('latin-1')}", "invalid_request_error",
                               "unsupported_media_type", await self._drain(receive, unread, waits))
            return
        if declared is not None and unread is None:  # not a size: what follows cannot be told from the body
            await self._too_large(send, (CLOSE,))
            return
        if unread is not None and unread > self.max_body_bytes:
            await self._too_large(send, await self._drain(receive, unread, waits))
            return
        if unread is not None and self.inflight_bytes + unread > self.max_inflight_bytes:
            await self._busy(send, await self._drain(receive, unread, waits))  # it could not be held whole: say so now
            return
        held = 0  # bytes of this body counted in inflight_bytes, as they come
        try:
            body = bytearray()
            while True:
                try:
                    message = await asyncio.wait_for(receive(), self.client_timeout)
                except TimeoutError:  # asyncio.wait_for's, from Python 3.11 on
                    await self._refuse(send, 408, f"the request body paused for {self.client_timeout:g} s; "
                                                  "send the body as the request is made",
                                       "invalid_request_error", "body_timeout", (CLOSE,))
                    return
                if message["type"] == "http.disconnect":
                    return  # nobody to answer
                body += message.get("body", b"")
                more = message.get("more_body", False)
                too_large = len(body) > self.max_body_bytes
                if too_large or (len(body) > held and not self._hold(len(body) - held)):
                    self.inflight_bytes -= held  # let go before the rest is read and dropped
                    held = 0
                    left = None if unread is None else unread - len(body)
                    del body
                    rest = await self._drain(receive, left) if more else ()
                    await (self._too_large(send, rest) if too_large else self._busy(send, rest))
                    return
                held = len(body)
                if not more:
                    break
            if (values := json_values(body)) > MAX_JSON_VALUES:
                await self._refuse(send, 400, f"the body holds some {values:,} JSON values; this server reads at most "
                                              f"{MAX_JSON_VALUES:,}", "invalid_request_error", "too_many_values")
                return
            client = _Client(bytes(body), receive, send, self.client_timeout)
            del body
            try:
                await self.app(scope, client.receive, client.send)
            except ClientGone as exc:  # uvicorn closes a connection whose answer is left unfinished
                _log.warning("%s %s: %s; its request is cancelled and its connection dropped", scope["method"],
                             scope["path"], exc)
                return
        finally:
            self.inflight_bytes -= held

    def _hold(self, n: int) -> bool:
        if self.inflight_bytes + n > self.max_inflight_bytes:
            return False
        self.inflight_bytes += n
        return True

    async def _drain(self, receive: Receive, unread: int | None, waits: bool = False) -> tuple[tuple[bytes, bytes], ...]:
        """Read and drop the rest of a refused body (``unread`` bytes, None when it is sent in chunks) if it
        comes whole within ``DRAIN_BYTES`` and ``DRAIN_S``: then the answer leaves the connection open.
        Else, or if the client ``waits`` for 100 Continue to send it (reading would invite it), the
        answer's headers close it (``CLOSE``)."""
        if waits or (unread is not None and unread > DRAIN_BYTES):
            return (CLOSE,)
        dropped = 0
        try:
            async with asyncio.timeout(DRAIN_S):
                while dropped <= DRAIN_BYTES:
                    message = await asyncio.wait_for(receive(), min(DRAIN_PAUSE_S, self.client_timeout))
                    if message["type"] == "http.disconnect":
                        return (CLOSE,)
                    dropped += len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return ()
        except TimeoutError:
            pass
        return (CLOSE,)

    async def _busy(self, send: Send, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        await self._refuse(send, 429, f"the requests in flight hold {self.inflight_bytes:,} bytes of bodies and this "
                                      f"server holds at most {self.max_inflight_bytes:,}; retry shortly",
                           "rate_limit_error", "bodies_in_flight", ((b"retry-after", b"1"), *headers))

    def _authorized(self, value: bytes) -> bool:
        """``Authorization: Bearer <key>``, the scheme in any case (RFC 9110, 11.1)."""
        scheme, _, token = value.strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected or b"")

    async def _too_large(self, send: Send, headers: tuple[tuple[bytes, bytes], ...]) -> None:
        await self._refuse(send, 413, f"the request body is over this server's {self.max_body_bytes:,} bytes "
                                      "(serve --max-body-bytes)", "invalid_request_error", "request_too_large", headers)

    async def _refuse(self, send: Send, status: int, message: str, type_: str, code: str,
                      headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
        self.rejected(status)
        await reply(send, status, error_json(message, type_, code), headers)


class ClientGone(Exception):
    """The client stopped reading its answer: raised by the app's ``send``, caught by ``Guard``."""


class _Client:
    """The client of one request as the app sees it: ``receive`` gives the body read already, then
    what the client sends next (its disconnect). The server's ``send`` waits for what was written
    before to be taken in (the connection's buffers drained) and then writes the message; one that
    waits past the timeout (the client stopped reading) makes the client gone: that ``send`` and
    every later one raise ``ClientGone``, which ends the app's handling of the request (a stream's
    request is cancelled), and uvicorn drops the connection left with its answer unfinished. After
    a message of n bytes the next has ``n / MIN_READ_RATE`` seconds more: a slow client still gets
    a large piece of its answer."""

    def __init__(self, body: bytes, receive: Receive, send: Send, timeout: float):
        self.body: bytes | None = body
        self._receive, self._send, self.timeout = receive, send, timeout
        self.gone = False
        self.written = 0  # bytes of the message sent before, which the next send waits to see taken in

    async def receive(self) -> dict:
        if self.body is not None:
            body, self.body = self.body, None  # given once, and not kept here
            return {"type": "http.request", "body": body, "more_body": False}
        return await self._receive()

    async def send(self, message: dict) -> None:
        if not self.gone:
            try:
                await asyncio.wait_for(self._send(message), self.timeout + self.written / MIN_READ_RATE)
                self.written = len(message.get("body", b""))
                return
            except TimeoutError:
                self.gone = True
        raise ClientGone(f"the client read none of its answer for {self.timeout:g} s")


def body_problem(value: Any) -> str | None:
    """What is wrong with a parsed JSON body that its fields' types cannot say, or None: nesting
    deeper than ``MAX_DEPTH`` (the code that reads a schema or a tool call recurses), or a string
    (or key) that UTF-8 cannot encode, with its path. Walked with a stack, not recursion; a path is
    spelled out only for the value at fault."""
    if isinstance(value, str):
        return None if value.isascii() or _encodes(value) else "body holds text that is not valid Unicode"
    stack: list[tuple[Any, int, tuple | None]] = [(value, 0, None)]  # (a list or dict, depth, where)
    while stack:
        item, depth, where = stack.pop()
        if depth > MAX_DEPTH:
            return f"{_path(where) or 'body'}: the body is nested more than {MAX_DEPTH} levels deep"
        pairs = item.items() if isinstance(item, dict) else enumerate(item) if isinstance(item, list) else ()
        for key, sub in pairs:
            if isinstance(key, str) and not key.isascii() and not _encodes(key):
                return f"{_path((where, '<key>'))} holds text that is not valid Unicode (an unpaired surrogate escape)"
            if isinstance(sub, str):
                if not sub.isascii() and not _encodes(sub):
                    return (f"{_path((where, key))} holds text that is not valid Unicode (an unpaired surrogate "
                            "escape)")
            elif isinstance(sub, dict | list):
                stack.append((sub, depth + 1, (where, key)))
    return None


def _path(where: tuple | None) -> str:
    """``a.b[0].c`` from ``(((None, "a"), "b"), 0), "c")``: dict keys after dots, list indices in brackets."""
    keys: list[object] = []
    while where is not None:
        where, key = where
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else f".{key}" if out else str(key)
    return out


def json_values(body: bytes | bytearray) -> int:
    """An upper bound on the values a JSON body holds, from its bytes: its brackets, braces and commas
    (those in strings counted too; base64 has none)."""
    return body.count(b"[") + body.count(b"{") + body.count(b",")


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
