"""What a crafted request can do to ``serve``: the API key checked before the body is read, a bounded
body, OpenAI's error JSON for every refusal (unknown routes and methods, wrong media type, text
that is not Unicode), a bounded client priority, and ``n > 1`` samples cancelled with their
request when the client goes away."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import time

import pytest
from conftest import ROOT
from test_serve import metrics, request, server, wait_for

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")

KEY = {"Authorization": "Bearer s3cret"}
LIMIT = 4096


def is_openai_error(body: dict) -> bool:
    return set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])


def raw(port: int, method: str, path: str, data: bytes, headers: dict, chunked: bool = False) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        if chunked:  # no Content-Length: the server learns the size only by reading
            conn.request(method, path, iter([data[i:i + 1000] for i in range(0, len(data), 1000)]), headers,
                         encode_chunked=True)
        else:
            conn.request(method, path, data, headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture(scope="module")
def guarded(chat_engine):
    with server(chat_engine, "--api-key", "s3cret", "--max-body-bytes", str(LIMIT)) as (port, _):
        yield port


@pytest.fixture(scope="module")
def unguarded(chat_engine):
    with server(chat_engine) as (port, _):
        yield port


def test_no_key_is_401_before_the_body_is_read(guarded):
    """Whatever the body (malformed, oversized) or route, a request without the key learns nothing
    but that it needs one (before: a 400 with validation details, or the body parsed first)."""
    for data in (b"{not json", b"x" * (10 * LIMIT), json.dumps({"model": "tiny-chat", "prompt": "hi"}).encode()):
        status, body = raw(guarded, "POST", "/v1/completions", data, {"Content-Type": "application/json"})
        assert status == 401 and is_openai_error(body) and body["error"]["code"] == "invalid_api_key"
    status, body = raw(guarded, "GET", "/no/such/route", b"", {})
    assert status == 401 and is_openai_error(body)


def test_a_body_over_the_limit_is_413(guarded):
    """Sent whole or in chunks, a body a few KiB over the limit is read to its end and dropped before
    the 413, so the client reads it and its connection serves the next request (a close under a
    client still sending made CI's client fail on a broken pipe instead)."""
    big = json.dumps({"model": "tiny-chat", "prompt": "x" * (2 * LIMIT), "max_tokens": 1}).encode()
    ok = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json", **KEY}
    conn = http.client.HTTPConnection("127.0.0.1", guarded, timeout=60)
    try:
        for _ in range(5):
            for chunked in (False, True):
                body = iter([big[i:i + 1000] for i in range(0, len(big), 1000)]) if chunked else big
                conn.request("POST", "/v1/completions", body, headers, encode_chunked=chunked)
                r = conn.getresponse()
                error = json.loads(r.read())
                assert r.status == 413 and is_openai_error(error) and "max-body-bytes" in error["error"]["message"]
                assert r.getheader("connection") != "close"
        conn.request("POST", "/v1/completions", iter([ok]), headers, encode_chunked=True)
        assert conn.getresponse().status == 200
    finally:
        conn.close()
    # a client that waits for "100 Continue" is answered at once, not told to send: the connection closes
    with socket.create_connection(("127.0.0.1", guarded), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer s3cret\r\nExpect: 100-continue\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(big))
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head = answer.split(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head and b"100 continue" not in head


def test_every_refusal_is_openai_error_json(guarded):
    status, body, _ = request(guarded, "GET", "/v1/nothing", headers=KEY)
    assert status == 404 and is_openai_error(body) and "/v1/chat/completions" in body["error"]["message"]
    status, body, _ = request(guarded, "GET", "/v1/completions", headers=KEY)
    assert status == 405 and is_openai_error(body) and body["error"]["code"] == "method_not_allowed"
    status, body = raw(guarded, "POST", "/v1/completions", b"prompt=hi", {"Content-Type": "text/plain", **KEY})
    assert status == 415 and is_openai_error(body)
    status, body = raw(guarded, "POST", "/v1/completions", b'{"model": "tiny-chat", "prompt": "\xff\xfe"}',
                       {"Content-Type": "application/json", **KEY})
    assert status == 400 and is_openai_error(body)


@pytest.mark.parametrize("body", [
    '{"model": "\\ud800", "prompt": "hi"}',  # the model name goes into the 404's message, which must encode
    '{"model": "tiny-chat", "messages": [{"role": "user", "content": "a \\udfff b"}]}',
    '{"model": "tiny-chat", "prompt": "hi", "\\ud800": 1}',
])
def test_text_that_is_not_unicode_is_a_400(guarded, body):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, answer = raw(guarded, "POST", path, body.encode(), {"Content-Type": "application/json", **KEY})
    assert status == 400 and is_openai_error(answer) and "not valid Unicode" in answer["error"]["message"]


def test_a_client_may_not_raise_its_own_priority(guarded):
    """A client sending priority -2**31 would keep everyone else waiting for centuries (aging is one level
    per 10 s)."""
    body = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}
    status, err, _ = request(guarded, "POST", "/v1/completions", {**body, "priority": -1}, KEY)
    assert status == 400 and err["error"]["param"] == "priority" and "--max-client-priority" in err["error"]["message"]
    assert request(guarded, "POST", "/v1/completions", {**body, "priority": 3}, KEY)[0] == 200


def test_max_client_priority_lets_clients_ask_for_more(chat_engine):
    with server(chat_engine, "--max-client-priority", "-5") as (port, _):
        body = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}
        assert request(port, "POST", "/v1/completions", {**body, "priority": -5})[0] == 200
        assert request(port, "POST", "/v1/completions", {**body, "priority": -6})[0] == 400


def test_a_disconnect_after_the_first_sample_cancels_the_others(slow_engine):
    """n = 3 without streaming on an engine that runs one sequence at a time: the first sample
    runs, then the others, one by one. A client that goes away once the first has ended (and the
    second runs) cancels the request's samples still running or waiting, rather than leaving them to
    decode to max_tokens."""
    with server(slow_engine) as (port, _):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "model": "slow", "prompt": "go", "max_tokens": 1500, "n": 3, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}), {"Content-Type": "application/json"})
        assert wait_for(lambda: metrics(port)["autoglm_requests_waiting"] == 2)  # the first sample runs
        assert wait_for(lambda: metrics(port)["autoglm_requests_waiting"] == 1, 60)  # it ended; the second runs
        conn.sock.shutdown(2)
        conn.close()
        assert wait_for(lambda: metrics(port)["autoglm_kv_blocks_used"] == 0, 60)
        m = metrics(port)
        assert m["autoglm_requests_running"] == 0 and m["autoglm_requests_waiting"] == 0
        assert m['autoglm_requests_finished_total{finish_reason="cancelled"}'] == 1


def test_python_version_bound_matches_what_is_tested():
    """``asyncio.wait_for``'s timeout is TimeoutError only from Python 3.11 on, which the server's
    disconnect watch relies on; CI runs 3.11, so the package says so."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"


@contextlib.contextmanager
def held_encoder_server(engine_dir, max_waiting: int, **config):
    """``serve`` in-process (uvicorn on a free port) on ``engine_dir``'s engine, whose vision encoder
    waits for the yielded event before each image: yields (port, engine, release event). ``config``:
    more of ``ServeConfig``'s fields."""
    import threading

    import uvicorn
    from conftest import free_port, hold_encoder

    from autoglm_trt.runtime import Engine
    from autoglm_trt.serve.app import ServeConfig, create_app

    release = threading.Event()
    with Engine.load(engine_dir) as engine:
        hold_encoder(engine, release)
        port = free_port()
        web = uvicorn.Server(uvicorn.Config(create_app(engine, ServeConfig("tiny-glm4v", max_waiting=max_waiting, **config)),
                                            host="127.0.0.1", port=port, log_level="error"))
        serving = threading.Thread(target=web.run, daemon=True)
        serving.start()
        try:
            assert wait_for(lambda: web.started, 30)
            yield port, engine, release
        finally:
            release.set()
            web.should_exit = True
            serving.join(30)


def in_threads(port: int, bodies: list[dict]) -> tuple[list, list]:
    """Each body POSTed to /v1/chat/completions on a thread of its own: (the threads, their answers)."""
    import threading

    answers: list = []
    threads = [threading.Thread(target=lambda b=b: answers.append(request(port, "POST", "/v1/chat/completions", b)))
               for b in bodies]
    for t in threads:
        t.start()
    return threads, answers


def image_body(seed: int) -> dict:
    from conftest import image_message, random_image

    return {"model": "tiny-glm4v", "max_tokens": 2, "messages": image_message("look ", random_image(64, 96, seed))}


def test_a_request_past_the_image_memory_is_refused_before_its_images_are_decoded(glm4v_engine):
    """The image memory is reserved from the images' headers: with the first screenshot held in the
    encoder (its embeddings not made yet) and room for one, the second is a 429 at once, not after
    waiting for the encoder and encoding its own; once the first ends, the next is served."""
    with held_encoder_server(glm4v_engine, max_waiting=8, max_image_memory=1) as (port, engine, release):
        held, first = in_threads(port, [image_body(1)])
        assert wait_for(lambda: engine.images._encoding.locked())  # the first is in the encoder
        status, err, headers = request(port, "POST", "/v1/chat/completions", image_body(2))
        assert status == 429 and err["error"]["code"] == "image_memory" and headers.get("retry-after") == "1", err
        assert not release.is_set() and engine.images.cache.stats()["encoder_cache_misses"] == 1  # the first alone looked
        release.set()
        held[0].join(60)
        assert first[0][0] == 200
        assert request(port, "POST", "/v1/chat/completions", image_body(2))[0] == 200


def test_requests_whose_images_wait_for_the_encoder_count_toward_max_waiting(glm4v_engine):
    """A request whose screenshot is being encoded holds a place among ``--max-waiting``: with a
    limit of 1 and one request held in the encoder, the next gets 429 (so requests cannot pile up in
    front of the encoder unbounded), and /metrics shows it as preparing; once the encoder lets go it
    answers."""
    with held_encoder_server(glm4v_engine, max_waiting=1) as (port, engine, release):
        held, first = in_threads(port, [image_body(1)])
        assert wait_for(lambda: engine.stats()["images_preparing"] == 1)
        assert metrics(port)["autoglm_requests_preparing"] == 1
        status, err, _ = request(port, "POST", "/v1/chat/completions", image_body(1))
        assert status == 429 and err["error"]["code"] == "queue_full"
        release.set()
        held[0].join(60)
        assert first[0][0] == 200 and engine.stats()["images_preparing"] == 0


def test_requests_with_images_are_prepared_on_threads_of_their_own(glm4v_engine):
    """Six requests whose screenshots wait for a held encoder: at most ``IMAGE_WORKERS`` of them are
    in the engine's ``prepare``, each holding a thread (so screenshots waiting for the encoder never
    take every thread text requests are prepared on), /metrics counts all six as preparing, 429 comes at the
    limit, and a text request is answered meanwhile; once the encoder lets go all seven answer."""
    from autoglm_trt.serve.serving import IMAGE_WORKERS

    with held_encoder_server(glm4v_engine, max_waiting=7) as (port, engine, release):
        threads, answers = in_threads(port, [image_body(seed) for seed in range(6)])
        assert wait_for(lambda: metrics(port)["autoglm_requests_preparing"] == 6)
        assert wait_for(lambda: engine.stats()["images_preparing"] == IMAGE_WORKERS < 6)
        time.sleep(0.5)  # the other two stay out of prepare while the encoder is held
        assert engine.stats()["images_preparing"] == IMAGE_WORKERS
        status, text, _ = request(port, "POST", "/v1/chat/completions", {
            "model": "tiny-glm4v", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]})
        assert status == 200 and text["choices"][0]["finish_reason"] in ("length", "stop")
        more, late = in_threads(port, [image_body(6)])
        assert wait_for(lambda: metrics(port)["autoglm_requests_preparing"] == 7)
        status, err, _ = request(port, "POST", "/v1/chat/completions", image_body(7))
        assert status == 429 and err["error"]["code"] == "queue_full"
        release.set()
        for t in threads + more:
            t.join(60)
        assert [a[0] for a in answers + late] == [200] * 7
        assert metrics(port)["autoglm_requests_preparing"] == 0 == engine.stats()["images_preparing"]


def leave(port: int, path: str, body: dict) -> http.client.HTTPConnection:
    """Send a request and return its connection, unread (``hang_up`` it to leave)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


def hang_up(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(2)
    conn.close()


@pytest.mark.parametrize("n", [1, 4])
def test_a_plain_request_is_cancelled_while_its_tokens_flow(slow_engine, n):
    """A client that leaves a non-streamed request while the model generates cancels it within a poll,
    every sample of it (before: the connection was looked at only after 0.25 s without a text piece,
    which never came while tokens flowed, so the samples decoded to max_tokens)."""
    with server(slow_engine) as (port, _):
        conn = leave(port, "/v1/completions", {"model": "slow", "prompt": "go", "max_tokens": 1900, "n": n,
                                               "temperature": 1.0, "seed": 1, "ignore_eos": True})
        assert wait_for(lambda: metrics(port)["autoglm_requests_running"] == 1)
        time.sleep(0.5)  # tokens are flowing
        hang_up(conn)
        left = time.monotonic()
        assert wait_for(lambda: metrics(port)["autoglm_kv_blocks_used"] == 0, 30)
        freed = time.monotonic() - left
        m = metrics(port)
        assert m['autoglm_requests_finished_total{finish_reason="cancelled"}'] == 1  # not "length": it was cut
        assert m["autoglm_requests_running"] == m["autoglm_requests_waiting"] == 0
        print(f"n={n}: blocks free {freed:.2f} s after the client left")


def test_a_client_that_leaves_while_its_images_wait_stops_their_preparation(glm4v_engine):
    """One request holds the encoder; a second client's screenshot waits for it, then the client
    leaves: its preparation stops (the engine counts one request preparing, not two) while the
    encoder is still held, instead of being encoded for nobody."""
    with held_encoder_server(glm4v_engine, max_waiting=8) as (port, engine, release):
        held, first = in_threads(port, [image_body(1)])
        assert wait_for(lambda: engine.images._encoding.locked())  # the first is in the encoder
        conn = leave(port, "/v1/chat/completions", image_body(2))
        assert wait_for(lambda: engine.stats()["images_preparing"] == 2)
        hang_up(conn)
        assert wait_for(lambda: engine.stats()["images_preparing"] == 1)
        assert not release.is_set()
        release.set()
        held[0].join(60)
        assert first[0][0] == 200 and engine.stats()["images_preparing"] == 0


def test_the_bearer_scheme_is_case_insensitive(guarded):
    """RFC 9110: an authentication scheme's name is case-insensitive (before: "bearer k" got a 401)."""
    ok = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}).encode()
    for auth in ("bearer s3cret", "BEARER s3cret", "Bearer  s3cret"):
        status, _ = raw(guarded, "POST", "/v1/completions", ok, {"Content-Type": "application/json",
                                                                  "Authorization": auth})
        assert status == 200, auth
    for auth in ("Basic s3cret", "Bearer s3cre", "Bearers3cret", "s3cret"):
        assert raw(guarded, "POST", "/v1/completions", ok, {"Content-Type": "application/json",
                                                             "Authorization": auth})[0] == 401, auth


@pytest.mark.parametrize("field,value", [
    ("logit_bias", {"²": 1}),  # a digit to str.isdigit, not to int(): a 500 before
    ("logit_bias", {"١٢": 1}),  # Arabic-Indic digits: taken as token 12 before
    ("logit_bias", {"1" * 5000: 1}),  # past int()'s digit limit: a 500 before
    ("repetition_penalty", 1e-300),  # logits divided by it are not finite: a 500 before
    ("guided_json", json.loads('{"a":' * 950 + "{}" + "}" * 950)),  # deeper than the body check recursed
])
def test_crafted_values_are_400s(unguarded, field, value):
    status, body = raw(unguarded, "POST", "/v1/completions", json.dumps(
        {"model": "tiny-chat", "prompt": "hi", "max_tokens": 1, field: value}).encode(),
        {"Content-Type": "application/json"})
    assert status == 400 and is_openai_error(body), (status, body)


def test_logprobs_under_a_guide_are_json(guarded):
    """The alternatives a grammar masks out were -inf: a 500 ("Out of range float values are not JSON
    compliant") for a plain request and ``-Infinity`` in a stream's JSON."""
    body = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 3, "logprobs": 5, "guided_choice": ["yes", "no"]}
    status, answer = raw(guarded, "POST", "/v1/completions", json.dumps(body).encode(),
                         {"Content-Type": "application/json", **KEY})
    assert status == 200 and answer["choices"][0]["text"] in ("yes", "no")
    conn = http.client.HTTPConnection("127.0.0.1", guarded, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json", **KEY})
    events = [line[6:] for line in conn.getresponse().read().decode().splitlines() if line.startswith("data: ")]
    conn.close()

    def strict(text: str):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in a stream event"))

    assert events[-1] == "[DONE]" and all(strict(e) for e in events[:-1])


def test_a_bug_answers_openai_error_json_not_text(chat_engine):
    """An unhandled exception (here: the engine's stats failing) is a 500 in OpenAI's error JSON
    without the exception's text (before: Starlette's text/plain "Internal Server Error")."""
    import asyncio

    from autoglm_trt.runtime import Engine
    from autoglm_trt.serve.app import ServeConfig, create_app

    with Engine.load(chat_engine) as engine:
        app = create_app(engine, ServeConfig("tiny-chat"))
        engine.stats = lambda: (_ for _ in ()).throw(RuntimeError("secret internals"))  # type: ignore[method-assign]
        sent: list[dict] = []

        async def call() -> None:
            body = json.dumps({"model": "tiny-chat", "prompt": "hi", "max_tokens": 1}).encode()
            messages = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> dict:
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                sent.append(message)

            scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                     "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
                     "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}
            with contextlib.suppress(RuntimeError):  # Starlette re-raises the bug after answering (for the log)
                await app(scope, receive, send)

        asyncio.run(call())
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert start["status"] == 500 and (b"content-type", b"application/json") in start["headers"]
    answer = json.loads(body)
    assert is_openai_error(answer) and answer["error"]["type"] == "server_error"
    assert "secret internals" not in answer["error"]["message"]
