"""Prometheus metrics under the names vLLM's dashboards read (``vllm:...``), on the server's own registry.

Every series carries ``model_name`` and ``engine`` (the engine-core index, data parallel). Engine gauges, the
prefix-cache counters and the cache-config info are read from each engine's latest scheduler stats at scrape
time; an engine that is dead or restarting reports nothing but ``kestrel_engine_alive 0``. Request latencies and
sizes are measured in the frontend (AsyncEngine calls the on_* hooks; the engine stamps a request's first
scheduling and each step's token counts). Buckets are vLLM's. docs/serving.md lists the metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kestrel.config import CacheConfig
from kestrel.engine.messages import SchedulerStats
from kestrel.frontend.request_metrics import FinishedRequest
from kestrel.server.lora_metrics import lora_requests_info

_LAT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_LAT = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)
_TPOT = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_STEP_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N = (1, 2, 5, 10, 20)
LABELS = ["model_name", "engine"]


def one_two_five(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10

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
    ("kestrel_fair_share_paused_steps", "Steps in which a request's sequences beyond --contended-seqs-per-request "
     "sat out beside another request's.", "num_paused_steps"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
    ("vllm:external_prefix_cache_queries", "External prefix cache queries from the KV tiers (host memory, disk), "
     "in terms of number of tokens.", "tier_kv_queries"),
    ("vllm:external_prefix_cache_hits", "External prefix cache hits from the KV tiers (host memory, disk), in "
     "terms of number of tokens.", "tier_kv_hits"),
    ("vllm:kv_offload_store_bytes", "Bytes of KV cache stored from the device into the host tier.",
     "host_kv_saved_bytes"),
    ("vllm:kv_offload_load_bytes", "Bytes of KV cache loaded into the device from the KV tiers.", "kv_loaded_bytes"),
]
# vLLM's offloading counter by direction: transfer_type -> SchedulerStats field
_OFFLOAD_BYTES = [("GPU_to_CPU", "host_kv_saved_bytes"), ("CPU_to_GPU", "host_kv_loaded_bytes"),
                  ("CPU_to_DISK", "disk_kv_written_bytes"), ("DISK_to_GPU", "disk_kv_read_bytes")]


class _EngineCollector:
    """Reads the engines' latest stats when Prometheus scrapes."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.engine = None  # the AsyncEngine, set by ServerMetrics.bind
        self.cache: CacheConfig | None = None  # set by ServerMetrics.configure

    def collect(self):
        if self.engine is None:
            return
        client = self.engine.client
        alive = GaugeMetricFamily("kestrel_engine_alive", "1 while the engine core can serve.", labels=LABELS)
        gauges = [GaugeMetricFamily(n, h, labels=LABELS) for n, h, _ in _GAUGES]
        counters = [CounterMetricFamily(n, h, labels=LABELS) for n, h, _ in _COUNTERS]
        info_labels = ["block_size", "cache_dtype", "enable_prefix_caching", "gpu_memory_utilization",
                       "num_gpu_blocks"]
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=LABELS + info_labels)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.", labels=LABELS + ["position"])
        offload = CounterMetricFamily("vllm:kv_offload_total_bytes", "Bytes moved between the KV-cache tiers.",
                                      labels=LABELS + ["transfer_type"])
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
            if self.cache is not None:
                c = self.cache
                info.add_metric(lv + [str(c.block_size), "auto", str(c.enable_prefix_caching),
                                      str(c.gpu_memory_utilization), str(s.num_kv_blocks)], 1.0)
            for pos, n in enumerate(s.spec_accepted_per_pos):
                per_pos.add_metric([*lv, str(pos)], float(n))
            for kind, attr in _OFFLOAD_BYTES:
                if getattr(s, attr):
                    offload.add_metric([*lv, kind], float(getattr(s, attr)))
        yield alive
        yield from gauges
        yield from counters
        yield per_pos
        yield offload
        live = [client.stats[i] for i in range(min(client.num_engines, len(client.stats)))
                if i not in client.dead and client.stats[i] is not None]
        lora = lora_requests_info(getattr(self.engine.config, "lora", None), live)
        if lora is not None:
            yield lora
        if self.cache is not None:
            yield info


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
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds."
                              "DEPRECATED: Use vllm:inter_token_latency_seconds instead.", LABELS, buckets=_TPOT,
                              registry=r)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds", "Histogram of "
                                      "time_per_output_token_seconds per request.", LABELS, buckets=_TPOT, registry=r)
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     LABELS, buckets=_STEP_TOKENS, registry=r)
        self.params_n = Histogram("vllm:request_params_n", "Histogram of the n request parameter.", LABELS,
                                  buckets=_N, registry=r)
        self.phases = {phase: Histogram(f"vllm:request_{phase}_time_seconds", f"Histogram of time spent in {what} "
                                        "phase for request.", LABELS, buckets=_REQUEST_LAT, registry=r)
                       for phase, what in (("queue", "WAITING"), ("inference", "RUNNING"), ("prefill", "PREFILL"),
                                           ("decode", "DECODE"))}
        self.sizes: dict[str, Histogram] = {}  # token-count histograms, bucketed up to max_model_len (configure)
        self.stats_log = None  # the periodic stats line (kestrel/server/stats_log.py), unless --disable-log-stats

    def bind(self, engine) -> None:
        self._engines.engine = engine

    def configure(self, max_model_len: int, cache: CacheConfig, stats_log=None) -> None:
        """Once the engine runs: the token-count histograms (their buckets reach max_model_len), the cache info and
        the stats line to feed."""
        self._engines.cache, self.stats_log = cache, stats_log
        buckets = one_two_five(max_model_len)
        for key, name, doc in (
                ("prompt", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
                ("generation", "vllm:request_generation_tokens", "Number of generation tokens processed."),
                ("max_generation", "vllm:request_max_num_generation_tokens", "Histogram of maximum number of "
                 "requested generation tokens."),
                ("max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.")):
            if key not in self.sizes:
                self.sizes[key] = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)

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
        lv = self._lv(engine)
        itl, tpot = self.itl.labels(*lv), self.tpot.labels(*lv)
        for _ in range(count):
            itl.observe(itl_s)
            tpot.observe(itl_s)

    def on_step(self, engine: int, stats: SchedulerStats) -> None:
        self.step_tokens.labels(*self._lv(engine)).observe(stats.step_tokens)
        if self.stats_log is not None:
            self.stats_log.on_step(engine, stats)

    def on_finished(self, engine: int, done: FinishedRequest) -> None:
        lv = self._lv(engine)
        self.e2e.labels(*lv).observe(done.e2e)
        self.prompt_tokens.labels(*lv).inc(done.prompt_tokens)
        self.generation_tokens.labels(*lv).inc(done.generation_tokens)
        self.finished.labels(*lv, str(done.finish_reason)).inc()
        self.params_n.labels(*lv).observe(done.n)
        for phase, seconds in (("queue", done.queued), ("inference", done.inference), ("prefill", done.prefill),
                               ("decode", done.decode)):
            if seconds is not None:
                self.phases[phase].labels(*lv).observe(max(seconds, 0.0))
        if done.decode is not None and done.max_generation_tokens > 1:
            self.request_tpot.labels(*lv).observe(done.decode / (done.max_generation_tokens - 1))
        if self.sizes:
            self.sizes["prompt"].labels(*lv).observe(done.prompt_tokens)
            self.sizes["generation"].labels(*lv).observe(done.generation_tokens)
            self.sizes["max_generation"].labels(*lv).observe(done.max_generation_tokens)
            if done.max_tokens is not None:
                self.sizes["max_tokens"].labels(*lv).observe(done.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
