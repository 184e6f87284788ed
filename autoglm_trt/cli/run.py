"""Commands that run engines: generate, bench, serve."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import AutoGLMError
from ..serve.guard import CLIENT_TIMEOUT_S
from . import _log, cli


@cli.command("generate")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.argument("prompt")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--chat", is_flag=True, help="Wrap the prompt as a user message in the model's chat template.")
@click.option("--stream", is_flag=True, help="Print text as it is generated.")
@click.option("--n", "n", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Samples to draw (sharing the prompt's KV blocks); with --beam-width, beams to print.")
@click.option("--beam-width", type=click.IntRange(1, 64), default=1, show_default=True,
              help="Beam search with this many beams (needs --temperature 0).")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Share the KV blocks of prompts' common prefixes (agent loops resend the same history).")
def generate_cmd(engine_dir: Path, prompt: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float,
                 seed: int | None, stop: tuple[str, ...], chat: bool, stream: bool, n: int, beam_width: int,
                 prefix_caching: bool) -> None:
    """Generate a continuation of PROMPT with the engine in ENGINE_DIR."""
    from ..runtime import Engine, SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            seed=seed, stop=stop, n=n, beam_width=beam_width)
    message = [{"role": "user", "content": prompt}] if chat else prompt
    with Engine.load(engine_dir, prefix_caching=prefix_caching) as engine:
        if stream:
            for piece in engine.stream(message, params):
                click.echo(piece, nl=False)
            click.echo()
        else:
            [res] = engine.generate([message], params)
            for k, c in enumerate(res.choices):
                if len(res.choices) > 1:
                    _log(f"[{k}]" + (f" score {c.score:.4f}" if c.score is not None else ""))
                click.echo(c.text)
                _log(f"[{len(c.token_ids)} tokens, finish reason: {c.finish_reason}]")


@cli.command("bench")
@click.argument("engine_dir", type=click.Path(path_type=Path), required=False)
@click.option("--url", default=None, help="Measure a running server (http://HOST:PORT) instead of an engine directory.")
@click.option("--api-key", envvar="AUTOGLM_API_KEY", default=None, help="The server's API key, if it has one.")
@click.option("--concurrency", default="1,4,16", show_default=True, help="Comma-separated concurrency levels.")
@click.option("--prompt-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--gen-len", type=click.IntRange(1), default=64, show_default=True)
@click.option("--requests", type=click.IntRange(1), default=None, help="Requests per level [default: 2 x concurrency].")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per level.")
@click.option("--plot", type=click.Path(path_type=Path), default=None, help="Write a PNG of latency and throughput.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Share the KV blocks of prompts' common prefixes (agent loops resend the same history).")
@click.option("--image", default=None, metavar="WxH",
              help="Image-text models: each request a chat with a new synthetic screenshot of this size "
                   "(e.g. 1080x2400) and the prompt as text.")
def bench_cmd(engine_dir: Path | None, url: str | None, api_key: str | None, concurrency: str, prompt_len: int,
              gen_len: int, requests: int | None, as_json: bool, plot: Path | None, prefix_caching: bool,
              image: str | None) -> None:
    """Time to first token, per-token latency and throughput at several concurrency levels,
    of ENGINE_DIR in this process or of a server at --url."""
    import contextlib
    import json

    from ..runtime import Engine
    from ..runtime.bench import engine_call, run_level
    from ..runtime.bench import plot as draw

    try:
        levels = [int(c) for c in concurrency.split(",")]
    except ValueError as exc:
        raise AutoGLMError(f"--concurrency takes comma-separated integers, got {concurrency!r}") from exc
    if (engine_dir is None) == (url is None):
        raise AutoGLMError("give an ENGINE_DIR or --url, not both or neither")
    size = _image_size(image) if image is not None else None
    rows = []
    with contextlib.ExitStack() as stack:
        if url is not None:
            from ..serve.client import url_call

            call, vocab = url_call(url, api_key, size), 256  # token ids below 256 exist in every vocabulary
        else:
            assert engine_dir is not None
            engine = stack.enter_context(Engine.load(engine_dir, prefix_caching=prefix_caching))
            call, vocab = engine_call(engine, size), engine.spec.vocab_size
        run_level(call, vocab, 1, prompt_len, 4, 1)  # warm-up
        for c in levels:
            row = run_level(call, vocab, c, prompt_len, gen_len, requests or 2 * c)
            rows.append(row)
            if as_json:
                click.echo(json.dumps(row))
            else:
                click.echo(f"concurrency {c:3d}: TTFT P50 {row['ttft_ms_p50']:7.1f} ms | per token P50 "
                           f"{row['token_ms_p50']:6.1f} P90 {row['token_ms_p90']:6.1f} P99 {row['token_ms_p99']:6.1f} ms"
                           f" | {row['tokens_per_s']:7.1f} tokens/s")
    if plot:
        draw(rows, plot)
        _log(f"plot written to {plot}")


def _image_size(text: str) -> tuple[int, int]:
    try:
        width, height = (int(v) for v in text.lower().split("x"))
    except ValueError as exc:
        raise AutoGLMError(f"--image takes WIDTHxHEIGHT, e.g. 1080x2400; got {text!r}") from exc
    if not (0 < width <= 8192 and 0 < height <= 8192):
        raise AutoGLMError(f"--image sides must be 1..8192 pixels, got {width}x{height}")
    return width, height


@cli.command("serve")
@click.argument("engine_dir", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8080, show_default=True)
@click.option("--api-key", envvar="AUTOGLM_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' (or set AUTOGLM_API_KEY); /health stays open.")
@click.option("--served-model-name", default=None, help="Model name clients send [default: the engine directory's name].")
@click.option("--max-waiting", type=click.IntRange(0), default=256, show_default=True,
              help="Requests queued (or having their images encoded) beyond which new ones get 429.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Seconds a request may run; it then ends with the text so far and finish_reason 'length'.")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="On SIGTERM, how long running requests may take to finish.")
@click.option("--threads", type=click.IntRange(0, 256), default=0, help="ONNX Runtime intra-op threads (0: all cores).")
@click.option("--spinning/--no-spinning", default=True, show_default=True,
              help="Whether the decoder's idle threads spin waiting for work (ONNX Runtime's default) or block; "
                   "blocking helps an image-text engine whose decoding, more than its prefill, overlaps encodes.")
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True,
              help="Share the KV blocks of prompts' common prefixes (agent loops resend the same history).")
@click.option("--max-pixels", type=click.IntRange(1), default=None,
              help="Image-text engines: the most pixels an image is resized to [default: the model's "
                   "preprocessor_config.json; Open-AutoGLM serves with 5000000].")
@click.option("--max-images", type=click.IntRange(0), default=None,
              help="Image-text engines: images per prompt [default: the engine's build config, 10 unless set].")
@click.option("--allowed-local-media-path", type=click.Path(path_type=Path, file_okay=False, exists=True),
              default=None, help="Image-text engines: the directory file:// image URLs may point into "
                                 "[default: none; images come as data: URLs, http(s) URLs are never fetched].")
@click.option("--max-body-bytes", type=click.IntRange(1024), default=None,
              help="Larger request bodies get 413 before they are parsed [default: 8 MiB for a text engine; for an "
                   "image-text engine, max-images of the largest PNG (8-bit RGBA, uncompressed) of max-pixels "
                   "pixels as base64 data: URLs, and 1 MiB of text: 10 of 5,000,000 pixels make 268 MB; "
                   "`autoglm-trt doctor ENGINE` says the engine's].")
@click.option("--max-image-memory", type=click.IntRange(1), default=None,
              help="Image-text engines: bytes of image embeddings the requests in flight may hold (each keeps its "
                   "images' until it ends); a request past it gets 429, unless it is alone [default: a quarter "
                   "of the host's memory].")
@click.option("--client-timeout", type=click.FloatRange(min=0, min_open=True), default=CLIENT_TIMEOUT_S, show_default=True,
              help="Seconds a client may pause sending its request's body (then 408) or reading its answer "
                   "(then its request is cancelled and its connection dropped).")
@click.option("--max-client-priority", type=click.IntRange(-(2**31), 2**31), default=0, show_default=True,
              help="The most urgent 'priority' a client may ask for (lower runs first): 0 lets clients only "
                   "lower their own; a request asking for more gets 400.")
def serve_cmd(engine_dir: Path, host: str, port: int, api_key: str | None, served_model_name: str | None,
              max_waiting: int, request_timeout: float | None, drain_seconds: float, threads: int,
              spinning: bool, prefix_caching: bool, max_pixels: int | None, max_images: int | None,
              allowed_local_media_path: Path | None, max_body_bytes: int | None, max_image_memory: int | None,
              client_timeout: float, max_client_priority: int) -> None:
    """Serve ENGINE_DIR over HTTP with the OpenAI API (completions, chat, streaming), /health and /metrics."""
    from ..errors import require

    require("fastapi", "autoglm-trt[serve]", "autoglm-trt serve")
    from ..runtime import ImageOptions
    from ..serve.app import ServeConfig
    from ..serve.server import serve

    cfg = ServeConfig(served_model_name or Path(engine_dir).resolve().name, api_key or None, max_waiting,
                      request_timeout, drain_seconds, prefix_caching,
                      ImageOptions(max_pixels, max_images, allowed_local_media_path), max_body_bytes,
                      max_client_priority, client_timeout, max_image_memory)
    serve(engine_dir, host, port, cfg, threads, log=_log, spinning=spinning)
