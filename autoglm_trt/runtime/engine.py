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
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..arch import spec_from_dict
from ..build.manifest import EngineError, check_engine
from ..errors import AutoGLMError
from ..paged_kv import BlockAllocator, blocks_needed, step_inputs
from .backend import OrtBackend, StepBackend
from .sampling import SamplingParams, sample
from .scheduler import Scheduler, Sequence, Step
from .tokenizer import IncrementalDecoder, TextTokenizer

Prompt = str | list[dict] | list[int]


class RequestError(AutoGLMError):
    """A request the engine cannot serve as asked."""


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    token_times: list[float] = field(default_factory=list, repr=False)  # perf_counter at each token
    submitted: float = 0.0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.submitted if self.token_times else float("nan")


class _Request:
    def __init__(self, seq: Sequence, decoder: IncrementalDecoder | None, stream: bool):
        self.seq = seq
        self.decoder = decoder
        self.text = ""
        self.done = threading.Event()
        self.pieces: queue.Queue[str | None] | None = queue.Queue() if stream else None
        self.error: BaseException | None = None
        self.token_times: list[float] = []
        self.submitted = time.perf_counter()


class Engine:
    def __init__(self, engine_dir: Path, manifest: dict, backend: StepBackend, tokenizer: TextTokenizer | None):
        self.dir, self.manifest, self.backend, self.tokenizer = engine_dir, manifest, backend, tokenizer
        self.spec = spec_from_dict(manifest["spec"])
        limits = manifest["limits"]
        self.max_batch, self.max_input_len, self.max_seq_len = (limits["max_batch_size"], limits["max_input_len"],
                                                                limits["max_seq_len"])
        self.block_size = backend.block_size
        self.allocator = BlockAllocator(backend.num_blocks)
        self.scheduler = Scheduler(self.allocator, self.block_size, self.max_batch, self.max_input_len)
        self.eos = set(self.spec.eos_token_ids)
        self._requests: dict[int, _Request] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="autoglm-scheduler", daemon=True)
        self._thread.start()

    # -- loading -----------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, verify: bool = True, num_blocks: int | None = None,
             kv_memory_bytes: int | None = None, threads: int = 0) -> Engine:
        """Load an engine directory made by ``autoglm-trt build``.

        Args:
            path: the engine directory.
            verify: re-hash the engine's files against its manifest (refuses a corrupt engine).
            num_blocks / kv_memory_bytes: override the KV pool size (ONNX Runtime engines only).
            threads: ONNX Runtime intra-op threads (0: all cores).
        """
        path = Path(path)
        manifest = check_engine(path, verify_hashes=verify)
        spec = spec_from_dict(manifest["spec"])
        kv = manifest["kv_cache"]
        blocks = kv["num_blocks"]
        if num_blocks is not None or kv_memory_bytes is not None:
            if manifest["backend"] != "onnxruntime":
                raise EngineError("the KV pool of a TensorRT engine is fixed at build time; rebuild to change it")
            per_block = kv["bytes"] // kv["num_blocks"]
            blocks = num_blocks if num_blocks is not None else max(1, int(kv_memory_bytes or 0) // per_block)
        backend: StepBackend
        if manifest["backend"] == "onnxruntime":
            backend = OrtBackend(path / manifest["engine_file"], spec, blocks, kv["block_size"], kv["dtype"], threads)
        else:
            from .trt_backend import TrtBackend

            backend = TrtBackend(path / manifest["engine_file"], spec, blocks, kv["block_size"], kv["dtype"],
                                 manifest["limits"]["max_batch_size"], manifest["limits"]["max_input_len"])
        tokenizer = TextTokenizer(path) if (path / "tokenizer.json").is_file() else None
        return cls(path, manifest, backend, tokenizer)

    # -- requests ----------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self._tok().encode(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._tok().apply_chat_template(prompt)  # type: ignore[arg-type]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int | np.integer) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise RequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        else:
            raise RequestError("a prompt is a string, a non-empty list of chat messages ({'role', 'content'}) "
                               "or a non-empty list of token ids")
        if not ids:
            raise RequestError("the prompt is empty after tokenization")
        return ids

    def _tok(self) -> TextTokenizer:
        if self.tokenizer is None:
            raise RequestError(f"{self.dir} has no tokenizer; pass token ids")
        return self.tokenizer

    def _check(self, ids: list[int], params: SamplingParams) -> None:
        if len(ids) > self.max_input_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; this engine allows at most {self.max_input_len} "
                               "(max_input_len); shorten it or rebuild with a larger --max-input-len")
        if len(ids) + params.max_new_tokens > self.max_seq_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                               f"engine's max_seq_len {self.max_seq_len}; lower max_new_tokens")
        if blocks_needed(len(ids) + params.max_new_tokens, self.block_size) > self.allocator.num_blocks:
            raise RequestError(f"this request needs more KV blocks than the whole pool ({self.allocator.num_blocks})")

    def _submit(self, prompt: Prompt, params: SamplingParams, stream: bool) -> _Request:
        if self._closed:
            raise RequestError("the engine is closed")
        ids = self.encode(prompt)
        self._check(ids, params)
        seq = Sequence(ids, params)
        if (stream or params.stop) and self.tokenizer is None:
            raise RequestError(f"{self.dir} has no tokenizer: streaming text and stop strings need one")
        req = _Request(seq, IncrementalDecoder(self.tokenizer) if self.tokenizer else None, stream)
        with self._cv:
            self._requests[seq.seq_id] = req
            self.scheduler.add(seq)
            self._cv.notify()
        return req

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | None = None) -> list[GenerationResult]:
        """Generate for each prompt (a single prompt is a list of one); results in prompt order."""
        params = params or SamplingParams()
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts)
                                              and not isinstance(prompts[0], str | list))
        batch: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item, arg-type]
        reqs = [self._submit(p, params, stream=False) for p in batch]
        return [self._result(r) for r in reqs]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as tokens are produced."""
        req = self._submit(prompt, params or SamplingParams(), stream=True)
        assert req.pieces is not None
        try:
            while True:
                piece = req.pieces.get()
                if piece is None:
                    break
                yield piece
        finally:
            if not req.done.is_set():
                with self._cv:
                    self.scheduler.cancel(req.seq)
                    self._finish_request(req)
        self._result(req)

    def _result(self, req: _Request) -> GenerationResult:
        req.done.wait()
        if req.error is not None:
            raise RequestError(f"generation failed: {req.error}") from req.error
        seq = req.seq
        text = req.text
        return GenerationResult(text, list(seq.output_ids), seq.finish_reason or "cancelled", len(seq.prompt_ids),
                                req.token_times, req.submitted)

    # -- the loop ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self.scheduler.has_work():
                    self._cv.wait()
                if self._closed:
                    return
                step = self.scheduler.schedule()
            if step is None:  # nothing can run now (should not happen: a lone sequence always fits)
                time.sleep(0.001)
                continue
            try:
                logits = self._run(step)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the engine
                with self._cv:
                    for seq in step.seqs:
                        self.scheduler.finish(seq, "error")
                        req = self._requests.get(seq.seq_id)
                        if req:
                            req.error = exc
                            self._finish_request(req)
                continue
            with self._cv:
                self._after_step(step, logits)

    def _run(self, step: Step) -> np.ndarray:
        feeds, slots = step_inputs(step.new_tokens, [s.cache for s in step.seqs], self.block_size)
        return self.backend.step(feeds, slots)

    def _after_step(self, step: Step, logits: np.ndarray) -> None:
        now = time.perf_counter()
        for i, seq in enumerate(step.seqs):
            complete = step.completes(i)
            seq.cache.num_computed_tokens += len(step.new_tokens[i])
            if not complete or seq.finish_reason is not None:
                continue
            req = self._requests[seq.seq_id]
            token = sample(logits[i], seq.params, seq.rng)
            reason = None
            if token in self.eos and not seq.params.ignore_eos:
                reason = "stop"
            else:
                seq.output_ids.append(token)
                req.token_times.append(now)
                if req.decoder is not None:
                    piece = req.decoder.add(token)
                    reason = self._emit(req, piece)
            if reason is None and (len(seq.output_ids) >= seq.params.max_new_tokens or seq.num_tokens >= self.max_seq_len):
                reason = "length"
            if reason is not None:
                if req.decoder is not None and reason != "stop":
                    reason = self._emit(req, req.decoder.flush()) or reason
                self.scheduler.finish(seq, reason)
                self._finish_request(req)

    def _emit(self, req: _Request, piece: str) -> str | None:
        """Append a text piece, cut at a stop string; return "stop" when one was hit."""
        text = req.text + piece
        for s in req.seq.params.stop:
            k = text.find(s)
            if k >= 0:
                piece = text[len(req.text):k] if k >= len(req.text) else ""
                req.text = text[:k]
                if req.pieces is not None and piece:
                    req.pieces.put(piece)
                return "stop"
        req.text = text
        if req.pieces is not None and piece:
            req.pieces.put(piece)
        return None

    def _finish_request(self, req: _Request) -> None:
        self._requests.pop(req.seq.seq_id, None)
        if req.pieces is not None:
            req.pieces.put(None)
        req.done.set()

    # -- state -----------------------------------------------------------------
    def stats(self) -> dict:
        with self._cv:
            return {"free_blocks": self.allocator.num_free, "num_blocks": self.allocator.num_blocks,
                    "waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                    "preemptions": self.scheduler.preemptions}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=10)
        self.backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
