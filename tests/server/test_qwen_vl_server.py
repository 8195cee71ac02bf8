"""Qwen2.5-VL (M-RoPE positions computed in the frontend) through a real server and the `openai` client: a base64
image_url part, its images rendered on two render processes, gets the offline chat's text and prompt length; more
images than --limit-mm-per-prompt get a 400 naming the limit."""
from __future__ import annotations

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
               extra=["--limit-mm-per-prompt", "2", "--image-render-processes", "2"]).wait_ready()
    yield s
    s.stop()


def test_image_chat_matches_offline(server, qwen_vl):
    import openai

    from kestrel import LLM, SamplingParams

    images = [make_image(120, 70, seed=1), make_image(60, 150, seed=2)]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    model = client.models.list().data[0].id
    llm = LLM(str(qwen_vl), progress=False)
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
