"""A small OpenAI client on the standard library, for ``bench --url`` and the load test.

``stream_completion`` sends token ids (or text) as a completion's prompt, ``stream_chat`` chat
messages (with image parts: ``model.screens.screenshot_message``); both read the server-sent events, noting
the time of every chunk that carries text (one chunk is normally one token) and the token
count from the final ``usage`` chunk.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..model.screens import screenshot_message
from ..runtime.bench import Call


@dataclass
class StreamResult:
    status: int
    submitted: float
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False  # the stream ended with [DONE]
    error: str | None = None


def connect(url: str, timeout: float = 300.0) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"expected a URL like http://127.0.0.1:8080, got {url!r}")
    return http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout), parts.path.rstrip("/")


def served_model(url: str, api_key: str | None = None) -> str:
    conn, base = connect(url, 30)
    try:
        conn.request("GET", f"{base}/v1/models", headers=_headers(api_key))
        r = conn.getresponse()
        body = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"{url}/v1/models answered {r.status}: {body}")
        return str(body["data"][0]["id"])
    finally:
        conn.close()


def _headers(api_key: str | None) -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    if api_key:
        h["Authorization"] = f"Bearer {api_key}"
    return h


def stream_completion(url: str, model: str, prompt: list[int] | str, max_tokens: int, api_key: str | None = None,
                      stop_after_chunks: int | None = None) -> StreamResult:
    """One streamed greedy completion (EOS ignored); with ``stop_after_chunks`` the client hangs
    up after that many text chunks (a disconnect mid-stream)."""
    return _stream(url, "/v1/completions", {"model": model, "prompt": prompt}, max_tokens, api_key, stop_after_chunks)


def stream_chat(url: str, model: str, messages: list[dict], max_tokens: int, api_key: str | None = None,
                stop_after_chunks: int | None = None) -> StreamResult:
    """``stream_completion`` for chat messages (``/v1/chat/completions``)."""
    return _stream(url, "/v1/chat/completions", {"model": model, "messages": messages}, max_tokens, api_key,
                   stop_after_chunks)


def _stream(url: str, path: str, request: dict, max_tokens: int, api_key: str | None,
            stop_after_chunks: int | None) -> StreamResult:
    conn, base = connect(url)
    body = {**request, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    res = StreamResult(0, time.perf_counter())
    try:
        conn.request("POST", f"{base}{path}", json.dumps(body), _headers(api_key))
        r = conn.getresponse()
        res.status = r.status
        if r.status != 200:
            res.error = r.read().decode(errors="replace")[:300]
            return res
        while line := r.readline():
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                res.done = True
                break
            chunk = json.loads(data)
            if chunk.get("error"):  # the request failed after its stream began
                res.error = str(chunk["error"].get("message"))[:300]
            if chunk.get("usage"):
                res.completion_tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    res.token_times.append(time.perf_counter())
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if stop_after_chunks is not None and len(res.token_times) >= stop_after_chunks:
                break
        return res
    finally:
        conn.close()


def url_call(url: str, api_key: str | None = None, image: tuple[int, int] | None = None) -> Call:
    """``runtime.bench``'s request function against a server's streamed completions; with ``image``
    (width, height), chat requests that each carry a new screenshot of that size and the prompt's
    ids as text."""
    model = served_model(url, api_key)
    count = [0]

    def call(prompt: list[int], gen_len: int) -> tuple[list[float], float, int]:
        if image is None:
            res = stream_completion(url, model, prompt, gen_len, api_key)
        else:
            count[0] += 1
            res = stream_chat(url, model, screenshot_message(count[0], image, " ".join(map(str, prompt))), gen_len,
                              api_key)
        if res.status != 200 or not res.done:
            raise RuntimeError(f"{url} answered {res.status}: {res.error}")
        return res.token_times, res.submitted, res.completion_tokens

    return call
