"""Prometheus metrics under the names vLLM's dashboards read (``vllm:...``), on the server's own registry.

Every series carries ``model_name`` and ``engine`` (the engine-core index, data parallel). Engine gauges and the
prefix-cache counters are read from each engine's latest scheduler stats at scrape time; an engine that is dead
or restarting reports nothing but ``kestrel_engine_alive 0``. Request latencies are measured in the frontend
(AsyncEngine calls the on_* hooks). docs/serving.md lists the metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LABELS = ["model_name", "engine"]

# name, help, SchedulerStats field (gauges; per live engine)
_GAUGES = [
    ("vllm:num_requests_running", "Number of requests in model execution batches.", "num_running"),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", "kv_usage"),
    ("kestrel_kv_blocks_free", "Free KV-cache blocks.", "num_free_kv_blocks"),
    ("kestrel_kv_blocks_total", "KV-cache blocks in the pool.", "num_kv_blocks"),
]
# name (without _total), help, SchedulerStats field (cumulative since the engine started)
_COUNTERS = [
    ("vllm:prefix_cache_queries", "Prefix-cache queries, in blocks.", "prefix_queries"),
    ("vllm:prefix_cache_hits", "Prefix-cache hits, in blocks.", "prefix_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemptions.", "num_preemptions"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
]


class _EngineCollector:
    """Reads the engines' latest stats when Prometheus scrapes."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine = None  # the AsyncEngine, set by ServerMetrics.bind

    def collect(self):
        if self.engine is None:
            return
        client = self.engine.client
        alive = GaugeMetricFamily("kestrel_engine_alive", "1 while the engine core can serve.", labels=LABELS)
        gauges = [GaugeMetricFamily(n, h, labels=LABELS) for n, h, _ in _GAUGES]
        counters = [CounterMetricFamily(n, h, labels=LABELS) for n, h, _ in _COUNTERS]
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=LABELS + ["position"])
        for i in range(client.num_engines):
            lv = [self.model_name, str(i)]
            live = i not in client.dead
            alive.add_metric(lv, 1.0 if live else 0.0)
            s = client.stats[i] if i < len(client.stats) else None
            if not live or s is None:
                continue
            for fam, (_, _, attr) in zip(gauges, _GAUGES):
                fam.add_metric(lv, float(getattr(s, attr)))
            for fam, (_, _, attr) in zip(counters, _COUNTERS):
                fam.add_metric(lv, float(getattr(s, attr)))
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*lv, str(pos)], float(n))
        yield alive
        yield from gauges
        yield from counters
        yield per_pos


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self._engines = _EngineCollector(model_name)
        r.register(self._engines)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              LABELS, buckets=_LAT, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             LABELS, buckets=_LAT, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end-to-end request latency in "
                             "seconds.", LABELS, buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", LABELS,
                                         registry=r)
        self.finished = Counter("vllm:request_success", "Count of successfully processed requests.",
                                LABELS + ["finished_reason"], registry=r)
        self.frontend = Histogram("kestrel_request_frontend_seconds", "Seconds a request spends in the frontend before "
                                  "the engine, by stage: receive (HTTP body), render_wait (queued for a render "
                                  "thread), render (template, tokenizer, image loading and processing), resume (the "
                                  "event loop picking the result up); with render processes render_wait also holds "
                                  "the messages there and back, and render is the process's work.",
                                  ["model_name", "stage"], buckets=_LAT, registry=r)
        self.engine_requests = Counter("kestrel_engine_requests", "Core requests routed to each engine.", LABELS,
                                       registry=r)

    def bind(self, engine) -> None:
        self._engines.engine = engine

    def _lv(self, engine: int) -> tuple[str, str]:
        return self.model_name, str(engine)

    # ---- AsyncEngine hooks
    def on_routed(self, engine: int) -> None:
        self.engine_requests.labels(*self._lv(engine)).inc()

    def on_frontend(self, stage: str, seconds: float) -> None:
        self.frontend.labels(self.model_name, stage).observe(seconds)

    def on_first_token(self, engine: int, ttft_s: float) -> None:
        self.ttft.labels(*self._lv(engine)).observe(ttft_s)

    def on_tokens(self, engine: int, itl_s: float, count: int) -> None:
        h = self.itl.labels(*self._lv(engine))
        for _ in range(count):
            h.observe(itl_s)

    def on_finished(self, engine: int, e2e_s: float, prompt_tokens: int, generation_tokens: int, finish_reason) -> None:
        lv = self._lv(engine)
        self.e2e.labels(*lv).observe(e2e_s)
        self.prompt_tokens.labels(*lv).inc(prompt_tokens)
        self.generation_tokens.labels(*lv).inc(generation_tokens)
        self.finished.labels(*lv, str(finish_reason)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
