"""vLLM's `vllm:lora_requests_info` gauge (served with --enable-lora): one sample whose labels name the most
adapters in one batch (max_lora) and the adapters of the running and of the waiting requests (comma-separated,
over every live engine core, from their latest stats: kestrel/engine/addons/lora.py); its value is the time of
the scrape, as vLLM sets it to the current time."""
from __future__ import annotations

import time

from prometheus_client.core import GaugeMetricFamily

LABELS = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]


def lora_requests_info(lora_config, stats: list) -> GaugeMetricFamily | None:
    """`stats`: the live engines' latest SchedulerStats. None where LoRA is off (vLLM has no such metric then)."""
    if lora_config is None or not lora_config.enable_lora:
        return None
    running = sorted({name for s in stats for name in s.running_loras})
    waiting = sorted({name for s in stats for name in s.waiting_loras})
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.", labels=LABELS)
    family.add_metric([str(lora_config.max_loras), ",".join(waiting), ",".join(running)], time.time())
    return family
