"""Prometheus metrics on the server's own CollectorRegistry. Engine gauges carry an `engine` label (data parallel);
request latencies are measured in the frontend (AsyncEngine calls the on_* hooks)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lbl = ["model_name", "engine"]
        self.model_name = model_name
        self.running = Gauge("kestrel_num_requests_running", "requests running in the engine", lbl, registry=r)
        self.waiting = Gauge("kestrel_num_requests_waiting", "requests waiting in the engine", lbl, registry=r)
        self.kv_usage = Gauge("kestrel_kv_cache_usage_perc", "fraction of KV blocks in use (0..1)", lbl, registry=r)
        self.kv_free = Gauge("kestrel_kv_blocks_free", "free KV-cache blocks", lbl, registry=r)
        self.kv_total = Gauge("kestrel_kv_blocks_total", "KV-cache blocks in the pool", lbl, registry=r)
        self.prefix_hit_rate = Gauge("kestrel_prefix_cache_hit_rate", "prefix-cache hits / queries (blocks), "
                                     "since start", lbl, registry=r)
        self.prefix_queries = Gauge("kestrel_prefix_cache_queries", "prefix-cache block queries since start", lbl,
                                    registry=r)
        self.prefix_hits = Gauge("kestrel_prefix_cache_hits", "prefix-cache block hits since start", lbl, registry=r)
        self.preemptions = Gauge("kestrel_num_preemptions", "preemptions since start", lbl, registry=r)
        self.engine_alive = Gauge("kestrel_engine_alive", "1 while the engine core is alive", lbl, registry=r)
        self.engine_requests = Counter("kestrel_engine_requests", "core requests routed to each engine", lbl,
                                       registry=r)
        m = ["model_name"]
        self.ttft = Histogram("kestrel_time_to_first_token_seconds", "time to first token", m, buckets=_LAT,
                              registry=r)
        self.itl = Histogram("kestrel_inter_token_latency_seconds", "time between output tokens", m, buckets=_LAT,
                             registry=r)
        self.e2e = Histogram("kestrel_e2e_request_latency_seconds", "request latency, arrival to last token", m,
                             buckets=_LAT, registry=r)
        self.prompt_tokens = Counter("kestrel_prompt_tokens", "prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("kestrel_generation_tokens", "tokens generated", m, registry=r)
        self.finished = Counter("kestrel_request_success", "finished requests by finish reason",
                                ["model_name", "finished_reason"], registry=r)

    # ---- AsyncEngine hooks
    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.labels(self.model_name).observe(ttft_s)

    def on_tokens(self, itl_s: float, count: int) -> None:
        h = self.itl.labels(self.model_name)
        for _ in range(count):
            h.observe(itl_s)

    def on_finished(self, e2e_s: float, prompt_tokens: int, generation_tokens: int, finish_reason) -> None:
        self.e2e.labels(self.model_name).observe(e2e_s)
        self.prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self.generation_tokens.labels(self.model_name).inc(generation_tokens)
        self.finished.labels(self.model_name, str(finish_reason)).inc()

    def on_routed(self, engine: int) -> None:
        self.engine_requests.labels(self.model_name, str(engine)).inc()

    # ---- scrape
    def render(self, engine) -> bytes:
        dead = engine.dead_engines
        for i, s in enumerate(engine.stats):
            lv = (self.model_name, str(i))
            self.engine_alive.labels(*lv).set(0 if i in dead else 1)
            if s is None:
                continue
            self.running.labels(*lv).set(s.num_running)
            self.waiting.labels(*lv).set(s.num_waiting)
            self.kv_usage.labels(*lv).set(s.kv_usage)
            self.kv_free.labels(*lv).set(s.num_free_kv_blocks)
            self.kv_total.labels(*lv).set(s.num_kv_blocks)
            self.prefix_queries.labels(*lv).set(s.prefix_queries)
            self.prefix_hits.labels(*lv).set(s.prefix_hits)
            self.prefix_hit_rate.labels(*lv).set(s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
            self.preemptions.labels(*lv).set(s.num_preemptions)
        return generate_latest(self.registry)
