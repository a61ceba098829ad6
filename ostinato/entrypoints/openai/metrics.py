"""Prometheus metrics of the server: engine load, KV usage, latencies, token counts.

With several HTTP processes (`--api-server-count`), prometheus_client's multiprocess mode: each process
writes its values to files in one directory and /metrics sums them, whichever process answers. The gauges
of the engine's state are set by the first process only (the others keep 0), so their maximum is its value.
"""

import os
import tempfile

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ostinato.engine.async_client import RequestTiming

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"ostinato:{name}", doc, labels, registry=r, multiprocess_mode="max").labels(model_name)

        self.running = gauge("num_requests_running", "Requests holding a running slot in the engine")
        self.waiting = gauge("num_requests_waiting", "Requests queued in the engine")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache pages in use (0..1)")
        self.kv_free = gauge("kv_cache_free_pages", "Free KV-cache pages")
        self.kv_total = gauge("kv_cache_total_pages", "Usable KV-cache pages")
        self.slots_free = gauge("req_slots_free", "Free request slots of the engine")
        self.retractions = gauge("num_retractions", "Requests retracted (KV freed, recomputed later) so far")
        self.prefix_queries = Counter("ostinato:prefix_cache_queries", "Prompt tokens of admitted requests",
                                      labels, registry=r).labels(model_name)
        self.prefix_hits = Counter("ostinato:prefix_cache_hits", "Of those, tokens found in the prefix cache",
                                   labels, registry=r).labels(model_name)
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries since start (0..1)")
        self.prefix_evictable = gauge("prefix_cache_evictable_tokens",
                                      "Tokens held by the prefix cache and not in use (freed on demand)")
        self._prefix_counts = (0, 0)
        self.prompt_tokens = Counter("ostinato:prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("ostinato:generation_tokens", "Generated tokens of finished requests",
                                         labels, registry=r).labels(model_name)
        self.success = Counter("ostinato:request_success", "Finished requests by finish reason",
                               [*labels, "finished_reason"], registry=r)
        self.model_name = model_name
        # engine-side work, from the engine's cumulative counts: tells a slow engine from a slow front end
        steps = Counter("ostinato:engine_steps", "Forward passes by mode (extend / decode)", [*labels, "mode"],
                        registry=r)
        step_tokens = Counter("ostinato:engine_step_tokens", "Tokens computed by forward passes, by mode",
                              [*labels, "mode"], registry=r)
        step_seconds = Counter("ostinato:engine_step_seconds", "Wall time of forward passes (with sampling), by mode",
                               [*labels, "mode"], registry=r)
        # stats key -> its labelled counter (looked up once: labels() costs more than the increment)
        self._engine_counters = {f"{mode}_{key}": counter.labels(model_name, mode)
                                 for key, counter in (("steps", steps), ("tokens", step_tokens),
                                                      ("seconds", step_seconds))
                                 for mode in ("extend", "decode")}
        self._engine_counts: dict[str, float] = {}
        self.ttft = Histogram("ostinato:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("ostinato:time_per_output_token_seconds", "Mean time per output token after the first",
                              labels, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("ostinato:e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=E2E_BUCKETS, registry=r).labels(model_name)

    def on_stats(self, stats: dict[str, int | float]) -> None:
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        total = max(stats["kv_total_pages"], 1)
        self.kv_free.set(stats["kv_free_pages"])
        self.kv_total.set(stats["kv_total_pages"])
        self.kv_usage.set(1.0 - stats["kv_free_pages"] / total)
        self.slots_free.set(stats["req_slots_free"])
        self.retractions.set(stats["num_retractions"])
        queries, hits = stats.get("prefix_cache_queries", 0), stats.get("prefix_cache_hits", 0)
        if queries > self._prefix_counts[0]:
            self.prefix_queries.inc(queries - self._prefix_counts[0])
            self.prefix_hits.inc(hits - self._prefix_counts[1])
            self._prefix_counts = (queries, hits)
            self.prefix_hit_rate.set(hits / queries)
        self.prefix_evictable.set(stats.get("prefix_cache_evictable_tokens", 0))
        for key, counter in self._engine_counters.items():
            delta = stats[key] - self._engine_counts.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            self._engine_counts[key] = stats[key]

    def on_finished(self, t: RequestTiming) -> None:
        self.prompt_tokens.inc(t.num_prompt_tokens)
        self.generation_tokens.inc(t.num_tokens)
        self.success.labels(self.model_name, t.finish_reason or "unknown").inc()
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.finished is not None:
                self.e2e.observe(t.finished - t.arrival)
                if t.num_tokens > 1:
                    self.tpot.observe((t.finished - t.first_token) / (t.num_tokens - 1))

    def render(self) -> bytes:
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)


def enable_multiprocess_metrics() -> str:
    """Switch this process (and the processes it spawns after) to multiprocess metrics in a fresh directory,
    before any metric is made; returns the directory (the caller removes it)."""
    from prometheus_client import values

    path = tempfile.mkdtemp(prefix="ostinato-metrics-")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    values.ValueClass = values.MultiProcessValue()
    return path
