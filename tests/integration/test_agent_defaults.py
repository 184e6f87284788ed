"""AutoGLM's agents out of the box: the default build of a GLM-4.1V checkpoint and the default server
take Open-AutoGLM's first request unchanged — a long system prompt and a 1080 x 2400 screenshot (here
a PNG that does not compress, the worst case for its size) as a data: URL, streamed, with the
client's own sampling parameters (phone_agent/model/client.py: max_tokens 3000, temperature 0,
top_p 0.85, frequency_penalty 0.2). Before, the build gave every model sequences of 2,048 tokens
(a 400: the screenshot alone is 3,354) and the server took bodies of 8 MiB (a 413: the data URL
is 13.8 MB)."""

from __future__ import annotations

import base64
import http.client
import io
import json

import numpy as np
import pytest
from conftest import run_cli
from test_serve import metrics, server, wait_for

pytest.importorskip("fastapi", reason="the serve extra (fastapi, uvicorn, prometheus-client) is not installed")

# GLM-4.1V-9B's own preprocessor_config.json (its images up to 9,633,792 pixels, counted twice)
GLM41V_PREPROCESSOR = {"size": {"shortest_edge": 12544, "longest_edge": 9633792}}


def worst_case_screenshot() -> bytes:
    """A 1080 x 2400 RGBA PNG of noise, as a phone's screencap is RGBA: it does not compress (~10 MB)."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (2400, 1080, 4), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGBA").save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def default_engine(tmp_path_factory):
    """A tiny GLM-4.1V with GLM-4.1V-9B's preprocessor and sequence length, built with every limit left
    to its default (fp32, to skip calibration)."""
    from tiny_models import make_tiny_checkpoint

    work = tmp_path_factory.mktemp("agent-defaults")
    ckpt = make_tiny_checkpoint("glm4v", work / "ckpt", preprocessor=GLM41V_PREPROCESSOR,
                                max_position_embeddings=65536)
    r = run_cli("build", str(ckpt), "--precision", "fp32", "-o", str(work / "tiny-agent"))
    assert r.returncode == 0, r.stderr
    assert "sequences of up to 65,536 tokens" in r.stdout + r.stderr
    return work / "tiny-agent"


def test_doctor_says_the_body_limit_serve_takes(default_engine):
    from autoglm_trt.serve.guard import default_max_body_bytes

    r = run_cli("doctor", str(default_engine))
    assert r.returncode == 0, r.stderr
    limit = default_max_body_bytes(10, GLM41V_PREPROCESSOR["size"]["longest_edge"])
    assert f"serve takes request bodies of up to {limit:,} bytes by default" in r.stdout and limit > 500_000_000


def test_the_default_build_and_server_answer_open_autoglms_request(default_engine):
    png = worst_case_screenshot()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert len(url) > 13_000_000  # past the 8 MiB the server took before
    system = "You are a phone agent. " + "Reply with <think>...</think><answer>do(action=...)</answer>. " * 30
    body = {"model": "tiny-agent", "stream": True, "max_tokens": 3000, "temperature": 0.0, "top_p": 0.85,
            "frequency_penalty": 0.2, "messages": [{"role": "system", "content": system},
                                                   _screenshot_turn("Open the settings. ** Screen Info **", url)]}
    with server(default_engine) as (port, _):
        conn, r = _posted(port, body)
        chunks = 0
        while chunks < 24 and (line := r.readline()):
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                chunks += 1
        assert chunks == 24  # the role chunk, then the answer's tokens as they come
        conn.sock.shutdown(2)  # the agent has what it needs to see the step run; it leaves
        conn.close()
        assert wait_for(lambda: metrics(port)["autoglm_kv_blocks_used"] == 0, 60)
        # the prompt admitted: the screenshot's 3,354 image tokens and the text around them
        assert metrics(port)["autoglm_prefix_cache_queried_tokens_total"] > 3354 + len(system)


def _screenshot_turn(text: str, url: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}


def _posted(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """The chat request sent, and its response (status 200) to read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()[:500]
    return conn, r


PHASES = ("read", "images_wait", "decode", "preprocess", "encoder_wait", "encode", "queue_prefill")


def test_the_server_splits_a_screenshot_steps_time_to_first_token(default_engine):
    """``autoglm_request_phase_seconds``: a screenshot request's time from its headers to its first
    token, phase by phase (each observed once, none negative); the phases are disjoint parts of it,
    so they add up to no more than the whole."""
    url = "data:image/png;base64," + base64.b64encode(worst_case_screenshot()).decode()
    # ignore_eos: at the default temperature the random model may sample its end token first
    body = {"model": "tiny-agent", "max_tokens": 2, "ignore_eos": True,
            "messages": [_screenshot_turn("Open the settings.", url)]}
    with server(default_engine) as (port, _):
        conn, r = _posted(port, body)
        assert json.loads(r.read())["usage"]["completion_tokens"] == 2
        conn.close()
        seen = metrics(port)
    count = {p: seen[f'autoglm_request_phase_seconds_count{{phase="{p}"}}'] for p in (*PHASES, "ttft")}
    took = {p: seen[f'autoglm_request_phase_seconds_sum{{phase="{p}"}}'] for p in (*PHASES, "ttft")}
    assert set(count.values()) == {1.0} and min(took.values()) >= 0.0
    assert took["encode"] > 0 and took["decode"] > 0 and took["queue_prefill"] > 0
    assert sum(took[p] for p in PHASES) <= took["ttft"] + 1e-3
