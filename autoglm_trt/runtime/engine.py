"""``Engine``: load an engine directory and generate, from many threads at once.

    from autoglm_trt.runtime import Engine, SamplingParams
    engine = Engine.load("engines/smollm2-int8")
    [result] = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=16))
    for piece in engine.stream([{"role": "user", "content": "Hi!"}]): print(piece, end="")

One scheduler loop thread owns the sequences and the KV pool; ``generate``/``stream`` submit
requests under a lock and wait on their own events, so any number of caller threads can
share an engine. Prompts are text, chat messages (the checkpoint's chat template) or token
ids. The engine's manifest is checked (file hashes, backend, TensorRT version and GPU) before
anything is loaded.

Liveness: a failure while running a step fails that step's requests; a failure while
sampling or matching stop strings fails that request alone; the loop thread itself never
dies of a request. A step's inputs are made under the lock, so a request cancelled from
another thread while the model runs (its blocks freed) changes nothing the step reads.
``close`` fails every waiting and running request with a ``RequestError`` ("the engine was
closed") and returns when the loop has ended. A request with a ``timeout`` ends with finish
reason ``"timeout"`` (and the text so far) once its deadline passes, checked by the loop
between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Seq
from pathlib import Path

import numpy as np

from ..artifacts import EngineError, Manifest
from ..backends import StepRunner, check_engine, open_runner
from ..backends.onnxrt.session import MAX_THREADS
from ..backends.registry import backend as backend_named
from ..errors import RequestError
from ..fileutil import available_memory_bytes
from ..kvcache.block_pool import BlockPool
from ..kvcache.step_inputs import SlotMap, StepImages, step_inputs
from ..model.tokenizer import IncrementalDecoder, TextTokenizer
from .groups import BeamGroup, fork_samples
from .guided import Grammars, Guide
from .images import ImageOptions, PreparedPrompt, image_options, image_pipeline
from .kv_cache_manager import KVCacheManager
from .penalties import adjust, token_logprobs
from .registry import Registry
from .request import (
    Choice,
    GenerationResult,
    Prompt,
    PromptEncoder,
    Request,
    RequestLimits,
    Sink,
    TokenLogprob,
    split_prompts,
)
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import Sequence, Step
from .threads import start_thread

log = logging.getLogger(__name__)
__all__ = ["Choice", "Engine", "GenerationResult", "Guide", "ImageOptions", "Prompt", "RequestError"]


class Engine:
    def __init__(self, manifest: Manifest, backend: StepRunner, tokenizer: TextTokenizer | None,
                 prefix_caching: bool = True, images: ImageOptions | None = None):
        self.dir, self.manifest, self.backend, self.tokenizer = manifest.dir, manifest, backend, tokenizer
        self.spec = manifest.spec
        limits = manifest.limits
        self.max_batch, self.max_input_len, self.max_seq_len = (limits.max_batch_size, limits.max_input_len,
                                                                limits.max_seq_len)
        self.block_size = backend.block_size
        self.allocator = BlockPool(backend.num_blocks, caching=prefix_caching)
        self.kv = KVCacheManager(self.allocator, self.block_size)
        self.scheduler = Scheduler(self.kv, self.max_batch, self.max_input_len)
        options = image_options(manifest, images or ImageOptions())
        self.images = image_pipeline(manifest, self.block_size, options) if self.spec.vision else None
        self.prompts = PromptEncoder(tokenizer, self.spec.vocab_size, self.max_seq_len - 1,
                                     options.rules if self.spec.vision else None)
        self.limits = RequestLimits(self.max_seq_len, self.max_batch, self.block_size, self.allocator.num_blocks,
                                    tokenizer is not None, str(self.dir), self.spec.vocab_size)
        self.eos = set(self.spec.eos_token_ids)
        self.grammars = Grammars(self.dir / "tokenizer.json", self.spec.vocab_size, list(self.spec.eos_token_ids))
        self.requests = Registry(self.scheduler)
        self._cv = threading.Condition()
        self.longest_hold_s = 0.0  # the longest the loop held its lock in one go: scheduling, or sampling a step
        self._closed = False
        self._thread = start_thread(self._loop, "autoglm-scheduler")  # grammars' masks recurse as deep as they are

    # -- loading -----------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, verify: bool = True, num_blocks: int | None = None,
             kv_memory_bytes: int | None = None, threads: int = 0, prefix_caching: bool = True,
             images: ImageOptions | None = None, spinning: bool = True) -> Engine:
        """Load an engine directory made by ``autoglm-trt build``.

        Args:
            path: the engine directory.
            verify: re-hash the engine's files against its manifest (refuses a corrupt engine).
            num_blocks / kv_memory_bytes: override the KV pool size (ONNX Runtime engines only).
            threads: ONNX Runtime intra-op threads (0: one per core; at most 256).
            prefix_caching: share the KV blocks of prompts' common prefixes (on by default).
            images: an image-text engine's image limits and encoder cache (``ImageOptions``).
            spinning: whether the decoder's ONNX Runtime threads spin between operators waiting for
                work (ONNX Runtime's default) or block. An image is encoded on the caller's thread
                beside the decoder's steps, and spinning threads take cores the encoder works on:
                blocking helps where decoding, not prefill, overlaps encodes (``docs/runtime.md``).
        """
        manifest, backend, tokenizer = _open_parts(Path(path), verify, num_blocks, kv_memory_bytes, threads, spinning)
        if images is not None and images.threads is None:
            images = dataclasses.replace(images, threads=threads or None)
        return cls(manifest, backend, tokenizer, prefix_caching, images)

    # -- requests ----------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (``RequestError`` if it is malformed); an image part is its chat
        template's one placeholder here (``prepare`` expands it to the image's tokens)."""
        return self.prompts.encode(prompt)

    def prepare(self, prompt: Prompt, images: Seq[object] | None = None, tools: list[dict] | None = None,
                cancel: threading.Event | None = None, reserve: Callable[[int], None] | None = None) -> PreparedPrompt:
        """A prompt made ready to submit: tokenized, its images (an image-text engine's) decoded, preprocessed and
        encoded (``RequestError`` if it is malformed or could not fit with one new token; ``len(prepared.ids)``).

        ``images``: for a text or token-id prompt that holds the image placeholders itself (GLM-4.1V:
        ``<|begin_of_image|><|image|><|end_of_image|>`` per image), the images in order (PIL images,
        bytes, paths or ``data:`` URLs); chat messages carry theirs as parts instead. ``tools``: OpenAI's
        tool definitions, for a chat template that describes them to the model. ``cancel``: set it (from
        another thread) to give up (a ``RequestError`` at its next wait or image). ``reserve``: called with
        the bytes the images' embeddings will take, before any is decoded (it raises to refuse)."""
        one = SamplingParams(max_new_tokens=1)
        return self._prepared(prompt, lambda ids: self.limits.check(ids, one, False, False), images, tools, cancel, reserve)

    def _prepared(self, prompt: object, check: Callable[[list[int]], None], images: Seq[object] | None = None,
                  tools: list[dict] | None = None, cancel: threading.Event | None = None,
                  reserve: Callable[[int], None] | None = None) -> PreparedPrompt:
        ids, sources = self.prompts.encode_with_images(prompt, tools)
        if images:
            if sources:
                raise RequestError("the messages carry images as parts: pass images= only with a text or token-id "
                                   "prompt that holds the placeholders")
            sources = self.prompts.extra_images(images)
        if not sources:
            placeholders = ids.count(self.images.vision.image_token_id) if self.images is not None else 0
            if placeholders:
                raise RequestError(f"the prompt has {placeholders} image placeholder(s) but no image came with it")
            check(ids)
            return PreparedPrompt(ids)
        assert self.images is not None  # the prompt encoder refuses images for a text model
        return self.images.prepare(ids, sources, check, cancel, reserve)

    def submit(self, prompt: Prompt | PreparedPrompt, params: SamplingParams, sink: Sink | None = None,
               timeout: float | None = None) -> Request:
        """Queue one request without waiting: its pieces go to ``sink`` (if given) as they are made
        (with ``n`` > 1 the first sample's; a beam search sends none), then None when it ends.

        For callers that wait their own way (an event loop): ``outcome(request)`` once
        ``request.done`` is set, ``cancel(request)`` to stop it. ``RequestError`` if the request
        is malformed or cannot fit.
        """
        return self._submit(prompt, params, sink if sink is not None else False, timeout)

    def outcome(self, req: Request) -> GenerationResult:
        """The result of a finished request (waits for it), or its ``RequestError``."""
        return self._result(req)

    def cancel(self, req: Request) -> None:
        """Stop a request and free its blocks now; its outcome is finish reason "cancelled"."""
        self._cancel(req)

    def _submit(self, prompt: object, params: object, stream: bool | Sink, timeout: float | None) -> Request:
        [req] = self._queue([self._prepare(prompt, params, stream, timeout)])
        return req

    def _prepare(self, prompt: object, params: object, stream: bool | Sink, timeout: float | None) -> Request:
        """A checked request, not yet queued (``RequestError`` if it is malformed or cannot fit)."""
        if self._closed:
            raise RequestError("the engine is closed")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if timeout is not None:
            params = dataclasses.replace(params, timeout=timeout)
        pieces, streaming = stream is not False, stream is True
        check = lambda ids: self.limits.check(ids, params, pieces, streaming)  # noqa: E731
        if isinstance(prompt, PreparedPrompt):  # prepared for one new token: checked for these params now
            made = prompt
            check(made.ids)
        else:
            made = self._prepared(prompt, check)
        # compiled on the grammar workers (this thread waits): a malformed guide is refused before the queue
        guided = self.grammars.state(params.guide) if params.guide is not None else None
        seq = Sequence(made.ids, params, block_extras=made.block_extras, mrope=made.mrope, images=made.images)
        seq.guided = guided
        beam = params.beam_width > 1
        req = Request(seq, IncrementalDecoder(self.tokenizer) if self.tokenizer and not beam else None, stream,
                      params.timeout)
        if beam:
            req.beam = BeamGroup(seq, [] if params.ignore_eos else sorted(self.eos))
        return req

    def _queue(self, reqs: list[Request]) -> list[Request]:
        """Queue requests at once: the loop sees all or none of them (a batch's prompts are
        prefilled in the same step, not the first alone because the loop woke before the rest came)."""
        with self._cv:
            if self._closed:
                raise RequestError("the engine is closed")
            for req in reqs:
                self.scheduler.add(req.seq)
                self.requests.add(req.seq, req)
            self._cv.notify()
        return reqs

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None,
                 timeout: float | None = None) -> list[GenerationResult]:
        """Generate for each prompt (a single prompt is a list of one); results in prompt order.
        Every prompt is checked before any is queued (a ``RequestError`` queues none), and all
        are queued together.

        ``timeout`` (seconds, per request) overrides ``params.timeout``.
        """
        params = params or SamplingParams()
        reqs = self._queue([self._prepare(p, params, False, timeout) for p in split_prompts(prompts)])
        return [self._result(r) for r in reqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None,
               timeout: float | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are produced; closing the iterator cancels the request."""
        req = self._submit(prompt, params or SamplingParams(), True, timeout)
        assert isinstance(req.pieces, queue.Queue)
        try:
            while (piece := req.pieces.get()) is not None:
                yield piece
        finally:
            self._cancel(req)
        self._result(req)

    def _cancel(self, req: Request) -> None:
        with self._cv:
            self.requests.cancel(req)

    def _result(self, req: Request) -> GenerationResult:
        req.done.wait()
        for child in req.children:  # made before the first sample is taken, so before req can end
            child.done.wait()
        return req.result(self.tokenizer)

    # -- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.scheduler.has_work():
                    self._cv.wait()
                if self._closed:
                    return
                start = time.perf_counter()
                self._expire(start)
                try:
                    step = self.scheduler.schedule()
                except Exception as exc:  # noqa: BLE001 - a scheduler bug fails what is queued, not the engine
                    log.exception("scheduling failed")
                    step, error = None, exc
                else:
                    error = RuntimeError("the scheduler found no step to run")
                # the step's inputs are read from its sequences now, under the lock: a request cancelled while
                # the step runs frees its blocks (its table emptied), which must not change what this step reads
                inputs = self._inputs(step) if step is not None else None
                self._held(start)
                if step is None:
                    if self.scheduler.has_work():  # a scheduler bug: fail the stuck requests, keep serving
                        self._fail_all(RequestError(f"internal error: {error}"))
                    continue
                if inputs is None:
                    continue
            try:
                if step.copies:
                    self.backend.copy_blocks(step.copies)
                logits = self.backend.step(*inputs)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                log.exception("engine step failed")
                with self._cv:
                    for seq in step.seqs:
                        self.requests.fail_seq(seq, exc)
                continue
            with self._cv:
                start = time.perf_counter()
                self._after_step(step, logits)
                self._held(start)

    def _held(self, start: float) -> None:
        """The loop held its lock since ``start`` (under it): keep the longest such stretch."""
        self.longest_hold_s = max(self.longest_hold_s, time.perf_counter() - start)

    def _inputs(self, step: Step) -> tuple[dict[str, np.ndarray], SlotMap] | None:
        """The backend's feeds and KV slots for ``step`` (under the lock), or None when they cannot
        be made (the step's requests fail, not the engine)."""
        try:
            return step_inputs(step.new_tokens, [s.cache for s in step.seqs], self.block_size,
                               mrope=[s.mrope for s in step.seqs] if self.spec.mrope else None,
                               images=StepImages(self.spec.hidden_size, [s.images for s in step.seqs])
                               if self.spec.vision else None)
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
            log.exception("a step's inputs could not be made")
            for seq in step.seqs:
                self.requests.fail_seq(seq, exc)
            return None

    def _after_step(self, step: Step, logits: np.ndarray) -> None:
        now = time.perf_counter()
        for i, seq in enumerate(step.seqs):
            req = self.requests.get(seq)
            if seq.finish_reason is not None or req is None:
                continue  # cancelled, closed or failed while the step ran
            complete = step.completes(i)
            self.scheduler.computed(seq, len(step.new_tokens[i]))
            if not complete:
                continue
            try:
                self._advance(req, seq, logits[i], now)
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                self.requests.fail(req, exc)

    def _advance(self, req: Request, seq: Sequence, logits: np.ndarray, now: float) -> None:
        """A sequence's tokens are all computed: sample its next token, or hand its logits to its beam search."""
        if req.beam is not None:
            if req.beam.report(seq, logits):
                for gone in req.beam.advance(self.scheduler, lambda child: self.requests.add(child, req)):
                    self.requests.drop(gone)
                req.token_times.append(now)
                if req.beam.done:
                    self.requests.end(req, "length")
            return
        if seq.params.n > 1 and seq.stream == 0 and not req.children:  # the prompt is in: fork the other samples
            for child in fork_samples(self.scheduler, seq, seq.params.n):
                creq = req.spawn(child, IncrementalDecoder(self.tokenizer) if self.tokenizer else None)
                self.requests.add(child, creq)
                try:
                    self._sample(creq, logits, now)
                except Exception as exc:  # noqa: BLE001 - one sample's failure is its own
                    self.requests.fail(creq, exc)
        self._sample(req, logits, now)

    def _sample(self, req: Request, logits: np.ndarray, now: float) -> None:
        """Sample one token for a request's sequence and end it if it is done."""
        seq = req.seq
        p = seq.params
        ends: set[int] = set() if p.ignore_eos else self.eos  # the tokens that end it
        if p.stop_token_ids:
            ends = ends | set(p.stop_token_ids)
        used = adjust(logits, p, seq.counts, ends) if p.adjusts_logits else logits
        if seq.guided is not None:  # made with the request (or copied with its fork), never on this thread
            masked = seq.guided.masked(used, in_place=p.adjusts_logits)  # adjust() made a copy already
            if seq.counts.generated < p.min_tokens and not np.isfinite(masked).any():  # only its end: it wins
                masked = seq.guided.masked(adjust(logits, p, seq.counts, set()), in_place=True)
            used = masked
        token = sample(used, p, seq.rng)
        reason = None
        if token in ends:
            reason = "stop"
        else:
            if p.logprobs is not None:  # before the text goes out, so a sink sees its token's entry
                req.logprobs.append(TokenLogprob(token, *token_logprobs(used, token, p.logprobs)))
            seq.output_ids.append(token)
            seq.counts.add(token)
            if seq.guided is not None and seq.guided.accept(token):
                reason = "stop"
            req.token_times.append(now)
            if req.decoder is not None:
                reason = req.add_text(req.decoder.add(token)) or reason
        if reason is None and (len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_seq_len):
            reason = "length"
        if reason is not None:
            self.requests.end(req, reason)

    def _expire(self, now: float) -> None:
        for req in [r for r in self.requests.live() if r.deadline is not None and now >= r.deadline]:
            self.requests.end(req, "timeout")

    def _fail_all(self, exc: BaseException) -> None:
        for req in self.requests.live():
            self.requests.fail(req, exc)

    # -- state -----------------------------------------------------------------
    def stats(self) -> dict:
        with self._cv:
            return {"free_blocks": self.allocator.num_free, "num_blocks": self.allocator.num_blocks,
                    "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                    "preemptions": self.scheduler.preemptions, "longest_hold_s": self.longest_hold_s,
                    **self.kv.stats(),
                    **(self.images.stats() if self.images is not None else {})}

    @property
    def alive(self) -> bool:
        """Whether the loop thread is serving (false once closed)."""
        return self._thread.is_alive() and not self._closed

    def close(self) -> None:
        """Fail every waiting and running request, stop the loop, free the backend."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._fail_all(RequestError("the engine was closed while this request was waiting or running"))
            self._cv.notify_all()
        self._thread.join(timeout=60)
        self.grammars.close()
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_parts(path: Path, verify: bool, num_blocks: int | None, kv_memory_bytes: int | None,
               threads: int, spinning: bool = True) -> tuple[Manifest, StepRunner, TextTokenizer | None]:
    """The checked manifest, a runner for its backend, its tokenizer. The KV pool may be resized for
    ONNX Runtime engines; a pool larger than the memory available here is refused before anything
    is allocated."""
    if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= MAX_THREADS:
        raise EngineError(f"threads must be an integer from 0 (one per core) to {MAX_THREADS}, got {threads!r}")
    if not isinstance(spinning, bool):
        raise EngineError(f"spinning must be True or False, got {spinning!r}")
    manifest = check_engine(path, verify_hashes=verify)
    kv = manifest.kv
    per_block = kv.bytes // kv.num_blocks
    blocks = kv.num_blocks
    runs = backend_named(manifest.backend)
    in_host_memory = runs.traits.host_memory
    if num_blocks is not None or kv_memory_bytes is not None:
        if not in_host_memory:
            raise EngineError(f"the KV pool of a {runs.label} engine is fixed at build time; rebuild to change it")
        blocks = num_blocks if num_blocks is not None else max(1, int(kv_memory_bytes or 0) // per_block)
    if in_host_memory:
        pool = blocks * per_block
        have = available_memory_bytes()
        if have is not None and pool > have:
            raise EngineError(f"the KV pool of {blocks} blocks would take {pool / 2**30:.1f} GiB but this machine "
                              f"has {have / 2**30:.1f} GiB available; load with fewer blocks (num_blocks=...)")
    backend = open_runner(manifest, blocks, threads, spinning)
    tokenizer = TextTokenizer(path) if (path / "tokenizer.json").is_file() else None
    return manifest, backend, tokenizer
