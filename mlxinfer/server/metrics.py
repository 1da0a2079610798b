"""The server's Prometheus metrics, in a registry of their own (not the process's global one), so that
two apps in one process (the tests start several) count apart. Counters and histograms grow as
requests finish; the gauges are read from the scheduler's stats when /metrics is scraped."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..loop import FinishEvent


class ServerMetrics:
    def __init__(self, max_batch: int):
        self.max_batch = max_batch
        self.registry = r = CollectorRegistry()
        self.running = Gauge("mlxinfer_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("mlxinfer_requests_waiting", "Requests queued for the batch", registry=r)
        self.requests = Counter("mlxinfer_requests", "Requests finished, by finish reason", ["reason"], registry=r)
        self.prompt = Counter("mlxinfer_prompt_tokens", "Prompt tokens prefilled (not from the prefix cache)",
                              registry=r)
        self.cached = Counter("mlxinfer_prompt_tokens_cached", "Prompt tokens served from the prefix cache",
                              registry=r)
        self.generated = Counter("mlxinfer_generation_tokens", "Tokens generated (rate() gives tokens/s)",
                                 registry=r)
        self.ttft = Histogram("mlxinfer_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.itl = Histogram("mlxinfer_inter_token_latency_seconds", "Time between consecutive tokens of a request",
                             registry=r, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.slots = Gauge("mlxinfer_kv_slots_used", "KV cache slots held by running requests", registry=r)
        self.slots_free = Gauge("mlxinfer_kv_slots_free", "KV cache slots free (max_batch - used)", registry=r)
        self.kv_bytes = Gauge("mlxinfer_kv_cache_bytes", "Bytes the KV cache holds", registry=r)
        self.blocks = Gauge("mlxinfer_kv_blocks", "KV cache blocks (paged cache), by state: used by running "
                            "requests, cached for prefix reuse (evictable), free", ["state"], registry=r)

    def record(self, ev: FinishEvent, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a finished request; one that ended early (cancelled, its client gone, or failed) has no
        metrics and counts only by its reason."""
        self.requests.labels(ev.finish_reason).inc()
        if ev.metrics is None:
            return
        self.prompt.inc(prompt_tokens - cached_tokens)
        self.cached.inc(cached_tokens)
        self.generated.inc(len(ev.generation.token_ids))  # as the usage: not the end-of-generation token
        if ev.metrics.time_to_first_token_ms:
            self.ttft.observe(ev.metrics.time_to_first_token_ms / 1000)
        for iv in ev.metrics.token_intervals_ms:
            self.itl.observe(iv / 1000)

    def refresh(self, stats: dict) -> None:
        """Set the gauges from `Scheduler.stats()` (block counts only where the cache is paged)."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.slots.set(stats["slots_in_use"])
        self.slots_free.set(self.max_batch - stats["slots_in_use"])
        self.kv_bytes.set(stats["kv_bytes"])
        for state in ("used", "cached", "free"):
            if f"blocks_{state}" in stats:
                self.blocks.labels(state).set(stats[f"blocks_{state}"])

    def text(self) -> str:
        """The Prometheus exposition text of every collector."""
        return generate_latest(self.registry).decode()
