"""The server's guard, without a server: the body limit an image-text engine gets by default, the
bodies held by requests in flight bounded together, and the bearer scheme in any case."""

from __future__ import annotations

import asyncio
import functools
import json
import time

import pytest

from autoglm_trt.serve.guard import (
    DEFAULT_MAX_BODY_BYTES,
    MIN_INFLIGHT_BYTES,
    TEXT_ROOM_BYTES,
    ClientGone,
    Guard,
    body_problem,
    default_max_body_bytes,
    image_body_bytes,
)


def test_an_image_engines_body_limit_fits_its_largest_images():
    """A PNG of 8-bit RGBA that does not compress, as base64: 1080 x 2400 is 13.8 MB as a data: URL,
    which the 8 MiB a text engine takes would refuse."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (240, 108, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert len(url) <= image_body_bytes(240 * 108) < 1.01 * len(url) + 8192  # the bound holds, and is tight
    assert image_body_bytes(1080 * 2400) > 13_800_000
    assert default_max_body_bytes(10, 5_000_000) == 10 * image_body_bytes(5_000_000) + TEXT_ROOM_BYTES
    assert default_max_body_bytes(10, None) == default_max_body_bytes(0, 5_000_000) == DEFAULT_MAX_BODY_BYTES
    assert default_max_body_bytes(1, 100 * 100) == DEFAULT_MAX_BODY_BYTES  # never less than a text engine's


async def call(guard: Guard, body: bytes, headers: dict[bytes, bytes]) -> int:
    """One request through ``guard`` (its body in chunks of 1 MiB): the status answered."""
    chunks = [body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20)] or [b""]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(0)  # the other requests' chunks come in between
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": list({b"content-type": b"application/json", **headers}.items())}
    await guard(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def drive(guard: Guard, requests: list[tuple[bytes, dict[bytes, bytes]]]) -> list[int]:
    async def all_at_once() -> list[int]:
        return list(await asyncio.gather(*(call(guard, b, h) for b, h in requests)))

    return asyncio.run(all_at_once())


@pytest.mark.parametrize("declared, sent, answered", [(True, 4, [200, 200, 429, 429]), (False, 3, [200, 200, 429])])
def test_bodies_in_flight_are_bounded_together(declared, sent, answered):
    """Each request holds its body until it is answered: past twice the largest body (256 MiB at
    least) in all, a 429, whether the size is declared or the body comes in chunks; nothing is held
    once they are answered."""
    big = b"x" * (90 << 20)

    async def scenario() -> tuple[list[int], int, int]:
        release, arrived = asyncio.Event(), [0]

        async def app(scope, receive, send) -> None:  # holds every request until all have come
            await receive()
            arrived[0] += 1
            await release.wait()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        guard = Guard(app, None, max_body_bytes=100 << 20)
        assert guard.max_inflight_bytes == MIN_INFLIGHT_BYTES == 256 << 20
        headers = {b"content-length": str(len(big)).encode()} if declared else {}
        tasks = [asyncio.ensure_future(call(guard, big, headers)) for _ in range(sent)]
        while arrived[0] + sum(t.done() for t in tasks) < sent:
            await asyncio.sleep(0.01)
        held = guard.inflight_bytes
        release.set()
        return sorted(await asyncio.gather(*tasks)), held, guard.inflight_bytes

    statuses, held, after = asyncio.run(scenario())
    assert statuses == answered and held == 2 * len(big) and after == 0


def test_a_declared_body_that_does_not_come_holds_nothing_and_times_out():
    """Clients that declare the largest body and send none of it: nothing is held for them, so a
    real request still gets in; each is answered 408 (and its connection closed) once no byte has
    come for the body timeout."""

    async def appended(out: list, message: dict) -> None:
        out.append(message)

    async def scenario() -> tuple[int, int, list[list[dict]]]:
        async def app(scope, receive, send) -> None:
            await receive()
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        guard = Guard(app, None, max_body_bytes=100 << 20, client_timeout=0.5)

        async def nothing() -> dict:  # the headers came; the body never does
            await asyncio.Event().wait()
            return {}

        answers: list[list[dict]] = [[] for _ in range(4)]  # 4 x 100 MiB declared: past the 256 MiB in flight
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(100 << 20).encode())]}
        idle = [asyncio.ensure_future(guard(scope, nothing, functools.partial(appended, out))) for out in answers]
        await asyncio.sleep(0.05)
        held = guard.inflight_bytes
        status = await call(guard, b"x" * (90 << 20), {})
        await asyncio.wait_for(asyncio.gather(*idle), 20)  # not forever, should they never time out
        return held, status, answers

    held, status, answers = asyncio.run(scenario())
    assert held == 0 and status == 200
    for out in answers:
        start, body = out
        assert start["status"] == 408 and (b"connection", b"close") in start["headers"]
        error = json.loads(body["body"])["error"]
        assert error["code"] == "body_timeout" and "the request body paused for 0.5 s" in error["message"]


def test_a_client_that_stops_reading_its_answer_is_gone():
    """A message of the answer the client does not take in within the timeout: that send raises
    ``ClientGone`` into the app (ending its handling of the request), the guard returns quietly, and
    the body's bytes are let go."""

    async def scenario() -> tuple[list[str], int, list[str], int, float]:
        sent: list[str] = []
        raised: list[str] = []
        tries = [0]

        async def send(message: dict) -> None:  # the start goes out; then the connection's buffers are full
            tries[0] += 1
            if message["type"] != "http.response.start":
                await asyncio.Event().wait()
            sent.append(message["type"])

        async def receive() -> dict:
            return {"type": "http.request", "body": b'{"a": 1}', "more_body": False}

        async def app(scope, receive, send) -> None:
            assert (await receive())["body"] == b'{"a": 1}'
            await send({"type": "http.response.start", "status": 200, "headers": []})
            try:
                await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})  # not read
            except ClientGone as exc:
                raised.append(str(exc))
                raise

        guard = Guard(app, None, client_timeout=0.3)
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-type", b"application/json")]}
        started = time.monotonic()
        await asyncio.wait_for(guard(scope, receive, send), 20)
        return sent, tries[0], raised, guard.inflight_bytes, time.monotonic() - started

    sent, tries, raised, held, seconds = asyncio.run(scenario())
    assert sent == ["http.response.start"] and tries == 2 and held == 0 and 0.3 <= seconds < 10
    assert raised == ["the client read none of its answer for 0.3 s"]


def test_after_a_large_message_the_next_send_may_wait_longer():
    """As uvicorn's send, this one waits for what was written before to drain: after a message of
    4 x MIN_READ_RATE bytes the next send has four seconds more than the timeout (a slow reader is not
    taken as gone), after a few bytes only the timeout."""
    from autoglm_trt.serve.guard import MIN_READ_RATE, _Client

    async def scenario() -> tuple[bool, bool]:
        waits = [0.0, 0.6, 0.6]  # draining what came before: nothing, then the large message, then a few bytes

        async def send(message: dict) -> None:
            await asyncio.sleep(waits.pop(0))

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        client = _Client(b"{}", receive, send, timeout=0.3)
        await client.send({"type": "http.response.body", "body": b"x" * (4 * MIN_READ_RATE), "more_body": True})
        await client.send({"type": "http.response.body", "body": b"x", "more_body": True})
        after_large = client.gone
        with pytest.raises(ClientGone):
            await client.send({"type": "http.response.body", "body": b"x", "more_body": True})
        return after_large, client.gone

    assert asyncio.run(scenario()) == (False, True)


@pytest.mark.parametrize("case", ["declared", "chunked", "endless", "paused", "huge", "busy", "expects"])
def test_a_refusal_before_the_whole_body_came_reads_a_short_rest_else_closes(case):
    """413 and 429 come before the body is read whole. A rest of up to DRAIN_BYTES that comes at once
    is read and dropped first, so the client, still sending, reads the answer on an open connection
    (CI saw a broken pipe when the server closed under a client sending a few KiB in chunks). A rest
    that goes on, pauses or is declared larger is not waited for, nor one the client sends only once
    told to continue (reading would tell it): the answer closes the connection."""
    from autoglm_trt.serve.guard import DRAIN_BYTES

    limit, chunk = 4096, 1000 if case != "endless" else 1 << 20
    declared = {"declared": 12 * chunk, "chunked": None, "endless": None, "paused": None, "huge": 2 * DRAIN_BYTES,
                "busy": 4 * chunk, "expects": 12 * chunk}[case]

    async def scenario() -> tuple[dict, int, list[str]]:
        sent: list[dict] = []
        order: list[str] = []
        got = [0]
        chunks = {"declared": 12, "chunked": 12, "busy": 4}.get(case, 1 << 30)

        async def send(message: dict) -> None:
            order.append("send")
            sent.append(message)

        async def receive() -> dict:
            if case == "paused" and got[0] == 5 * chunk:  # over the limit, then nothing more
                await asyncio.Event().wait()
            await asyncio.sleep(0)
            got[0] += chunk
            order.append("receive")
            return {"type": "http.request", "body": b" " * chunk, "more_body": got[0] < chunks * chunk}

        async def app(scope, receive, send) -> None:
            raise AssertionError("the app must not be reached")

        # the body's pause limit bounds the wait for the rest: short where it is waited out, else the default
        guard = Guard(app, None, max_body_bytes=limit, client_timeout=0.3 if case == "paused" else 30)
        if case == "busy":
            guard.inflight_bytes = guard.max_inflight_bytes
        headers = [(b"content-type", b"application/json")]
        if declared is not None:
            headers.append((b"content-length", str(declared).encode()))
        if case == "expects":
            headers.append((b"expect", b"100-Continue"))
        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}
        await asyncio.wait_for(guard(scope, receive, send), 20)
        return sent[0], got[0], order

    start, received, order = asyncio.run(scenario())
    assert start["status"] == (429 if case == "busy" else 413)
    closes = (b"connection", b"close") in start["headers"]
    if case in ("declared", "chunked", "busy"):  # the whole body was read before the answer, which keeps the connection
        assert not closes and order[-3:] == ["receive", "send", "send"] and received == (declared or 12 * chunk)
    else:
        assert closes
        assert {"endless": limit < received <= limit + DRAIN_BYTES + 2 * chunk, "paused": received == 5 * chunk,
                "huge": received == 0, "expects": received == 0}[case]


def test_the_bearer_scheme_in_any_case():
    async def app(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    guard = Guard(app, "k")
    for auth, status in [(b"Bearer k", 200), (b"bearer k", 200), (b"BEARER  k", 200), (b"Bearer K", 401),
                         (b"Basic k", 401), (b"Bearerk", 401), (b"", 401)]:
        assert drive(guard, [(b"{}", {b"authorization": auth})]) == [status], auth


def test_nesting_and_text_that_is_not_unicode():
    assert body_problem({"a": [[[[1]]]]}) is None
    deep: object = 1
    for _ in range(65):
        deep = [deep]
    assert "nested more than 64 levels" in body_problem({"x": deep})
    assert "x[0] holds text that is not valid Unicode" in body_problem({"x": ["\ud800"]})
    assert body_problem({"\udfff": 1}).startswith("<key>")
    very: object = 1
    for _ in range(100_000):  # walked with a stack: no RecursionError
        very = {"a": very}
    assert "nested" in body_problem(very)


def test_a_body_of_millions_of_tiny_values_is_refused_before_it_is_parsed():
    """``[[],[],...]`` 2.8 million times is 8 MB: parsing and walking it took the event loop 3-5 s."""
    async def app(scope, receive, send) -> None:  # never reached
        raise AssertionError("parsed")

    guard = Guard(app, None)
    flood = b'{"model": "m", "prompt": "hi", "junk": [' + b"[]," * 150_000 + b"[]]}"
    assert drive(guard, [(flood, {})]) == [400]
    ids = json.dumps({"model": "m", "prompt": list(range(65536))}).encode()  # a long prompt of token ids passes

    async def ok(scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    assert drive(Guard(ok, None), [(ids, {})]) == [200]


def test_a_problem_is_named_by_its_path():
    assert body_problem({"a": {"b": [1, {"c": "\ud800"}]}}) == \
        "a.b[1].c holds text that is not valid Unicode (an unpaired surrogate escape)"
    assert body_problem({"a": [{"\udfff": 1}]}).startswith("a[0].<key> holds text")
    assert body_problem({"a": [0] * 150_000}) is None and body_problem("\ud800") is not None
