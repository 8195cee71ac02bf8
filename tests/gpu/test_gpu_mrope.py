"""GPU checks of M-RoPE models (skipped without CUDA): tiny Qwen2.5-VL (sectioned) and Qwen3-VL (interleaved,
DeepStack) with head dim 64 on the Triton backend.
Decode-graph and prefill-graph replays ([3, N] static position buffers, the fused rotary reading each token's
cos|sin row) give the eager engine's tokens, for text and image prompts, batched and alone; in float32 the
engine's tokens equal transformers'; n-gram speculative decoding (verify graphs) equals plain decoding."""
import gc

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.mm_tiny import make_image, make_qwen2_5_vl, make_qwen3_vl, qwen_vl_processor

pytestmark = pytest.mark.gpu
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
KV_BLOCKS = 512


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def path(request, tmp_path_factory):
    make = {"qwen2_5_vl": make_qwen2_5_vl, "qwen3_vl": make_qwen3_vl}[request.param]
    return make(tmp_path_factory.mktemp("gpu_" + request.param), name="wide", hidden_size=256, head_dim=64,
                intermediate_size=512, mrope_section=[8, 12, 12])


@pytest.fixture(scope="module")
def prompts():
    ims = [make_image(w, h, seed=20 + i) for i, (w, h) in enumerate([(120, 70), (60, 150), (100, 100)])]
    return ["a plain text prompt", {"prompt": f"{IMG}describe", "multi_modal_data": {"image": [ims[0]]}},
            {"prompt": f"one {IMG} two {IMG} compare", "multi_modal_data": {"image": [ims[1], ims[2]]}}]


def tokens(llm, prompts):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def test_cuda_graph_replay_equals_eager(path, prompts):
    opts = dict(dtype="bfloat16", progress=False, async_scheduling="off", num_kv_blocks=KV_BLOCKS)
    graphs, eager = LLM(str(path), **opts), LLM(str(path), enforce_eager=True, **opts)
    try:
        runner = graphs.engine.core.executor.runner
        assert runner.backend.name == "triton" and runner.graphs is not None
        assert runner.buffers.positions.shape[0] == 3
        assert tokens(graphs, prompts * 3) == tokens(eager, prompts * 3)
        for p in prompts:  # alone: its prefill a prefill graph's (text), its decode batch-1 graphs
            assert tokens(graphs, [p]) == tokens(eager, [p]), p
        assert runner.graphs.replays > 0
        pg = next((g for g in runner.graph_sets if type(g).__name__ == "PrefillGraphs"), None)
        assert pg is None or pg.replays > 0
    finally:
        del graphs, eager
        gc.collect()


def test_float32_on_cuda_matches_transformers(path, prompts):
    """Teacher-forced: transformers in float32 reads each prompt followed by the engine's 24 greedy tokens; every
    engine token is transformers' argmax there, or within 0.05 of its top logit, at most once: a near-tie flipped by
    the Triton kernels' float32 dots, which run in TF32 on CUDA (Triton's default), as cuBLAS does not; the
    2-image Qwen2.5-VL prompt has one at 0.017 (H100)."""
    from transformers import AutoModelForImageTextToText

    llm = LLM(str(path), dtype="float32", progress=False, num_kv_blocks=KV_BLOCKS)
    ours = tokens(llm, prompts)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).cuda().eval()
    proc = qwen_vl_processor(path)
    for p, got in zip(prompts, ours):
        text, imgs = (p, None) if isinstance(p, str) else (p["prompt"], [p["multi_modal_data"]["image"]])
        enc = proc(text=[text], images=imgs, return_tensors="pt").to("cuda")
        n = enc["input_ids"].shape[1]
        tail = {"input_ids": torch.tensor([got], device="cuda"), "attention_mask": torch.ones(1, len(got))}
        for key, v in enc.items():  # every per-token row (mm_token_type_ids too): the generated tokens are text
            if v.dim() == 2 and v.shape[1] == n:
                enc[key] = torch.cat([v, tail.get(key, torch.zeros(1, len(got))).to(v)], 1)
        with torch.no_grad():
            logits = model(**enc).logits[0, n - 1:-1].float()
        top = logits.max(-1).values
        chosen = logits.gather(1, torch.tensor(got, device="cuda")[:, None])[:, 0]
        gap = (top - chosen).tolist()
        assert max(gap) < 0.05, (text, [(i, round(g, 5)) for i, g in enumerate(gap) if g > 0])
        assert sum(g > 0 for g in gap) <= 1, (text, gap)  # a flip, not a drift


def test_ngram_drafts_equal_plain_decoding(path, prompts):
    opts = dict(dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS)
    spec = LLM(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                              "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **opts)
    plain = LLM(str(path), **opts)
    assert tokens(spec, prompts) == tokens(plain, prompts)
