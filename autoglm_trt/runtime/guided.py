"""Structured output: generation held to a JSON schema, a regex, a list of choices or a Lark
grammar, with llguidance (the grammar engine TensorRT-LLM and vLLM use; Rust, no dependencies).

``Guide`` says what the output must match (at most ``MAX_GUIDE_CHARS``). ``Grammars`` (one per
engine) compiles a guide into an llguidance matcher on worker threads of its own
(``GRAMMAR_WORKERS``, with deep stacks: ``runtime.threads``), never on the engine's loop or a
server's event loop: once per guide (the last ``GRAMMAR_CACHE`` are kept), within llguidance's
resource limits (``_limits``) and a time budget (``COMPILE_BUDGET_S`` of the worker's CPU time, so a
loaded machine does not make a guide too slow); a malformed guide, or one over a limit or the budget, is refused with a
``RequestError`` before the request is queued (one over the budget is remembered and refused at
once after), and a full queue of compilations with a ``BusyError``. Each request gets a copy of
the compiled matcher (``GuidedState``, with its first mask computed already); its further
samples copy the request's (``GuidedState.fork``). Per sequence the state masks the logits of
every token the grammar cannot take next, consumes each sampled token and says when the grammar
has ended; a grammar that passes a limit while generating, or whose mask for one token takes
more than ``MASK_BUDGET_S`` of CPU time, ends its request with a ``GuideError``. A grammar allows the
end-of-sequence tokens exactly where it may end.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from ..errors import BusyError, RequestError
from .threads import start_thread

GRAMMAR_CACHE = 8  # compiled matchers kept by guide (a large one holds tens of MB)
GRAMMAR_WORKERS = 2  # threads compiling guides
MAX_QUEUED_GRAMMARS = 8  # compilations waiting for a worker; past this a BusyError
COMPILE_BUDGET_S = 2.0  # a compilation's CPU time, at most (the largest guides taken need a fraction of it)
WAIT_FACTOR = 10  # a compilation's wall time, at most this many times the budget (a starved worker)
REFUSED_KEPT = 256  # guides refused for their time, remembered (by text) and refused at once
MASK_BUDGET_S = 0.1  # one token's mask's CPU time, at most (llguidance's limits keep one to a few ms)
STEP_MAX_ITEMS = 5_000  # Earley items per mask (llguidance's default, 50,000, lets an ambiguous grammar stall the loop)
KINDS = ("json_schema", "regex", "choice", "lark")
MAX_GUIDE_CHARS = 262_144


@dataclass(frozen=True)
class Guide:
    """What the output must match: ``kind`` one of ``KINDS`` and its text (a JSON schema as JSON,
    a regex, a JSON list of choices, a Lark grammar)."""

    kind: str
    text: str

    @classmethod
    def json_schema(cls, schema: dict | str) -> Guide:
        """Properties are generated in the schema's order (a "thought" before an "answer" stays first)."""
        try:
            return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
        except RecursionError:
            raise RequestError("the JSON schema is nested deeper than it can be read") from None

    @classmethod
    def json_object(cls) -> Guide:
        """Any JSON object (OpenAI's JSON mode)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def regex(cls, pattern: str) -> Guide:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> Guide:
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, grammar: str) -> Guide:
        return cls("lark", grammar)

    @classmethod
    def shipped(cls, name: str) -> Guide:
        """A Lark grammar shipped in ``autoglm_trt/grammars`` (``autoglm_action``: Open-AutoGLM's answers)."""
        return cls.lark(shipped_grammar(name))

    def check(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"a guide's kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text or len(self.text) > MAX_GUIDE_CHARS:
            raise RequestError(f"a {self.kind} guide needs a text of 1 to {MAX_GUIDE_CHARS} characters")

    def grammar(self) -> str:
        """llguidance's grammar for this guide (its errors surface when a matcher is made)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            try:  # compact JSON, as OpenAI's strict mode writes it: no free whitespace to wander in
                return LLMatcher.grammar_from_json_schema(self.text, defaults={"whitespace_flexible": False})
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not valid JSON: {exc}") from exc
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.text)
        if self.kind == "choice":
            choices = json.loads(self.text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise RequestError("a choice guide needs a non-empty list of non-empty strings")
            # one terminal (the lexer's), not a rule of as many alternatives (llguidance's parser takes 2,000)
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices))
        return LLMatcher.grammar_from_lark(self.text)


def shipped_grammar(name: str) -> str:
    """The text of ``autoglm_trt/grammars/<name>.lark``."""
    if not name.replace("_", "").isalnum():
        raise RequestError(f"a shipped grammar's name is letters, digits and underscores, got {name!r}")
    shipped = {p.name[:-5]: p for p in resources.files("autoglm_trt.grammars").iterdir() if p.name.endswith(".lark")}
    if name not in shipped:  # looked up among the files, never opened by a name a client made up
        shown = name if len(name) <= 64 else name[:64] + "..."
        raise RequestError(f"no shipped grammar named {shown!r}; shipped: {', '.join(sorted(shipped))}")
    return shipped[name].read_text(encoding="utf-8")


class GuideError(RequestError):
    """A request's guide failed while generating (llguidance hit one of its limits): the client's grammar."""


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.strip().splitlines()[0][:300] if error.strip() else "unknown error"


def _limits():
    """llguidance's limits for one matcher: its defaults (llguidance 1.x: 2,000 items in a row, 1,000,000
    initial lexer fuel, 200,000 per step (~14 ms)), at most ``STEP_MAX_ITEMS`` Earley items per mask,
    and the grammar's size held to twice the longest guide text."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_grammar_size=2 * MAX_GUIDE_CHARS, step_max_items=STEP_MAX_ITEMS)


def cpu_clock() -> Callable[[], float]:
    """The calling thread's CPU time in seconds, as a clock other threads can read too (a budget
    counts a grammar's own work, not the time other threads held the cores)."""
    if not hasattr(time, "pthread_getcpuclockid"):  # a platform without per-thread CPU clocks: the wall clock
        return time.monotonic
    clock = time.pthread_getcpuclockid(threading.get_ident())
    return lambda: time.clock_gettime(clock)


class Grammars:
    """The engine's grammar compiler: its tokenizer's token table for llguidance, its worker threads,
    and the matchers compiled from guides."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: list[int],
                 budget_s: float = COMPILE_BUDGET_S):
        self.path, self.vocab_size, self.eos_ids, self.budget_s = Path(tokenizer_json), vocab_size, eos_ids, budget_s
        self._tokenizer = None
        self._compiled: OrderedDict[Guide, GuidedState] = OrderedDict()  # guide -> its state before any token
        self._refused: OrderedDict[Guide, str] = OrderedDict()  # guides over the time budget -> why
        self._jobs: dict[Guide, Future] = {}  # compilations queued or running
        # each being compiled: its worker's CPU clock, its start on that clock, and when (time.monotonic())
        self._started: dict[Guide, tuple[Callable[[], float], float, float]] = {}
        self._queue: queue.Queue[tuple[Guide, Future] | None] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._lock = threading.Lock()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance import LLTokenizer

                if not self.path.is_file():
                    raise RequestError("structured output needs the engine's tokenizer.json, which it lacks")
                self._tokenizer = LLTokenizer(str(self.path), n_vocab=self.vocab_size, eos_token=self.eos_ids)
            return self._tokenizer

    def state(self, guide: Guide) -> GuidedState:
        """A fresh matcher for one request's guide (``RequestError`` if the guide is malformed, over
        llguidance's limits or over the time budget; ``BusyError`` if too many wait to compile).
        Blocks the calling thread while a worker compiles it: call it off any event loop."""
        guide.check()
        self.tokenizer()
        job: Future | None = None
        with self._lock:
            if guide in self._refused:
                raise RequestError(self._refused[guide])
            template = self._compiled.get(guide)
            if template is not None:
                self._compiled.move_to_end(guide)
            else:
                job = self._jobs.get(guide)
                if job is None:
                    if len(self._jobs) >= MAX_QUEUED_GRAMMARS + GRAMMAR_WORKERS:
                        raise BusyError(f"{len(self._jobs)} output guides are being compiled; retry shortly")
                    while len(self._workers) < GRAMMAR_WORKERS:
                        self._workers.append(start_thread(self._work, f"autoglm-grammar-{len(self._workers)}"))
                    job = self._jobs[guide] = Future()
                    self._queue.put((guide, job))
        if job is not None:
            template = self._wait(guide, job)
        assert template is not None
        return template.fork()

    def _wait(self, guide: Guide, job: Future) -> GuidedState:
        """The compiled state, once a worker is done; ``RequestError`` once it has worked on it for
        longer than the budget (it finishes in the background, within llguidance's limits, and is
        remembered as refused); ``BusyError`` if a worker got so little of the CPU that the budget's
        ``WAIT_FACTOR`` times went by (it is not the guide's fault: it is compiled meanwhile)."""
        while True:
            try:
                return job.result(timeout=0.05)
            except TimeoutError:
                with self._lock:  # the worker lets go of its entry under the lock: its clock is readable here
                    started = self._started.get(guide)
                    spent = None if started is None else (started[0]() - started[1], time.monotonic() - started[2])
                if spent is not None and spent[0] > self.budget_s:
                    raise RequestError(self._too_slow(guide)) from None
                if spent is not None and spent[1] > WAIT_FACTOR * self.budget_s:
                    raise BusyError(f"the {guide.kind} guide has waited {spent[1]:.0f} s for the busy grammar workers; "
                                    "retry shortly") from None

    def _too_slow(self, guide: Guide) -> str:
        return (f"the {guide.kind} guide took more than {self.budget_s:g} s of CPU time to compile; simplify it (fewer "
                "alternatives, a smaller schema)")

    def _work(self) -> None:
        """A worker: compile queued guides until ``close``."""
        while (item := self._queue.get()) is not None:
            guide, job = item
            try:
                job.set_result(self._compile(guide))
            except BaseException as exc:  # noqa: BLE001 - handed to the request that waits for it
                job.set_exception(exc)

    def _compile(self, guide: Guide) -> GuidedState:
        """The guide's state before any token, its first mask computed (which builds the lexer's first
        states); kept for the next requests if it took no longer than the budget, else remembered as
        refused."""
        from llguidance import LLMatcher

        try:
            clock = cpu_clock()
            with self._lock:
                self._started[guide] = clock, (start := clock()), time.monotonic()
            matcher = LLMatcher(self.tokenizer(), guide.grammar(), log_level=0, limits=_limits())
            state = GuidedState(matcher, self.vocab_size)
            if not matcher.is_error():
                state.fill()
            if matcher.is_error():
                raise RequestError(f"the {guide.kind} guide is not usable: {_first_line(matcher.get_error())}")
            with self._lock:
                if clock() - start <= self.budget_s:
                    self._compiled[guide] = state
                    while len(self._compiled) > GRAMMAR_CACHE:
                        self._compiled.popitem(last=False)
                else:
                    self._refused[guide] = self._too_slow(guide)
                    while len(self._refused) > REFUSED_KEPT:
                        self._refused.popitem(last=False)
            return state
        finally:
            with self._lock:
                self._jobs.pop(guide, None)
                self._started.pop(guide, None)

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)


class GuidedState:
    """One sequence's place in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as lln

        self.matcher, self.lln, self.vocab_size = matcher, lln, vocab_size
        self.mask = lln.allocate_token_bitmask(1, vocab_size)
        self._filled = False

    def fork(self) -> GuidedState:
        """A copy at the same place in the grammar (for a request, of the compiled state; for a further
        sample, of the request's), its mask copied rather than computed again."""
        out = GuidedState.__new__(GuidedState)
        out.matcher, out.lln, out.vocab_size = self.matcher.deep_copy(), self.lln, self.vocab_size
        out.mask, out._filled = self.mask.copy(), self._filled
        return out

    def fill(self) -> None:
        """Compute the mask of the tokens the grammar may take next (once per token consumed);
        ``GuideError`` if that took longer than ``MASK_BUDGET_S``."""
        if not self._filled:
            start = time.thread_time()
            self.lln.fill_next_token_bitmask(self.matcher, self.mask, 0)
            self._filled = True
            took = time.thread_time() - start
            if took > MASK_BUDGET_S:
                raise GuideError(f"the output guide took {took * 1000:.0f} ms of CPU time to decide the next token "
                                 f"(at most {MASK_BUDGET_S * 1000:.0f}); simplify it")

    def masked(self, logits: np.ndarray, in_place: bool = False) -> np.ndarray:
        """``logits`` (a float32 copy, or themselves with ``in_place``) with every token the grammar
        cannot take next at -inf."""
        self.fill()
        self._check()
        out = logits if in_place else np.array(logits, np.float32)
        self.lln.apply_token_bitmask_inplace(out[None], self.mask)
        return out

    def accept(self, token: int) -> bool:
        """Consume a sampled token; True when the grammar has ended (nothing more may follow)."""
        self.matcher.consume_token(token)
        self._filled = False
        self._check()
        return bool(self.matcher.is_stopped())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GuideError(f"the output guide failed while generating: {_first_line(self.matcher.get_error())}; "
                             "simplify it")
