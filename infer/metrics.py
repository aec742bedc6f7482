"""The engine's Prometheus metrics (one registry per engine, so several engines can coexist in tests)."""
from __future__ import annotations

from bisect import bisect_left

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queued_requests = Gauge("rwkv_queued_requests", "Requests waiting for a state slot", registry=r)
        self.running_rows = Gauge("rwkv_running_rows", "Rows holding a state slot", registry=r)
        self.free_slots = Gauge("rwkv_free_slots", "State slots not in use", registry=r)
        self.prompt_tokens = Counter("rwkv_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generated_tokens = Counter("rwkv_generated_tokens", "Tokens sampled", registry=r)
        self.finished_rows = Counter("rwkv_finished_rows", "Rows finished, by reason", ["reason"], registry=r)
        self.rejected_requests = Counter("rwkv_rejected_requests", "Requests refused because the queue was full",
                                         registry=r)
        self.time_to_first_token = Histogram("rwkv_time_to_first_token_seconds", "Submit to first sampled token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("rwkv_inter_token_latency_seconds", "Time between a row's tokens",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.step_rows = Histogram("rwkv_step_batch_rows", "Rows in one engine step", buckets=BATCH_BUCKETS,
                                   registry=r)
        self.steps_ahead = Counter("rwkv_decode_steps_ahead", "Decode steps queued before the previous step's "
                                   "tokens were read (--decode-ahead)", registry=r)
        self.step_seconds = Histogram("rwkv_step_seconds", "Duration of one engine step", buckets=LATENCY_BUCKETS,
                                      registry=r)


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """``histogram.observe(value)`` ``count`` times, with two locked increments instead of 2 * count
    (the engine observes one inter-token gap per row and step; the rows of a step share it)."""
    buckets, bounds, total = (getattr(histogram, name, None) for name in ("_buckets", "_upper_bounds", "_sum"))
    if count == 1 or buckets is None or bounds is None or total is None or histogram._labelnames:
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)
