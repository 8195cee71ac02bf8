"""Video for GLM-4.xV (GLM-4.1V dense `glm4v`, GLM-4.5V `glm4v_moe`, the `glm46v` layout over either text model)
against transformers on tiny random checkpoints, CPU float32: transformers' Glm4vProcessor / Glm46VProcessor expands
the prompt (frame groups as image runs with their times, inside <|begin_of_video|> ... <|end_of_video|>) over
kestrel's torchvision-free video processor (kestrel/frontend/glm_video.py); the engine gives the same prompt ids,
get_rope_index's positions and the same greedy tokens for a 5-frame video sampled at 2 fps, PIL frames without
metadata beside an image, and frames already sampled (a video_url's, with their indices); chunked prefill through a
video keeps them. The frame sampling and the patch layout are checked against transformers' own functions (their
resize needs torchvision)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.frontend.glm_video import GlmVideoProcessor
from tests.mm_reference import assert_matches_reference, reference_model, video_inputs, video_request
from tests.mm_tiny import glm4v_processor, make_glm4v, make_image

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
VID = "<|begin_of_video|><|video|><|end_of_video|>"
IMG = "<|begin_of_image|><|image|><|end_of_image|>"
KINDS = ["glm4v", "glm4v_moe", "glm46v", "glm46v_dense"]


def videos():
    """(frames, metadata, sampled already): 5 frames of 70 x 100 at 2 fps (the processor samples them), 4 PIL
    frames of 90 x 60 without metadata (kept, at 24 fps), 6 frames of a 12-frame 4 fps video as video_url decodes."""
    rng = np.random.default_rng(0)
    first = (rng.integers(0, 256, (5, 70, 100, 3), dtype=np.uint8), {"fps": 2.0, "total_num_frames": 5}, False)
    second = ([make_image(60, 90, seed=20 + i) for i in range(4)], None, True)
    third = (rng.integers(0, 256, (6, 56, 84, 3), dtype=np.uint8),
             {"total_num_frames": 12, "fps": 4.0, "duration": 3.0, "frames_indices": [0, 2, 4, 6, 8, 11]}, True)
    return [first, second, third]


# (text, video index, with the image)
PROMPTS = [(f"watch {VID} what happens", 0, False), (f"{IMG} and then {VID} compare", 1, True), (f"{VID}", 2, False)]


@pytest.fixture(scope="module", params=KINDS)
def path(request, tmp_path_factory):
    return make_glm4v(tmp_path_factory.mktemp(request.param), request.param)


def request(text, v, with_image):
    return video_request(text, *videos()[v][:2], with_image)


@pytest.fixture(scope="module")
def reference(path):
    model = reference_model(path)
    proc = glm4v_processor(path, video=True)
    out = []
    for text, v, with_image in PROMPTS:
        frames, meta, sampled = videos()[v]
        enc = video_inputs(proc, text, frames, meta, with_image, do_sample_frames=not sampled)
        grids = {k: enc[k] for k in ("image_grid_thw", "video_grid_thw") if k in enc}
        positions, delta = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], **grids)
        if with_image:
            tokens = greedy_by_modality(model, enc, positions)
        else:
            tokens = model.generate(**enc, max_new_tokens=N, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
            assert greedy_by_modality(model, enc, positions) == tokens  # the stand-in agrees where both run
        out.append((enc["input_ids"][0].tolist(), tokens, positions, delta))
    return out


@torch.no_grad()
def greedy_by_modality(model, enc, positions) -> list[int]:
    """transformers' greedy tokens where its forward cannot take the prompt: with an image and a video in one prompt
    its placeholder masks are both every image token. Its own parts here: the image and video features put where
    the processor's mm_token_type_ids say, its decoder on those embeddings at get_rope_index's positions."""
    m = model.model
    embed = m.get_input_embeddings()
    x = embed(enc["input_ids"])
    types = enc["mm_token_type_ids"][0]
    if "pixel_values" in enc:
        x[0, types == 1] = torch.cat(m.get_image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output)
    x[0, types == 2] = torch.cat(m.get_video_features(enc["pixel_values_videos"],
                                                      enc["video_grid_thw"]).pooler_output)
    out = []
    for _ in range(N):
        hidden = m(inputs_embeds=x, position_ids=positions).last_hidden_state
        out.append(int(model.lm_head(hidden[0, -1]).argmax()))
        x = torch.cat([x, embed(torch.tensor([[out[-1]]]))], dim=1)
        positions = torch.cat([positions, positions.amax(dim=-1, keepdim=True) + 1], dim=-1)
    return out


def test_video_greedy_prompt_and_positions_match_transformers(path, reference):
    llm = LLM(str(path), progress=False)
    assert_matches_reference(llm, [request(*p) for p in PROMPTS], reference, GREEDY)
    assert len({tuple(r[1]) for r in reference}) == len(reference)
    tok = llm.engine.input_processor.mm.processor.tokenizer
    stamps = ["2.0 seconds", "1.0 seconds", "0.0 seconds"] if "glm46v" in str(path) else ["|>2<|", "|>1<|", "|>0<|"]
    assert all(s in tok.decode(reference[0][0]) for s in stamps)  # 6 frames (the last repeated): 3 groups


def test_chunked_prefill_through_a_video(path, reference):
    llm = LLM(str(path), progress=False, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert_matches_reference(llm, [request(*p) for p in PROMPTS], reference, GREEDY, chunked=True)


@pytest.fixture(scope="module")
def their_samplers():
    """transformers' sample_frames of Glm4vVideoProcessor and Glm46VVideoProcessor (the latter's module imports
    torchvision at the top: a stand-in module is there while it loads, and gone after)."""
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    parent = importlib.import_module("transformers.models.glm46v")
    cached = "video_processing_glm46v" in vars(parent)
    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("torchvision") is None:
            for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                         "torchvision.transforms.v2.functional"):
                mp.setitem(sys.modules, name, types.ModuleType(name))
        name = "transformers.models.glm46v.video_processing_glm46v"
        mp.delitem(sys.modules, name, raising=False)
        glm46v = importlib.import_module(name)
        mp.delitem(sys.modules, name)
    if not cached:  # the package forgets it too: transformers' own imports of it are as before
        vars(parent).pop("video_processing_glm46v", None)
    return {"glm4v": Glm4vVideoProcessor.sample_frames, "glm46v": glm46v.Glm46VVideoProcessor.sample_frames}


@pytest.mark.parametrize("style", ["glm4v", "glm46v"])
def test_frame_sampling_matches_transformers(style, their_samplers):
    from transformers.video_utils import VideoMetadata

    owner = SimpleNamespace(fps=2, max_duration=300, temporal_patch_size=2)
    ours = GlmVideoProcessor(style)
    cases = [(5, 2.0, None), (12, 4.0, 3.0), (90, 30.0, None), (31, 24.0, 1.3), (1, 1.0, None), (300, 29.97, None),
             (2000, 5.0, None), (40000, 10.0, 4000.0), (1000, 0.25, None)]
    for total, fps, duration in cases:
        theirs = their_samplers[style](owner, VideoMetadata(total, fps=fps, duration=duration)).tolist()
        given = {"total_num_frames": total, "fps": fps, "duration": duration}
        frames, meta = ours.sample(np.arange(total), ours.metadata(np.arange(total), given))
        assert meta.frames_indices == theirs == frames.tolist(), (total, fps, duration)


def test_patches_match_transformers_patchify():
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    video = torch.randn(5, 3, 56, 84)  # an odd frame count: the last frame repeated
    theirs, *grid = Glm4vVideoProcessor.patchify(None, video[None], patch_size=14, merge_size=2, temporal_patch_size=2)
    ours, our_grid = GlmVideoProcessor("glm4v").patchify(video)
    assert our_grid == grid == [3, 4, 6]
    assert torch.equal(ours, theirs[0])


def test_no_video_frame_larger_than_the_largest_image():
    """GLM's pixel budget covers all frames: two 3,200 x 3,200 frames would each get ~10.2M pixels, above the
    largest image (28 x 28 x 15000 = 11.76M is GLM-4.xV's, here 1M): the memory profile holds room for that image
    only, so a frame is held to it; without the cap the budget decides."""
    frames = np.zeros((2, 3200, 3200, 3), dtype=np.uint8)
    meta = [{"fps": 2.0, "total_num_frames": 2, "frames_indices": [0, 1]}]
    capped = GlmVideoProcessor("glm4v", frame_max_pixels=1_000_000)([frames], meta)
    t, h, w = capped["video_grid_thw"][0].tolist()
    assert h * 14 * w * 14 <= 1_000_000 and abs(h / w - 1) < 0.1
    free = GlmVideoProcessor("glm4v")([frames], meta)
    t2, h2, w2 = free["video_grid_thw"][0].tolist()
    assert h2 * 14 * w2 * 14 > 5_000_000
