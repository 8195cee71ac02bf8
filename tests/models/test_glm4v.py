"""GLM-4.xV: GLM-4.5V / 4.6V (`glm4v_moe`: the GLM-4.xV tower on the GLM-4-MoE decoder), GLM-4.1V / 4.6V-Flash
(`glm4v`: the same tower on the dense GLM-4 decoder), and transformers' `glm46v` layout over either text model, all
with sectioned M-RoPE, against transformers on a tiny random checkpoint with transformers' own processor (CPU
float32): prompt token ids and greedy tokens identical for 16 tokens on a text-only prompt, one image and two
images of different sizes (one not square: the learned position grid sampled at another aspect ratio); the prompt's
positions equal get_rope_index's; chunked prefill cutting through the images keeps the tokens; a `glm46v` text
model of another kind is refused by name. Videos: tests/models/test_glm4v_video.py."""
from __future__ import annotations

import pytest

from kestrel import LLM, SamplingParams
from kestrel.errors import ConfigError
from tests.mm_reference import assert_greedy_and_positions, image_request, mrope_reference, sized_images
from tests.mm_tiny import GLM4V_KINDS, glm4v_processor, make_glm4v

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
IMG = "<|begin_of_image|><|image|><|end_of_image|>"
PROMPTS = [("hello world, how are you", []), (f"{IMG}describe this", [0]),
           (f"first {IMG} then {IMG} compare them", [1, 2])]
SIZES = [(120, 70), (60, 150), (100, 100)]  # (width, height): grids of 1x4x8, 1x10x4, 1x6x6 patches of 14


@pytest.fixture(scope="module", params=list(GLM4V_KINDS))
def path(request, tmp_path_factory):
    return make_glm4v(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def images():
    return sized_images(SIZES)


request = image_request


@pytest.fixture(scope="module")
def reference(path, images):
    return mrope_reference(path, glm4v_processor(path), PROMPTS, images, N)


def test_greedy_and_positions_match_transformers(path, images, reference):
    assert_greedy_and_positions(LLM(str(path), progress=False), PROMPTS, images, reference, GREEDY)


def test_chunked_prefill_through_images(path, images, reference):
    llm = LLM(str(path), progress=False, max_num_batched_tokens=8, enable_prefix_caching=False)
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS[1:]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [toks for _, toks, _ in reference[1:]]


def test_prefix_cache_hit_on_a_repeated_image(path, images, reference):
    llm = LLM(str(path), progress=False, block_size=4)
    first = llm.generate([request(*PROMPTS[2], images)], GREEDY)[0]
    again = llm.generate([request(*PROMPTS[2], images)], GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reference[2][1]
    assert again.num_cached_tokens >= len(reference[2][0]) - 4
    other = llm.generate([request(PROMPTS[2][0], [2, 1], images)], GREEDY)[0]
    assert other.num_cached_tokens < 8


def test_glm46v_refuses_another_text_model():
    import torch
    from transformers import Glm46VConfig

    from kestrel.models.context import ModelContext
    from kestrel.models.glm4v import Glm46VForConditionalGeneration
    from kestrel.models.hf_config import HFConfig

    cfg = Glm46VConfig(text_config={"model_type": "glm4", "hidden_size": 64, "num_attention_heads": 2},
                       vision_config={"model_type": "glm4v_vision", "out_hidden_size": 64})
    with pytest.raises(ConfigError, match="'glm4' text model is not supported"):
        Glm46VForConditionalGeneration(ModelContext(HFConfig.from_hf(cfg, 64), torch.float32, None))
