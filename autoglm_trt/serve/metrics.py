"""Prometheus metrics of one server: engine state read at scrape time, request counters and
latency histograms observed as requests finish (``prometheus-client``, a registry per app).

Names follow Prometheus conventions with the ``autoglm_`` namespace: counters end in
``_total``, durations are ``_seconds`` histograms.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict]):
        self.stats = stats

    def collect(self) -> Iterator:
        s = self.stats()
        yield GaugeMetricFamily("autoglm_requests_running", "Requests with KV blocks, being computed", s["running"])
        yield GaugeMetricFamily("autoglm_requests_waiting", "Requests queued for admission", s["waiting"])
        yield GaugeMetricFamily("autoglm_requests_preparing", "Requests whose images wait for a thread, are "
                                "decoded, wait for the encoder or are encoded", s.get("images_preparing", 0))
        yield GaugeMetricFamily("autoglm_kv_blocks_used", "KV cache blocks in use", s["num_blocks"] - s["free_blocks"])
        yield GaugeMetricFamily("autoglm_kv_blocks_total", "KV cache blocks in the pool", s["num_blocks"])
        yield CounterMetricFamily("autoglm_preemptions", "Sequences preempted for want of KV blocks",
                                  s["preemptions"])
        yield CounterMetricFamily("autoglm_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                  s.get("prefix_queried_tokens", 0))
        yield CounterMetricFamily("autoglm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  s.get("prefix_hit_tokens", 0))
        yield GaugeMetricFamily("autoglm_kv_blocks_cached", "Free KV blocks that still hold a cached prefix",
                                s.get("evictable_blocks", 0))
        yield GaugeMetricFamily("autoglm_loop_longest_hold_seconds", "The longest the engine's loop has held its lock "
                                "in one go (scheduling a step, or sampling one: penalties, grammars, stop strings)",
                                s.get("longest_hold_s", 0.0))


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, CPU seconds, open files
        r = self.registry
        self.prompt_tokens = Counter("autoglm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("autoglm_generation_tokens", "Generated tokens", registry=r)
        self.finished = Counter("autoglm_requests_finished", "Finished requests by finish reason", ["finish_reason"],
                                registry=r)
        self.rejected = Counter("autoglm_requests_rejected", "Requests answered with an error, by HTTP status",
                                ["status"], registry=r)
        self.ttft = Histogram("autoglm_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("autoglm_inter_token_latency_seconds", "Time between tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("autoglm_e2e_request_latency_seconds", "Submission to last token",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.phases = Histogram("autoglm_request_phase_seconds", "Where a request's time to its first token went: "
                                "read (headers to the parsed body), images_wait (a worker, a decode slot, the chat "
                                "template), decode (base64 and image), preprocess, encoder_wait, encode, "
                                "queue_prefill (submitted to first token); ttft (headers to first token)", ["phase"],
                                buckets=LATENCY_BUCKETS, registry=r)

    def observe(self, finish_reason: str, prompt_tokens: int, token_times: list[float], submitted: float,
                ended: float, phases: dict[str, float] | None = None, arrived: float | None = None) -> None:
        """A finished request; ``phases``: the seconds of its phases before submission, and
        ``arrived``: when its headers came (``autoglm_request_phase_seconds``)."""
        self.finished.labels(finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(len(token_times))
        if token_times:
            self.ttft.observe(token_times[0] - submitted)
            if phases is not None and arrived is not None:
                for phase, seconds in {**phases, "queue_prefill": token_times[0] - submitted,
                                       "ttft": token_times[0] - arrived}.items():
                    self.phases.labels(phase).observe(max(seconds, 0.0))
            for a, b in zip(token_times, token_times[1:]):
                self.itl.observe(b - a)
        self.e2e.observe(ended - submitted)
