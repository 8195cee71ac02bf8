"""The position-scheme seam (kestrel/core/positions.py), proved by a test-only scheme as the test-only state kind
proves the cache seam: a Llama whose class declares a two-row scheme (row 0 the index shifted by SHIFT through the
prompt, row 1 a marker), registered with one registry line. The frontend computes its prompt positions, and the
runner's input preparation, decode and prefill graph paddings (the CPU's eager replays of the captured
metadata), chunked prefill, prefix-cache hits and n-gram drafts carry [2, T] positions without knowing the scheme:
its greedy tokens equal the plain Llama's (RoPE sees only position differences, so one shift everywhere is
invisible, and a token past the prompt missing the delta would not be), and every row seen is what the scheme says.
Also M-RoPE's prompt positions against transformers' get_rope_index."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.positions import MRoPE, PositionScheme, PromptPositions, stage_rows
from kestrel.models.interfaces import HasPositionScheme
from kestrel.models.llama import LlamaForCausalLM

SHIFT, MARK = 5, 10_000
ARCH = "KestrelTestTwoRowLlama"
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class TwoRows(PositionScheme):
    rows = 2

    def prompt_positions(self, token_ids, features):
        n = len(token_ids)
        return PromptPositions.from_array(np.stack([np.arange(n) + SHIFT, np.full(n, MARK)]), SHIFT)


class TwoRowLlama(LlamaForCausalLM, HasPositionScheme):
    seen: list = []

    @classmethod
    def position_scheme(cls, hf_config):
        return TwoRows()

    def forward(self, input_ids, positions, ctx, inputs_embeds=None):
        assert positions.shape == (2, input_ids.shape[0])
        TwoRowLlama.seen.append(positions.clone())
        return super().forward(input_ids, positions[0], ctx, inputs_embeds)


@pytest.fixture
def two_row_llama(tiny_llama, tmp_path, monkeypatch):
    from kestrel.models import registry

    path = tmp_path / "two_row"
    shutil.copytree(tiny_llama, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = [ARCH]
    (path / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setitem(registry._MODELS, ARCH, (__name__, "TwoRowLlama"))
    TwoRowLlama.seen = []
    return path


PROMPTS = [[3, 4, 5, 6, 3, 4, 5], [10, 11, 12] * 7, list(range(40, 77))]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def greedy(llm, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


def check_rows_seen(prompt_lens: set[int]) -> None:
    """Every position staged: a prompt token (row 1 the marker) at its index + SHIFT, a later token at its index
    + SHIFT in both rows; pad rows of a graph replay (rows equal, below any real position) aside."""
    for p in TwoRowLlama.seen:
        prompt = p[1] == MARK
        assert bool((p[0][~prompt] == p[1][~prompt]).all())
        assert bool((p[0][prompt] >= SHIFT).all())
    assert sum(int((p[1] == MARK).sum()) for p in TwoRowLlama.seen) >= min(prompt_lens)


def test_two_row_scheme_through_the_engine(tiny_llama, two_row_llama):
    ref = greedy(LLM(str(tiny_llama), progress=False))
    llm = LLM(str(two_row_llama), progress=False, max_num_batched_tokens=16, block_size=4)
    assert llm.engine.core.executor.runner.buffers.positions.shape[0] == 2
    assert greedy(llm) == ref  # chunked prefill (16-token steps through 37-token prompts), decode, batching
    check_rows_seen({len(p) for p in PROMPTS})
    TwoRowLlama.seen = []
    assert greedy(llm) == ref  # the same prompts again: prefix-cache hits
    cached = [o.num_cached_tokens for o in llm.generate(PROMPTS, GREEDY)]
    assert all(c > 0 for c in cached), cached


def test_two_row_scheme_graph_paddings(tiny_llama, two_row_llama):
    """The decode and prefill graph sets' padded replays (eager on the CPU, from the captured metadata) write and
    read [2, N] position buffers."""
    from kestrel.worker.cuda_graphs import DecodeGraphs
    from kestrel.worker.prefill_graphs import PrefillGraphs

    ref = greedy(LLM(str(tiny_llama), progress=False))
    llm = LLM(str(two_row_llama), progress=False, enable_prefix_caching=False)
    runner = llm.engine.core.executor.runner
    runner.graph_sets = [dg := DecodeGraphs(runner, [1, 2, 4, 8]), pg := PrefillGraphs(runner, [16, 32, 64])]
    assert greedy(llm) == ref
    assert [greedy(llm, [p])[0] for p in PROMPTS] == ref  # one request alone: its prefill is a prefill graph's
    assert dg.replays > 0 and pg.replays > 0


def test_two_row_scheme_with_ngram_drafts(tiny_llama, two_row_llama):
    ref = greedy(LLM(str(tiny_llama), progress=False))
    llm = LLM(str(two_row_llama), progress=False, speculative_config=NGRAM)
    assert greedy(llm) == ref
    assert llm.engine.core.speculation.num_accepted_tokens > 0
    check_rows_seen({len(p) for p in PROMPTS})


def test_stage_rows():
    prompt = np.array([[0, 1, 1, 1, 4], [0, 1, 1, 2, 4], [0, 1, 2, 1, 4]])
    out = np.zeros((3, 4), dtype=np.int64)
    stage_rows(out, prompt, -2, 3)  # two prompt tokens, then indices 5, 6 + delta
    assert out.tolist() == [[1, 4, 3, 4], [2, 4, 3, 4], [1, 4, 3, 4]]
    stage_rows(out[:, :2], None, 0, 7)
    assert out[:, :2].tolist() == [[7, 8]] * 3


class _Feature:
    def __init__(self, offset, length, grid):
        self.offset, self.length, self.grid = offset, length, grid

    @property
    def end(self):
        return self.offset + self.length


def test_mrope_prompt_positions_match_transformers():
    """Two images of different grids between text runs: [3, T] positions and the rope delta equal
    get_rope_index's."""
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    image_token = 99
    grids = [(1, 4, 6), (1, 8, 2)]  # patch grids; 2x2 merge: 1x2x3 = 6 and 1x4x1 = 4 tokens
    ids = [1, 2, 3] + [image_token] * 6 + [4, 5] + [image_token] * 4 + [6, 7, 8, 9]
    features = [_Feature(3, 6, grids[0]), _Feature(11, 4, grids[1])]
    scheme = MRoPE(lambda f: (f.grid[0], f.grid[1] // 2, f.grid[2] // 2))
    ours = scheme.prompt_positions(ids, features)
    model = Qwen2_5_VLModel.__new__(Qwen2_5_VLModel)  # get_rope_index reads only the config
    torch.nn.Module.__init__(model)
    model.config = Qwen2_5_VLConfig()
    types = torch.tensor([[int(t == image_token) for t in ids]])
    ref, delta = model.get_rope_index(torch.tensor([ids]), types, image_grid_thw=torch.tensor(grids))
    assert ours.array().tolist() == ref[:, 0].tolist()
    assert ours.delta == int(delta)
    assert scheme.prompt_positions(ids[:3], []) is None  # text only: the indices


def test_prompt_positions_survive_the_wire():
    import msgspec

    from kestrel.core.extras import RequestExtras

    p = np.array([[0, 1, 1, 1, 3], [0, 1, 1, 2, 3], [0, 1, 2, 1, 3]])
    extras = RequestExtras(positions=PromptPositions.from_array(p, -1))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(extras), type=RequestExtras)
    assert back.positions.array().tolist() == p.tolist() and back.positions.delta == -1
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(RequestExtras()), type=RequestExtras).positions is None
