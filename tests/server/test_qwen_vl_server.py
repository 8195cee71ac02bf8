"""Qwen2.5-VL (M-RoPE positions computed in the frontend) through a real server and the `openai` client: a base64
image_url part, its images rendered on two render processes, gets the offline chat's text and prompt length; a
video_url part (a tiny mp4 made here) gets the offline chat's tokens for the frames PyAV decodes from it; more
images or videos than --limit-mm-per-prompt (vLLM's JSON form, per modality) get a 400 naming the limit, and an
undecodable video a 400 naming the part."""
from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import Server, http
from tests.mm_tiny import make_image, make_qwen2_5_vl
from tests.server.test_images import CH, data_url, image_message


@pytest.fixture(scope="module")
def qwen_vl(tmp_path_factory):
    return make_qwen2_5_vl(tmp_path_factory.mktemp("qwen_vl_server"))


@pytest.fixture(scope="module")
def server(qwen_vl, tmp_path_factory):
    s = Server(qwen_vl, tmp_path_factory.mktemp("qwen_vl_logs") / "server.log",
               extra=["--limit-mm-per-prompt", '{"image": 2, "video": 1}', "--image-render-processes", "2"]).wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def llm(qwen_vl):
    from kestrel import LLM

    return LLM(str(qwen_vl), progress=False)


def test_image_chat_matches_offline(server, llm):
    import openai

    from kestrel import SamplingParams

    images = [make_image(120, 70, seed=1), make_image(60, 150, seed=2)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    params = SamplingParams(temperature=0, max_tokens=12)
    texts = set()
    for img in images:
        got = client.chat.completions.create(model=model, messages=image_message(data_url(img)), max_tokens=12,
                                             temperature=0)
        offline = llm.chat(image_message(data_url(img)), params)[0]
        assert got.choices[0].message.content == offline.outputs[0].text
        assert got.usage.prompt_tokens == len(offline.prompt_token_ids)
        texts.add(offline.outputs[0].text)
    assert len(texts) == 2  # the images change the answer


def test_more_images_than_the_limit_get_400(server):
    part = {"type": "image_url", "image_url": {"url": data_url(make_image(40, 40, seed=3))}}
    status, body = http("POST", server.url + CH, {"messages": [{"role": "user", "content": [part] * 3}],
                                                  "max_tokens": 1})
    assert status == 400 and "at most 2" in str(body), body


def test_video_url_matches_offline(server, llm, qwen_vl):
    """A 4-frame mp4 at 2 fps as a data URL: the server's greedy tokens (and prompt length) are the offline chat's
    for the frames PyAV decodes from the same file, with its frame rate (Qwen2.5-VL's time positions read it)."""
    import openai

    from kestrel import SamplingParams
    from tests.frontend.test_video_url import decoded, mp4_bytes, video_data_url, video_parts

    pytest.importorskip("av")
    frames = np.random.default_rng(5).integers(0, 256, (4, 70, 100, 3), dtype=np.uint8)
    raw = mp4_bytes(frames, fps=2)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    got = client.chat.completions.create(model=client.models.list().data[0].id, messages=video_parts(
        video_data_url(raw)), max_tokens=10, temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    meta = {"fps": 2.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}
    offline = llm.chat([{"role": "user", "content": [{"type": "video", "video": (decoded(raw), meta)},
                                                     {"type": "text", "text": "what happens?"}]}],
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))[0]
    out = offline.outputs[0]
    assert [c.token for c in got.choices[0].logprobs.content] == [
        lp[t].decoded_token for t, lp in zip(out.token_ids, out.logprobs)]
    assert got.choices[0].message.content == out.text and got.usage.completion_tokens == len(out.token_ids) == 10
    assert got.usage.prompt_tokens == len(offline.prompt_token_ids)
    video_token = json.loads((qwen_vl / "config.json").read_text())["video_token_id"]
    assert offline.prompt_token_ids.count(video_token) == 2 * 4 * 8 // 4  # 4 frames -> 56 x 112: (2, 4, 8) / 2x2


def test_video_limits_and_undecodable_video_get_400(server):
    pytest.importorskip("av")
    from tests.frontend.test_video_url import frames, mp4_bytes, video_data_url, video_parts

    url = video_data_url(mp4_bytes(frames(2)))
    status, body = http("POST", server.url + CH, {"messages": video_parts(url, url), "max_tokens": 1})
    assert status == 400, body
    assert body["error"]["message"] == ("too many videos: at most 1 are allowed in one request "
                                        "(--limit-mm-per-prompt video: 1)") and body["error"]["param"] == (
        "messages[0].content[1]"), body
    status, body = http("POST", server.url + CH, {"messages": video_parts("data:video/mp4;base64,aGVsbG8="),
                                                  "max_tokens": 1})
    assert status == 400 and "cannot decode the video" in body["error"]["message"], body
    assert body["error"]["param"] == "messages[0].content[0].video_url" and body["error"]["type"] == (
        "invalid_request_error"), body
