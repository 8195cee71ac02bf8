"""The runner's build as a seam: build_parts runs load -> add-ons -> bind -> block rows and returns frozen parts;
start_up runs the rest of the start-up order on them (precompile, KV sizing, allocation, buffers, warm-up,
graphs) and returns what it made; warm_up.py and memory_profile.py read parts, never the runner."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from kestrel.config import EngineConfig
from kestrel.executor.runner_build import RUNNER_FEATURES
from kestrel.worker.build import RunnerParts, build_parts, start_up
from kestrel.worker.memory_profile import determine_num_blocks, dummy_prefill_batch, profile_forward

WORKER = Path(__file__).resolve().parents[2] / "kestrel" / "worker"


def test_build_then_start_up_on_the_parts(tiny_llama):
    config = EngineConfig.create(model=str(tiny_llama), num_kv_blocks=16, max_num_batched_tokens=256)
    parts = build_parts(config, progress=False, feature_addons=RUNNER_FEATURES)
    assert isinstance(parts, RunnerParts) and parts.buffers is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        parts.buffers = parts.new_buffers()  # noqa: the stages hand each other new parts, never mutate them
    assert determine_num_blocks(parts) == 16
    ids, positions, ctx = dummy_prefill_batch(parts, 256)
    profile_forward(parts, ids, positions, ctx)  # the memory profile's forward, on the parts alone
    started = start_up(parts)
    assert started.num_blocks == 16 and started.buffers is not None and started.graph_sets == []  # CPU: eager
    assert parts.buffers is None  # the stages made their own
    with torch.inference_mode():
        hidden = parts.model(ids, positions, ctx)
    assert hidden.shape[0] == 256


def test_speculative_parts_carry_the_verify_addon(tiny_llama):
    config = EngineConfig.create(model=str(tiny_llama), num_kv_blocks=16,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    parts = build_parts(config, progress=False, feature_addons=RUNNER_FEATURES)
    sc = config.scheduler
    assert [a.name for a in parts.addons if a.name] == ["verify_steps"] and parts.max_sample_rows == sc.max_num_seqs * 4
    assert parts.hooks["graph_sets"]  # the verify graphs join the decode graphs where those are captured


@pytest.mark.parametrize("name", ["warm_up.py", "memory_profile.py"])
def test_start_up_stages_read_no_runner(name):
    assert not re.search(r"\brunner\.", (WORKER / name).read_text())
