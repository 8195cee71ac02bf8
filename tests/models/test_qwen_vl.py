"""Qwen2.5-VL, Qwen3-VL (DeepStack on) and Qwen3-VL-MoE against transformers on tiny random checkpoints with
transformers' own processor (CPU float32):
greedy tokens identical for 16 tokens on a text-only prompt, one image and two images of different sizes; prompt
token ids (so lengths) equal the processor's; the prompt's M-RoPE positions and rope delta equal get_rope_index's;
chunked prefill cutting through the images; a prefix-cache hit on a repeated image; n-gram speculative decoding.
Without torchvision (transformers' Qwen-VL processor then cannot build its video processor) image prompts go
through the image-only processor (videos through kestrel's own video processor)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequest
from kestrel.worker.addons.images import ImageEncoderCache
from tests.mm_reference import image_request, mrope_reference, sized_images
from tests.mm_tiny import make_qwen2_5_vl, make_qwen3_vl, make_qwen3_vl_moe, qwen_vl_processor

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
# (text, images): text only, one image, two images of different sizes and aspect ratios
PROMPTS = [("hello world, how are you", []), (f"{IMG}describe this", [0]),
           (f"first {IMG} then {IMG} compare them", [1, 2])]
SIZES = [(120, 70), (60, 150), (100, 100)]  # (width, height): Qwen2.5-VL grids of 1x4x8, 1x10x4, 1x8x8 patches
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


MAKERS = {"qwen2_5_vl": make_qwen2_5_vl, "qwen3_vl": make_qwen3_vl, "qwen3_vl_moe": make_qwen3_vl_moe}


@pytest.fixture(scope="module", params=list(MAKERS))
def path(request, tmp_path_factory):
    make = MAKERS[request.param]
    return make(tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def images():
    return sized_images(SIZES)


request = image_request


@pytest.fixture(scope="module")
def reference(path, images):
    """transformers' processor outputs and greedy tokens per prompt."""
    return mrope_reference(path, qwen_vl_processor(path), PROMPTS, images, N)


def greedy(llm, images, prompts=PROMPTS, params=GREEDY):
    return llm.generate([request(t, i, images) for t, i in prompts], params)


def test_greedy_and_prompts_match_transformers(path, images, reference):
    llm = LLM(str(path), progress=False)
    outs = greedy(llm, images)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _, _ in reference]
    assert [o.outputs[0].token_ids for o in outs] == [toks for _, toks, _ in reference]
    assert len({tuple(t) for _, t, _ in reference}) == len(reference)  # the images change the outputs
    assert llm.engine.core.executor.runner.buffers.positions.shape[0] == 3


def test_prompt_positions_match_get_rope_index(path, images, reference):
    llm = LLM(str(path), progress=False)
    proc = llm.engine.input_processor
    for (text, idx), (ids, _, ref) in zip(PROMPTS, reference):
        _, (req,) = proc.process("r", request(text, idx, images), GREEDY)
        if ref is None:
            assert req.extras.positions is None  # text only: the token indices
            continue
        positions, delta = ref
        assert np.array_equal(req.extras.positions.array(), positions[:, 0].numpy())
        assert req.extras.positions.delta == int(delta)


def test_chunked_prefill_through_images(path, images, reference):
    """An 8-token budget cuts both images' placeholders (8 and 10 tokens) across steps: the encoder runs once per
    image and the outputs stay transformers'."""
    llm = LLM(str(path), progress=False, max_num_batched_tokens=8, block_size=4, enable_prefix_caching=False)
    runner = llm.engine.core.executor.runner
    (addon,) = [a for a in runner.addons if isinstance(a, ImageEncoderCache)]
    inside, orig = [], addon.inputs_embeds

    def watch(chunks, states, input_ids):
        for c, st in zip(chunks, states):
            end = c.num_computed_tokens + c.num_new_tokens
            inside.extend(f for f in st.extras.mm_features if f.offset < end < f.end)
        return orig(chunks, states, input_ids)
    runner._hooks["inputs_embeds"] = [watch]
    outs = greedy(llm, images)
    assert [o.outputs[0].token_ids for o in outs] == [toks for _, toks, _ in reference]
    assert len(inside) >= 2


def test_prefix_cache_hit_on_a_repeated_image(path, images, reference):
    llm = LLM(str(path), progress=False, block_size=4)
    first = greedy(llm, images, PROMPTS[2:])[0]
    again = greedy(llm, images, PROMPTS[2:])[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reference[2][1]
    assert again.num_cached_tokens >= len(reference[2][0]) - 4
    other = greedy(llm, images, [(PROMPTS[2][0], [2, 1])])[0]  # other images in the same places: no hit past them
    assert other.num_cached_tokens < 8


def test_ngram_speculative_decoding(path, images, reference):
    llm = LLM(str(path), progress=False, speculative_config=NGRAM)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in greedy(LLM(str(path), progress=False), images, params=params)]
    outs = greedy(llm, images, params=params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert [t[:N] for t in plain] == [toks for _, toks, _ in reference]
    assert llm.engine.core.speculation.num_drafts > 0


def test_draft_models_refused_with_mrope(path):
    from kestrel.errors import ConfigError

    with pytest.raises(ConfigError, match="method 'mtp' on a model of 3 position rows"):
        LLM(str(path), progress=False, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_image_only_processor_without_torchvision(path, images):
    llm = LLM(str(path), progress=False)
    proc = llm.engine.input_processor.mm.processor
    if importlib.util.find_spec("torchvision") is not None:
        assert type(proc).__name__ in ("Qwen2_5_VLProcessor", "Qwen3VLProcessor")  # transformers' own
        return
    from kestrel.frontend.image_only_processor import ImageOnlyProcessor

    assert isinstance(proc, ImageOnlyProcessor)
    assert proc.video_processor is not None  # kestrel/frontend/qwen_video.py (tests/models/test_qwen_vl_video.py)
    no_video = ImageOnlyProcessor(proc.tokenizer, proc.image_processor, proc.image_token, proc.count_tokens, proc.why)
    with pytest.raises(InvalidRequest, match="videos need the model's full processor.*orchvision"):
        no_video(text=["x"], videos=[[images[0]]])
    with pytest.raises(InvalidRequest, match="unsupported modalities \\['audio'\\]"):
        llm.generate({"prompt": "x", "multi_modal_data": {"audio": [images[0]]}}, GREEDY)


def test_chat_with_an_image(path, images, reference):
    llm = LLM(str(path), progress=False)
    out = llm.chat([{"role": "user", "content": [{"type": "image", "image": images[0]},
                                                  {"type": "text", "text": "describe this"}]}], GREEDY)[0]
    ids = out.prompt_token_ids
    proc = qwen_vl_processor(path)
    text = f"<|im_start|>user\n{IMG}describe this<|im_end|>\n<|im_start|>assistant\n"
    assert ids == proc(text=[text], images=[[images[0]]], return_tensors="pt")["input_ids"][0].tolist()


def test_deepstack_changes_the_outputs(tmp_path, images):
    """Qwen3-VL without its DeepStack levels (the decoder given none) no longer gives transformers' tokens: the
    agreement above depends on them."""
    path = make_qwen3_vl(tmp_path)
    proc = qwen_vl_processor(path)
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    text, idx = PROMPTS[2]
    enc = proc(text=[text], images=[[images[i] for i in idx]], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=N, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(path), progress=False, enable_prefix_caching=False)  # the second run computes the prompt again
    assert greedy(llm, images, PROMPTS[2:])[0].outputs[0].token_ids == ref
    lm = llm.engine.core.executor.runner.model.language_model
    inner = lm.forward
    lm.forward = lambda *a, deepstack=None, **kw: inner(*a, **kw)
    assert greedy(llm, images, PROMPTS[2:])[0].outputs[0].token_ids != ref


def test_mm_processor_kwargs_reach_the_image_processor(path, images):
    """--mm-processor-kwargs (vLLM's) go to the checkpoint's processor: a lower max_pixels gives fewer image
    tokens, as transformers' processor given the same."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    patch = Qwen2VLImageProcessorPil.from_pretrained(path).patch_size
    small = {"max_pixels": (2 * patch) ** 2 * 6}
    proc = qwen_vl_processor(path)
    proc.image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, **small)
    text, idx = PROMPTS[2]
    ref = proc(text=[text], images=[[images[i] for i in idx]], return_tensors="pt")["input_ids"][0].tolist()
    llm = LLM(str(path), progress=False, mm_processor_kwargs=small)
    out = greedy(llm, images, PROMPTS[2:])[0]
    assert out.prompt_token_ids == ref
    assert len(ref) < len(greedy(LLM(str(path), progress=False), images, PROMPTS[2:])[0].prompt_token_ids)


def test_qwen3_vl_moe_reads_transposed_experts():
    """The released Qwen3-VL-MoE checkpoints store each expert stack transposed (gate_up [E, H, 2I], down [E, I, H]);
    transformers' own layout passes as it is."""
    from types import SimpleNamespace

    from kestrel.models.qwen3_vl import Qwen3VLMoeForConditionalGeneration

    fake = SimpleNamespace(config=SimpleNamespace(hidden_size=8, moe_intermediate_size=3))
    e = 2
    gate_up, down = torch.randn(e, 6, 8), torch.randn(e, 8, 3)
    names = ["model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"]
    for stored in ([gate_up, down], [gate_up.transpose(1, 2), down.transpose(1, 2)]):
        out = list(Qwen3VLMoeForConditionalGeneration.text_weights(fake, zip(names, stored)))
        assert torch.equal(out[0][1], gate_up) and torch.equal(out[1][1], down)
