"""``autoglm-trt serve`` as a real server on a free loopback port, started and stopped by each
test: the official ``openai`` client for the API, raw HTTP for errors, auth, disconnects,
back-pressure and the SIGTERM drain."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from conftest import ROOT, free_port

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")
openai = pytest.importorskip("openai", reason="the openai client is part of the test extra")

from autoglm_trt.runtime import Engine, SamplingParams  # noqa: E402

START_S = 90


@contextlib.contextmanager
def server(engine_dir, *args: str):
    """A running ``autoglm-trt serve`` (yields (port, process)); always stopped afterwards. Its output
    goes to a file (a pipe nobody reads would stall a server that logs much)."""
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "autoglm_trt", "serve", str(engine_dir), "--port", str(port),
                             *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"server exited: {log.read()[-4000:]}")
            try:
                if request(port, "GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError("server did not become ready")
        yield port, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()


def request(port: int, method: str, path: str, body: object = None, headers: dict | None = None,
            raw: bytes | None = None) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, data, {"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode()
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = {"text": text}
        return r.status, parsed, {k.lower(): v for k, v in r.getheaders()}
    finally:
        conn.close()


def metrics(port: int) -> dict[str, float]:
    status, body, _ = request(port, "GET", "/metrics")
    out = {}
    for line in body["text"].splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def client(port: int, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


def test_openai_client_completions_chat_streaming(chat_engine):
    prompts = ["Once upon a time", "The capital of France is"]
    with Engine.load(chat_engine) as engine:
        expected = [r.text for r in engine.generate(prompts, SamplingParams(max_new_tokens=12, ignore_eos=True))]
        chat_expected = engine.generate([[{"role": "user", "content": "hi"}]], SamplingParams(max_new_tokens=8))[0]
    with server(chat_engine) as (port, _):
        c = client(port)
        assert [m.id for m in c.models.list().data] == ["tiny-chat"]
        for prompt, text in zip(prompts, expected):
            r = c.completions.create(model="tiny-chat", prompt=prompt, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
            assert r.choices[0].text == text and r.choices[0].finish_reason == "length"
            assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
        pieces, usage = [], None
        for chunk in c.completions.create(model="tiny-chat", prompt=prompts[0], max_tokens=12, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}):
            pieces += [ch.text for ch in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(pieces) == expected[0] and usage.completion_tokens == 12
        chat = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == chat_expected.text
        assert chat.choices[0].message.role == "assistant"
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, stream=True)
            if ch.choices)
        assert streamed == chat_expected.text
        stop = expected[0][4:6]
        r = c.completions.create(model="tiny-chat", prompt=prompts[0], max_tokens=12, temperature=0, stop=[stop],
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == expected[0][: expected[0].find(stop)] and r.choices[0].finish_reason == "stop"
        seeded = [c.completions.create(model="tiny-chat", prompt="x", max_tokens=10, temperature=1.0, seed=s,
                                       extra_body={"ignore_eos": True}).choices[0].text for s in (5, 5, 6)]
        assert seeded[0] == seeded[1] != seeded[2]


def test_n_samples_and_beams_are_choices(chat_engine):
    """``n`` seeded samples and the ``beam_width`` extension come back as OpenAI choices, the same
    ones the engine gives in-process; usage counts every choice's tokens."""
    samples = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    beams = SamplingParams(max_new_tokens=8, beam_width=3, n=2, ignore_eos=True)
    with Engine.load(chat_engine) as engine:
        [want_samples] = engine.generate(["Once upon a time"], samples)
        [want_beams] = engine.generate(["Once upon a time"], beams)
    with server(chat_engine) as (port, _):
        c = client(port)
        r = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3,
                                 n=3, extra_body={"ignore_eos": True})
        assert [ch.index for ch in r.choices] == [0, 1, 2]
        assert [ch.text for ch in r.choices] == [ch.text for ch in want_samples.choices]
        assert r.usage.completion_tokens == 24
        r = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=8, temperature=0, n=2,
                                 extra_body={"ignore_eos": True, "beam_width": 3})
        assert [ch.text for ch in r.choices] == [ch.text for ch in want_beams.choices]
        assert metrics(port)["autoglm_kv_blocks_used"] == 0


@pytest.mark.parametrize("body, status, message", [
    (None, 400, "not valid JSON"),
    ({"model": "tiny-chat", "prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "tiny-chat", "prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ({"model": "tiny-chat", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ({"model": "other", "prompt": "hi"}, 404, "is not served here"),
    ({"model": "tiny-chat", "prompt": "x" * 300}, 400, "prompt tokens"),
    ({"model": "tiny-chat", "prompt": "hi", "max_tokens": 500}, 400, "max_seq_len"),
    ({"model": "tiny-chat", "prompt": "hi", "n": 2, "stream": True}, 400, "stream carries one choice"),
    ({"model": "tiny-chat", "prompt": "hi", "n": 65}, 400, "n"),
    ({"model": "tiny-chat", "prompt": "hi", "beam_width": 2}, 400, "leave temperature at 0"),
    ({"model": "tiny-chat", "prompt": "hi", "logprobs": 30}, 400, "logprobs"),
    ({"model": "tiny-chat", "prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ({"model": "tiny-chat", "prompt": "hi", "best_of": 3}, 400, "best_of is not supported"),
    ({"model": "tiny-chat", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias keys are token ids"),
    ({"model": "tiny-chat", "prompt": "hi", "logit_bias": {"99999": 1}}, 400, "outside the vocabulary"),
    ({"model": "tiny-chat", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "yaml"}}, 400, "response_format type must be"),
    ({"model": "tiny-chat", "messages": [{"role": "user", "content": "x", "audio": {"id": "1"}}]}, 400, "audio"),
    ({"model": "tiny-chat", "prompt": [1, 2, 999999]}, 400, "outside the vocabulary"),
    ({"model": "tiny-chat"}, 400, "prompt"),
    ({"model": "tiny-chat", "messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
])
def test_client_mistakes_are_4xx_with_the_reason(chat_engine, body, status, message):
    path = "/v1/chat/completions" if body and "messages" in body else "/v1/completions"
    with server(chat_engine) as (port, _):
        got, err, _ = request(port, "POST", path, body, raw=b"{not json" if body is None else None)
        assert got == status and message in err["error"]["message"], err
        assert set(err["error"]) >= {"message", "type", "code"}
        assert request(port, "GET", "/health")[0] == 200


def test_api_key(chat_engine, monkeypatch):
    with server(chat_engine, "--api-key", "s3cret") as (port, _):
        body = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2}
        assert request(port, "POST", "/v1/completions", body)[0] == 401
        assert request(port, "POST", "/v1/completions", body, {"Authorization": "Bearer wrong"})[0] == 401
        assert request(port, "GET", "/metrics")[0] == 401
        assert request(port, "POST", "/v1/completions", body, {"Authorization": "Bearer s3cret"})[0] == 200
        assert request(port, "GET", "/health")[0] == 200
        with pytest.raises(openai.AuthenticationError):
            client(port, "nope").completions.create(model="tiny-chat", prompt="hi", max_tokens=2)


def test_a_body_that_never_comes_is_a_408_and_holds_nothing(chat_engine):
    """Clients that declare the largest body and send none of it: the server answers others
    meanwhile (nothing is held for them), and each gets a 408 and a closed connection once its body
    has not come for --client-timeout."""
    with server(chat_engine, "--client-timeout", "2", "--max-body-bytes", str(200 << 20)) as (port, _):
        idle = []
        for _ in range(3):  # 600 MB declared, past the 400 MB the bodies in flight may hold
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(200 << 20).encode() + b"\r\n\r\n")
            idle.append(sock)
        body = {"model": "tiny-chat", "prompt": "hi", "max_tokens": 2}
        assert request(port, "POST", "/v1/completions", body, raw=json.dumps(body).encode() + b" " * (150 << 20))[0] == 200
        for sock in idle:
            answer = b""
            while chunk := sock.recv(65536):  # to the end: the server closes the connection
                answer += chunk
            sock.close()
            head, _, text = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
            assert json.loads(text)["error"]["code"] == "body_timeout"


def _open_stream(port: int, max_tokens: int) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "slow", "prompt": "go", "max_tokens": max_tokens,
                                                        "stream": True, "temperature": 0, "ignore_eos": True}),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # generation is under way
    return conn, r


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_cancels_and_frees_blocks(slow_engine):
    with server(slow_engine) as (port, _):
        conn, _ = _open_stream(port, 1500)
        assert metrics(port)["autoglm_kv_blocks_used"] > 0
        conn.sock.shutdown(2)
        conn.close()
        assert wait_for(lambda: metrics(port)["autoglm_kv_blocks_used"] == 0)
        m = metrics(port)
        assert m["autoglm_requests_running"] == 0
        assert m['autoglm_requests_finished_total{finish_reason="cancelled"}'] == 1


def test_a_client_that_stops_reading_is_let_go(slow_engine):
    """The app behind its guard, called as the server calls it, by a client that takes in its
    stream's first chunk and nothing after: the stuck send raises through Starlette and FastAPI to
    the guard, which returns; the request is cancelled mid-generation and frees its blocks."""
    import asyncio

    from autoglm_trt.serve.app import ServeConfig, create_app

    body = json.dumps({"model": "slow", "prompt": "go", "max_tokens": 1500, "stream": True, "ignore_eos": True})

    async def scenario(app) -> list[bytes]:
        got: list[bytes] = []

        async def receive() -> dict:  # the body, then a client that stays connected and says nothing
            if not got:
                got.append(b"")
                return {"type": "http.request", "body": body.encode(), "more_body": False}
            await asyncio.Event().wait()
            return {}

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body" and len(got) > 2:
                await asyncio.Event().wait()  # its buffers are full: it reads no more
            got.append(message.get("body", b"start"))

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "scheme": "http", "root_path": ""}
        await asyncio.wait_for(app(scope, receive, send), 60)
        # let go while the event loop still runs (asyncio.run would close a suspended generator on its way out)
        deadline = time.monotonic() + 2
        while (engine.stats()["running"] or app.state.serving.inflight) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return got[1:]

    with Engine.load(slow_engine) as engine:
        app = create_app(engine, ServeConfig("slow", client_timeout=0.3))
        sent = asyncio.run(scenario(app))
        assert sent[0] == b"start" and sent[1].startswith(b"data: ") and len(sent) == 2
        serving = app.state.serving
        assert engine.stats()["running"] == 0 and serving.inflight == 0
        assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
        registry = serving.metrics.registry
        assert registry.get_sample_value("autoglm_requests_finished_total", {"finish_reason": "cancelled"}) == 1
        assert registry.get_sample_value("autoglm_generation_tokens_total") in (None, 0.0)  # it never finished


def test_full_queue_answers_429(slow_engine):
    with server(slow_engine, "--max-waiting", "1") as (port, _):
        first, _ = _open_stream(port, 1500)  # running (the engine runs one sequence at a time)
        waiting = threading.Thread(target=request, args=(port, "POST", "/v1/completions",
                                                         {"model": "slow", "prompt": "wait", "max_tokens": 4}))
        waiting.start()
        assert wait_for(lambda: metrics(port)["autoglm_requests_waiting"] == 1)
        status, err, headers = request(port, "POST", "/v1/completions", {"model": "slow", "prompt": "no", "max_tokens": 4})
        assert status == 429 and err["error"]["type"] == "rate_limit_error" and headers.get("retry-after") == "1"
        first.close()
        waiting.join(60)


def test_sigterm_drains_then_exits_zero(slow_engine):
    with server(slow_engine, "--drain-seconds", "60") as (port, proc):
        conn, r = _open_stream(port, 1500)  # unread until the 503s are seen: it cannot end before them
        proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: request(port, "GET", "/health")[0] == 503, 10)
        assert request(port, "POST", "/v1/completions", {"model": "slow", "prompt": "late"})[0] == 503
        rest = r.read().decode()  # the running request finishes in full
        chunks = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length" and rest.rstrip().endswith("data: [DONE]")
        conn.close()
        assert proc.wait(60) == 0


def test_load_test_script_and_bench_url(chat_engine):
    """The load test (bounded: 100 requests, 8 clients; disconnects of streams and of n = 3 requests,
    malformed and oversized bodies, wrong keys; one attacker sending a 240 KB grammar, stop-string
    floods and n = 4 requests it leaves) passes its own checks, and ``bench --url`` measures the
    server."""
    with server(chat_engine, "--api-key", "k", "--max-body-bytes", str(2 << 20)) as (port, _):
        url = f"http://127.0.0.1:{port}"
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "load_test.py"), "--url", url, "--requests", "100",
                            "--concurrency", "8", "--gen-len", "16", "--disconnect", "0.2", "--malformed", "0.1",
                            "--oversized", "0.05", "--bad-key", "0.05", "--api-key", "k", "--max-body-bytes",
                            str(2 << 20), "--attackers", "1"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads(r.stdout.splitlines()[0])
        assert report["outcomes"]["completed"] > 30 and report["outcomes"]["cancelled"] > 0
        assert all(report["outcomes"][kind] > 0 for kind in ("malformed", "oversized", "bad_key"))
        assert set(report["attacks"]) == {"grammar", "stops", "leave"}
        assert report["kv_blocks_used_after"] == 0 and report["requests_live_after"] == 0
        assert not any(int(s) >= 500 for s in report["statuses"])
        b = subprocess.run([sys.executable, "-m", "autoglm_trt", "bench", "--url", url, "--api-key", "k",
                            "--concurrency", "1,4", "--prompt-len", "8", "--gen-len", "8", "--json"],
                           capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert b.returncode == 0, b.stderr
        rows = [json.loads(line) for line in b.stdout.splitlines()]
        assert [x["concurrency"] for x in rows] == [1, 4] and all(x["tokens_per_s"] > 0 for x in rows)


def test_image_url_parts_over_the_openai_client(glm4v_engine):
    """Open-AutoGLM's request shape (a screenshot as a data: URL beside text, streamed) against the
    engine's own answer; image tokens counted in usage; bad images are 400s with the reason."""
    from conftest import data_url, image_message, random_image

    shot = random_image(108, 240, 4)
    messages = [{"role": "system", "content": "You are a phone agent."}, *image_message("Tap the button. ", shot)]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    with Engine.load(glm4v_engine) as engine:
        want = engine.generate([messages], params)[0]
    with server(glm4v_engine, "--max-images", "1") as (port, _):
        c = client(port)
        pieces, use = [], None
        for chunk in c.chat.completions.create(model="tiny-glm4v", messages=messages, max_tokens=8, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}):
            pieces += [ch.delta.content or "" for ch in chunk.choices]
            use = chunk.usage or use
        assert "".join(pieces) == want.text
        # Open-AutoGLM's own parameters (phone_agent/model/client.py): top_p 0.85, frequency_penalty 0.2
        agent = SamplingParams(max_new_tokens=8, top_p=0.85, frequency_penalty=0.2, ignore_eos=True)
        with Engine.load(glm4v_engine) as engine:
            want_agent = engine.generate([messages], agent)[0]
        streamed = c.chat.completions.create(model="tiny-glm4v", messages=messages, max_tokens=8, temperature=0.0,
                                             top_p=0.85, frequency_penalty=0.2, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == want_agent.text
        assert use.prompt_tokens == want.prompt_tokens and use.completion_tokens == 8
        base = {"model": "tiny-glm4v", "max_tokens": 2}
        for url, message in [("https://example.com/shot.png", "not fetched"),
                             ("data:image/png;base64,aGVsbG8=", "not an image"),
                             ("file:///etc/passwd", "allowed_local_media_path")]:
            body = {**base, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
            status, err, _ = request(port, "POST", "/v1/chat/completions", body)
            assert status == 400 and message in err["error"]["message"], err
        r = subprocess.run([sys.executable, str(ROOT / "tools" / "load_test.py"), "--url", f"http://127.0.0.1:{port}",
                            "--requests", "24", "--concurrency", "4", "--gen-len", "8", "--prompt-len", "8",
                            "--image", "120x260", "--disconnect", "0.2", "--malformed", "0.1"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr  # screenshots under load: no 5xx, nothing lost or leaked
        b = subprocess.run([sys.executable, "-m", "autoglm_trt", "bench", "--url", f"http://127.0.0.1:{port}",
                            "--concurrency", "2", "--prompt-len", "4", "--gen-len", "4", "--image", "100x200",
                            "--json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert b.returncode == 0 and json.loads(b.stdout.splitlines()[0])["tokens_per_s"] > 0, b.stderr
        two = [{"type": "image_url", "image_url": {"url": data_url(shot)}}] * 2
        status, err, _ = request(port, "POST", "/v1/chat/completions",
                                 {**base, "messages": [{"role": "user", "content": two}]})
        assert status == 400 and "more than 1 image(s)" in err["error"]["message"], err
        assert request(port, "GET", "/health")[0] == 200


def test_a_screenshot_larger_than_the_image_memory_is_served_alone(glm4v_engine):
    """--max-image-memory smaller than one screenshot's embeddings: a request alone is still served,
    and what it held is let go when it ends (the next is served too); text is never counted."""
    from conftest import image_message, random_image

    body = {"model": "tiny-glm4v", "messages": image_message("Tap. ", random_image(108, 240, 5)), "max_tokens": 3}
    with server(glm4v_engine, "--max-image-memory", "1") as (port, _):
        for stream in (False, True, False):
            status, answer, _ = request(port, "POST", "/v1/chat/completions", {**body, "stream": stream})
            assert status == 200, answer
        text = {"model": "tiny-glm4v", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert request(port, "POST", "/v1/chat/completions", text)[0] == 200


def test_logprobs_in_openai_shapes_whole_and_streamed(chat_engine):
    """Chat ``logprobs``/``top_logprobs`` and the completions API's ``logprobs``: one entry per generated
    token, equal to the engine's, the alternatives sorted; a stream's chunks carry the same entries."""
    messages = [{"role": "user", "content": "hi"}]
    with Engine.load(chat_engine) as engine:
        [want] = engine.generate([messages], SamplingParams(max_new_tokens=8, logprobs=2, ignore_eos=True))
    with server(chat_engine) as (port, _):
        c = client(port)
        r = c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                      logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens == 8
        assert [x.logprob for x in content] == pytest.approx([e.logprob for e in want.choices[0].logprobs], abs=1e-6)
        assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob >= x.top_logprobs[1].logprob
                   for x in content)
        streamed = []
        for chunk in c.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=8, temperature=0,
                                               logprobs=True, top_logprobs=2, stream=True,
                                               extra_body={"ignore_eos": True}):
            if chunk.choices and chunk.choices[0].logprobs:
                streamed += chunk.choices[0].logprobs.content
        assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-5)
        done = c.completions.create(model="tiny-chat", prompt="Once upon", max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
        lp = done.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
        status, err, _ = request(port, "POST", "/v1/chat/completions",
                                 {"model": "tiny-chat", "messages": messages, "top_logprobs": 2})
        assert status == 400 and "top_logprobs needs logprobs" in err["error"]["message"]


def test_structured_output_over_the_openai_client(glm4v_engine):
    """response_format json_schema (OpenAI's client), vLLM's guided_choice and a shipped grammar by
    name, streamed or not: every answer parses; malformed or doubled guides are 400s."""
    schema = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "tag": {"enum": ["a", "b"]}},
              "required": ["x", "tag"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Answer."}]
    with server(glm4v_engine) as (port, _):
        c = client(port)
        r = c.chat.completions.create(model="tiny-glm4v", messages=messages, max_tokens=60, temperature=1.0, seed=3,
                                      n=8, response_format={"type": "json_schema",
                                                            "json_schema": {"name": "a", "schema": schema}})
        for choice in r.choices:
            answer = json.loads(choice.message.content)
            assert answer["tag"] in ("a", "b") and 0 <= answer["x"] <= 9 and choice.finish_reason == "stop"
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny-glm4v", messages=messages, max_tokens=20, stream=True,
            extra_body={"guided_choice": ["yes", "no"]}) if ch.choices)
        assert text in ("yes", "no")
        r = c.chat.completions.create(model="tiny-glm4v", messages=messages, max_tokens=240, temperature=0,
                                      extra_body={"guided_grammar": "autoglm_action"})
        assert r.choices[0].finish_reason in ("stop", "length")
        for body, message in [({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "schema"),
                              ({"guided_regex": "a", "guided_choice": ["b"]}, "give one output guide"),
                              ({"guided_regex": "(unclosed"}, "not usable"),
                              ({"guided_grammar": "no_such_grammar"}, "no shipped grammar"),
                              # longer than a file's name may be: looked up, never opened
                              ({"guided_grammar": "a" * 300}, "no shipped grammar named '" + "a" * 64 + "...'"),
                              ({"structured_outputs": {"grammar": "b" * 300}}, "no shipped grammar")]:
            status, err, _ = request(port, "POST", "/v1/chat/completions",
                                     {"model": "tiny-glm4v", "messages": messages, "max_tokens": 4, **body})
            assert status == 400 and message in err["error"]["message"], err


def test_tool_calls_required_and_named(glm4v_engine):
    """``tool_choice`` "required" or a named function: the call is generated under the arguments'
    schema and returned as OpenAI ``tool_calls`` (streamed as one ``delta.tool_calls``); a history
    with a call and its tool answer is accepted; "auto" is a 400 that says why."""
    tap = {"type": "function", "function": {"name": "tap", "description": "Tap a point", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["x", "y"],
        "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 999},
                       "y": {"type": "integer", "minimum": 0, "maximum": 999}}}}}
    back = {"type": "function", "function": {"name": "back", "parameters": {
        "type": "object", "additionalProperties": False, "properties": {}}}}
    messages = [{"role": "user", "content": "Open the settings."}]
    with server(glm4v_engine) as (port, _):
        c = client(port)
        r = c.chat.completions.create(model="tiny-glm4v", messages=messages, tools=[tap, back], tool_choice="required",
                                      max_tokens=60, temperature=1.0, seed=2, n=6)
        for choice in r.choices:
            [call] = choice.message.tool_calls
            args = json.loads(call.function.arguments)
            assert choice.finish_reason == "tool_calls" and call.function.name in ("tap", "back")
            assert (set(args) == {"x", "y"} and all(0 <= v <= 999 for v in args.values())) if call.function.name == "tap" \
                else args == {}
        named = {"type": "function", "function": {"name": "tap"}}
        calls = []
        for chunk in c.chat.completions.create(model="tiny-glm4v", messages=messages, tools=[tap, back],
                                               tool_choice=named, max_tokens=60, stream=True):
            if chunk.choices and chunk.choices[0].delta.tool_calls:
                calls += chunk.choices[0].delta.tool_calls
        assert len(calls) == 1 and calls[0].function.name == "tap"
        assert set(json.loads(calls[0].function.arguments)) == {"x", "y"}
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "back", "arguments": "{}"}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
        r = c.chat.completions.create(model="tiny-glm4v", messages=history, tools=[tap, back], tool_choice="none",
                                      max_tokens=4)
        assert r.choices[0].message.content is not None
        status, err, _ = request(port, "POST", "/v1/chat/completions",
                                 {"model": "tiny-glm4v", "messages": messages, "tools": [tap], "max_tokens": 4})
        assert status == 400 and "tool_choice \"auto\"" in err["error"]["message"], err
        status, err, _ = request(port, "POST", "/v1/chat/completions",
                                 {"model": "tiny-glm4v", "messages": messages, "tools": [tap], "max_tokens": 4,
                                  "tool_choice": {"type": "function", "function": {"name": "swipe"}}})
        assert status == 400 and "not among the tools" in err["error"]["message"], err
