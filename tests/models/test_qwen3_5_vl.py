"""Qwen3.5 / Qwen3.5-MoE with images (Qwen3-VL's tower without DeepStack on the Gated DeltaNet hybrid) against
transformers on tiny random checkpoints with transformers' own processor (CPU float32): prompt token ids and greedy
tokens identical for 16 tokens on a text-only prompt, one image and two images of different sizes; the prompt's
M-RoPE positions equal get_rope_index's; chunked prefill cutting through the images (the GDN state carried across
the cut) gives the same tokens; a 4-frame video too."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.worker.addons.images import ImageEncoderCache
from tests.mm_reference import assert_greedy_and_positions, image_request, mrope_reference, sized_images
from tests.mm_tiny import make_qwen3_5_vl, qwen_vl_processor

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
PROMPTS = [("hello world, how are you", []), (f"{IMG}describe this", [0]),
           (f"first {IMG} then {IMG} compare them", [1, 2])]
SIZES = [(120, 70), (60, 150), (100, 100)]  # (width, height): grids of 1x4x8, 1x10x4, 1x6x6 patches of 16


@pytest.fixture(scope="module", params=["dense", "moe"])
def path(request, tmp_path_factory):
    return make_qwen3_5_vl(tmp_path_factory.mktemp("qwen3_5_vl"), moe=request.param == "moe")


@pytest.fixture(scope="module")
def images():
    return sized_images(SIZES)


request = image_request


@pytest.fixture(scope="module")
def reference(path, images):
    """transformers' prompt ids, greedy tokens and M-RoPE positions per prompt."""
    return mrope_reference(path, qwen_vl_processor(path), PROMPTS, images, N)


def test_greedy_and_positions_match_transformers(path, images, reference):
    assert_greedy_and_positions(LLM(str(path), progress=False), PROMPTS, images, reference, GREEDY)


def test_chunked_prefill_through_images(path, images, reference):
    """An 8-token budget cuts the images' placeholders (8, 10 and 9 tokens) across steps: each image is encoded
    once, the GDN layers' state carries over the cuts, and the tokens stay transformers'."""
    llm = LLM(str(path), progress=False, max_num_batched_tokens=8, enable_prefix_caching=False)
    runner = llm.engine.core.executor.runner
    (addon,) = [a for a in runner.addons if isinstance(a, ImageEncoderCache)]
    inside, orig = [], addon.inputs_embeds

    def watch(chunks, states, input_ids):
        for c, st in zip(chunks, states):
            end = c.num_computed_tokens + c.num_new_tokens
            inside.extend(f for f in st.extras.mm_features if f.offset < end < f.end)
        return orig(chunks, states, input_ids)
    runner._hooks["inputs_embeds"] = [watch]
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS[1:]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [toks for _, toks, _ in reference[1:]]
    assert len(inside) >= 2


def test_a_video_matches_transformers(path):
    """A 4-frame video (Qwen3-VL's processor style: per-frame-group timestamps, one feature per group) through
    kestrel/frontend/qwen_video.py: prompt ids and greedy tokens equal transformers' on the same pixels."""
    from transformers import AutoModelForImageTextToText

    frames = np.random.default_rng(0).integers(0, 256, (4, 70, 100, 3), dtype=np.uint8)
    text = "watch <|vision_start|><|video_pad|><|vision_end|> what happens"
    enc = qwen_vl_processor(path, video=True)(text=[text], videos=[frames], return_tensors="pt")
    enc.pop("video_metadata", None)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    ref = model.generate(**enc, max_new_tokens=N, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    out = LLM(str(path), progress=False).generate({"prompt": text, "multi_modal_data": {"video": frames}}, GREEDY)[0]
    assert out.prompt_token_ids == enc["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ref


def test_prefix_cache_hit_on_a_repeated_image(path, images, reference):
    llm = LLM(str(path), progress=False)
    first = llm.generate([request(*PROMPTS[2], images)], GREEDY)[0]
    again = llm.generate([request(*PROMPTS[2], images)], GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reference[2][1]
    block = llm.engine.config.cache.block_size  # the GDN state is snapshotted at block ends: whole blocks hit
    assert again.num_cached_tokens == (len(reference[2][0]) - 1) // block * block
    other = llm.generate([request(PROMPTS[2][0], [2, 1], images)], GREEDY)[0]  # other images in the same places
    assert other.num_cached_tokens < reference[2][0].index(llm.engine.input_processor.mm.image_token_id) + 1
