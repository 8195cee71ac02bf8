"""Video for Qwen2.5-VL and Qwen3-VL (vLLM's `multi_modal_data={"video": frames}`) against transformers on tiny random
checkpoints, CPU float32: a 4-frame video (an array [T, H, W, 3], or a list of PIL frames with vLLM's metadata)
gives transformers' processor's prompt ids (Qwen3-VL's per-frame-group timestamps included) and M-RoPE positions
(Qwen2.5-VL's time row spaced by seconds per frame group x tokens_per_second) and transformers' greedy tokens;
chunked prefill through a video keeps them. The pixels come from kestrel/frontend/qwen_video.py (transformers' video
processors need torchvision); where torchvision is installed they are checked against transformers' own."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.mm_reference import assert_matches_reference, reference_model, video_inputs, video_request
from tests.mm_tiny import make_image, make_qwen2_5_vl, make_qwen3_vl, qwen_vl_processor

N = 16
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
VID = "<|vision_start|><|video_pad|><|vision_end|>"
IMG = "<|vision_start|><|image_pad|><|vision_end|>"
MAKERS = {"qwen2_5_vl": make_qwen2_5_vl, "qwen3_vl": make_qwen3_vl}


def videos():
    """Two 4-frame videos: an array of 70 x 100 frames at 2 fps (Qwen2.5-VL: one second per frame group) and PIL
    frames of 90 x 60 with no metadata (24 fps, transformers' assumption)."""
    rng = np.random.default_rng(0)
    first = (rng.integers(0, 256, (4, 70, 100, 3), dtype=np.uint8), {"fps": 2.0})
    second = ([make_image(60, 90, seed=20 + i) for i in range(4)], None)
    return [first, second]


# (text, video index, image index or None)
PROMPTS = [(f"watch {VID} what happens", 0, None), (f"{IMG} and then {VID} compare", 1, 0)]


@pytest.fixture(scope="module", params=list(MAKERS))
def path(request, tmp_path_factory):
    return MAKERS[request.param](tmp_path_factory.mktemp(request.param))


def request(text, v, i):
    return video_request(text, *videos()[v], i is not None)


@pytest.fixture(scope="module")
def reference(path):
    model = reference_model(path)
    proc = qwen_vl_processor(path, video=True)
    out = []
    for text, v, i in PROMPTS:
        enc = video_inputs(proc, text, *videos()[v], i is not None)
        seq = model.generate(**enc, max_new_tokens=N, do_sample=False)
        rope = {k: enc[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in enc}
        positions, delta = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"], **rope)
        out.append((enc["input_ids"][0].tolist(), seq[0, enc["input_ids"].shape[1]:].tolist(), positions, delta))
    return out


def test_video_greedy_prompt_and_positions_match_transformers(path, reference):
    llm = LLM(str(path), progress=False)
    assert_matches_reference(llm, [request(*p) for p in PROMPTS], reference, GREEDY)
    assert reference[0][1] != reference[1][1]
    if "qwen2_5" in str(path):  # one second per frame group: the time row steps by tokens_per_second (4)
        ids = torch.tensor(reference[0][0])
        times = reference[0][2][0, 0][ids == llm.engine.input_processor.mm.hf_config.video_token_id]
        assert sorted(set((times - times.min()).tolist())) == [0, 4]


def test_chunked_prefill_through_a_video(path, reference):
    llm = LLM(str(path), progress=False, max_num_batched_tokens=8, enable_prefix_caching=False)
    assert_matches_reference(llm, [request(*p) for p in PROMPTS], reference, GREEDY, chunked=True)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="transformers' video processors need torchvision")
def test_video_pixels_match_transformers_video_processor(path):  # pragma: no cover - needs torchvision
    from transformers import AutoVideoProcessor

    import json

    from kestrel.frontend.qwen_video import QwenVideoProcessor
    from tests.mm_tiny import VIDEO_STYLES

    kind = json.loads((path / "config.json").read_text())["model_type"]
    theirs = AutoVideoProcessor.from_pretrained(path)
    ours = QwenVideoProcessor.from_pretrained(str(path), VIDEO_STYLES[kind])
    for frames, meta in videos():
        kw = {"video_metadata": [meta]} if meta else {}
        a = theirs([frames], return_tensors="pt", return_metadata=True, **kw)
        b = ours([frames], **kw)
        assert torch.equal(a["video_grid_thw"], b["video_grid_thw"])
        torch.testing.assert_close(a["pixel_values_videos"], b["pixel_values_videos"], atol=2e-2, rtol=0)


def test_chat_with_a_video(path):
    """A chat message's video part: the template's video token, expanded as transformers' processor does."""
    frames, meta = videos()[0]
    llm = LLM(str(path), progress=False)
    out = llm.chat([{"role": "user", "content": [{"type": "video", "video": frames},
                                                  {"type": "text", "text": "what happens"}]}],
                   SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    text = f"<|im_start|>user\n{VID}what happens<|im_end|>\n<|im_start|>assistant\n"
    ref = qwen_vl_processor(path, video=True)(text=[text], videos=[frames], return_tensors="pt")
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()
    if importlib.util.find_spec("av") is None:
        return
    # a video_url part (issue 52): 12 frames at 4 fps, 6 kept as vLLM samples them (--media-io-kwargs num_frames),
    # expanded as transformers expands those frames with their metadata (Qwen3-VL's timestamps read the indices)
    from kestrel.frontend.media import resolve_image_parts
    from tests.frontend.test_video_url import decoded, mp4_bytes, video_data_url

    raw = mp4_bytes(np.random.default_rng(3).integers(0, 256, (12, 56, 84, 3), dtype=np.uint8), fps=4)
    msg = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_data_url(raw)}},
                                        {"type": "text", "text": "what happens"}]}]
    llm.config.multimodal.media_io_kwargs = {"video": {"num_frames": 6}}
    (part,) = resolve_image_parts(msg, llm.config.multimodal)[0]["content"][:1]
    idx = [0, 2, 4, 6, 8, 11]
    assert part["video"][1] == {"total_num_frames": 12, "fps": 4.0, "duration": 3.0, "frames_indices": idx}
    out = llm.chat(msg, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    ref = qwen_vl_processor(path, video=True)(text=[text], videos=[decoded(raw)[idx]], return_tensors="pt",
                                              video_metadata=[part["video"][1]], do_sample_frames=False)
    assert out.prompt_token_ids == ref["input_ids"][0].tolist()


def test_prefix_cache_hit_on_a_repeated_video(path, reference):
    llm = LLM(str(path), progress=False, block_size=4)
    first = llm.generate([request(*PROMPTS[0])], GREEDY)[0]
    again = llm.generate([request(*PROMPTS[0])], GREEDY)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == reference[0][1]
    assert again.num_cached_tokens >= len(reference[0][0]) - 4
    other = llm.generate([request(PROMPTS[0][0], 1, None)], GREEDY)[0]  # another video in the same place: no hit
    first_frame = reference[0][0].index(llm.engine.input_processor.mm.hf_config.video_token_id)  # past its start
    assert other.num_cached_tokens <= first_frame


def test_video_processor_settings_and_sampling(tmp_path):
    """Settings as transformers reads them (a checkpoint with only preprocessor_config.json: the image processor's
    min/max_pixels bound Qwen2-VL's frames too); Qwen3-VL's sampling: 2 frames a second of the source, at least 4,
    evenly spaced with both ends (8 frames at 24 fps -> frames 0, 2, 5, 7)."""
    import json

    from kestrel.frontend.qwen_video import QwenVideoProcessor

    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 3136, "max_pixels": 12845056,
                                                                   "patch_size": 14}))
    proc = QwenVideoProcessor.from_pretrained(str(tmp_path), "qwen2_vl")
    assert proc.size == {"shortest_edge": 3136, "longest_edge": 12845056} and proc.patch_size == 14
    qwen3 = QwenVideoProcessor("qwen3_vl", size={"shortest_edge": 32 * 32 * 4, "longest_edge": 32 * 32 * 64})
    out = qwen3([np.zeros((8, 64, 64, 3), dtype=np.uint8)])
    assert out["video_metadata"][0].frames_indices == [0, 2, 5, 7]
    assert out["video_grid_thw"].tolist() == [[2, 4, 4]]
    given = qwen3([np.zeros((8, 64, 64, 3), dtype=np.uint8)], video_metadata=[{"fps": 2.0, "frames_indices":
                                                                               list(range(0, 16, 2))}])
    assert given["video_grid_thw"].tolist() == [[4, 4, 4]]  # frames sampled already: all kept
