"""Images through the OpenAI chat API on a real server (tiny LLaVA-NeXT), with the images on two render processes
and, once more, on three render threads in the server process: the `openai` client's base64 image gets the offline
API's text; concurrent image requests get what they get one at a time; bad images, disallowed URLs and too many
images get a 400 naming the content part, and the engine serves a normal request right after; a render process
that dies is replaced and image requests are served again. The Responses API's input_image parts too."""
from __future__ import annotations

import base64
import io
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import Server, http
from tests.mm_tiny import sample_images

CH = "/v1/chat/completions"


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(img)).decode()


def image_message(url: str, text: str = "what is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "cat.png").write_bytes(png_bytes(sample_images()[1]))
    return d


@pytest.fixture(scope="module", params=[2, 0], ids=["render_processes", "render_threads"])
def mm_server(request, tiny_mm_models, media_dir, tmp_path_factory):
    s = Server(tiny_mm_models["llava_next"], tmp_path_factory.mktemp("mm_logs") / "server.log",
               extra=["--limit-mm-per-prompt", "2", "--allowed-local-media-path", str(media_dir),
                      "--allowed-media-domains", "images.example.org", "--renderer-num-workers", "3",
                      "--image-render-processes", str(request.param)]).wait_ready()
    s.render_processes = request.param
    yield s
    s.stop()


def render_pids(server) -> dict[int, int]:
    """Render process index -> its latest pid, from the "render process N ready (pid P)" log lines."""
    server.log.flush()
    return {int(m.group(1)): int(m.group(2))
            for m in re.finditer(r"render process (\d+) ready \(pid (\d+)\)", server.log_path.read_text())}


def test_openai_client_image_matches_offline(mm_server, tiny_mm_models, media_dir):
    import openai

    from kestrel import LLM, SamplingParams

    img = sample_images()[0]
    client = openai.OpenAI(base_url=mm_server.url + "/v1", api_key="x")
    got = client.chat.completions.create(model=None or client.models.list().data[0].id,
                                         messages=image_message(data_url(img)), max_tokens=12, temperature=0)
    local = client.chat.completions.create(model=client.models.list().data[0].id,
                                           messages=image_message(f"file://{media_dir / 'cat.png'}"), max_tokens=12,
                                           temperature=0)
    llm = LLM(str(tiny_mm_models["llava_next"]), progress=False, num_kv_blocks=96, max_model_len=512)
    params = SamplingParams(temperature=0, max_tokens=12)
    offline = llm.chat(image_message(data_url(img)), params)[0]
    offline_pil = llm.chat([{"role": "user", "content": [{"type": "image", "image": sample_images()[1]},
                                                         {"type": "text", "text": "what is this?"}]}], params)[0]
    assert got.choices[0].message.content == offline.outputs[0].text
    assert local.choices[0].message.content == offline_pil.outputs[0].text
    assert got.usage.prompt_tokens == len(offline.prompt_token_ids) > 40  # the image's placeholders
    assert offline.outputs[0].text != offline_pil.outputs[0].text


def test_responses_input_image(mm_server):
    """The Responses API's input_image part (image_url: a data URL) gets the chat API's answer to the same image."""
    import openai

    client = openai.OpenAI(base_url=mm_server.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    url = data_url(sample_images()[0])
    chat = client.chat.completions.create(model=model, messages=image_message(url), max_tokens=8, temperature=0)
    res = client.responses.create(model=model, max_output_tokens=8, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": url, "detail": "auto"}, {"type": "input_text", "text": "what is this?"}]}])
    assert res.output_text == chat.choices[0].message.content
    assert res.usage.input_tokens == chat.usage.prompt_tokens > 40  # the image's placeholders


def test_concurrent_image_requests_on_render_threads(mm_server):
    """Three render threads process images at once, each with its own processor copy: the greedy answers (and prompt
    lengths) of 9 concurrent requests equal those of the same requests sent one after another."""
    from tests.mm_tiny import make_image

    images = [make_image(w, h, seed=10 + i) for i, (w, h) in enumerate([(64, 48), (40, 80), (96, 96)] * 3)]
    texts = [f"describe picture {i}" for i in range(len(images))]

    def ask(i):
        status, body = http("POST", mm_server.url + CH, {"messages": image_message(data_url(images[i]), texts[i]),
                                                         "max_tokens": 8, "temperature": 0})
        assert status == 200, body
        return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens"]

    ready = ("2 render process(es) ready for images" if mm_server.render_processes else
             "3 render thread(s) ready for images")
    assert ready in mm_server.log_path.read_text()  # warmed up before serving
    one_by_one = [ask(i) for i in range(len(images))]
    with ThreadPoolExecutor(len(images)) as pool:
        together = list(pool.map(ask, range(len(images))))
    assert together == one_by_one
    assert len({n for _, n in one_by_one}) > 1  # the image sizes give different placeholder counts


def test_tokenize_with_an_image_counts_like_chat(mm_server):
    """Issue 33: /tokenize with an image message was a 500; it gives the chat prompt's ids, placeholders included."""
    msg = image_message(data_url(sample_images()[0]))
    status, tok = http("POST", mm_server.url + "/tokenize", {"messages": msg})
    assert status == 200, tok
    status, body = http("POST", mm_server.url + CH, {"messages": msg, "max_tokens": 1})
    assert status == 200 and tok["count"] == len(tok["tokens"]) == body["usage"]["prompt_tokens"] > 40


BAD = [
    # (id, content parts, status, param, words in the message)
    ("undecodable", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}],
     "messages[0].content[0].image_url", "decode"),
    ("bad_base64", [{"type": "text", "text": "x"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}],
     "messages[0].content[1].image_url", "base64"),
    ("remote_not_allowed", [{"type": "image_url", "image_url": {"url": "https://evil.example.com/a.png"}}],
     "messages[0].content[0].image_url", "not allowed"),
    ("remote_allowed_but_unreachable", [{"type": "image_url", "image_url": {"url": "http://images.example.org/a.png"}}],
     "messages[0].content[0].image_url", "cannot fetch"),
    ("local_outside_folder", [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
     "messages[0].content[0].image_url", "outside"),
    ("too_many", [{"type": "image_url", "image_url": {"url": "file:///x"}}] * 3, "messages[0].content[2]", "at most"),
    ("unknown_part", [{"type": "input_audio", "input_audio": {}}], "messages[0].content[0]", "not supported"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_images_get_400(mm_server, media_dir, case):
    _, parts, param, words = case
    parts = [p if p.get("image_url", {}).get("url") != "file:///x" else
             {"type": "image_url", "image_url": {"url": f"file://{media_dir / 'cat.png'}"}} for p in parts]
    status, body = http("POST", mm_server.url + CH, {"messages": [{"role": "user", "content": parts}],
                                                     "max_tokens": 2})
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and words in err["message"], err
    assert set(err) == {"message", "type", "param", "code"}


def test_oversized_image_and_then_a_normal_request(mm_server):
    from PIL import Image

    big = Image.new("RGB", (5000, 4000), (200, 10, 10))  # 20 M pixels > the 16 M default, a small PNG
    status, body = http("POST", mm_server.url + CH, {"messages": image_message(data_url(big)), "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "messages[0].content[0].image_url"
    assert "exceeds" in body["error"]["message"]
    status, body = http("POST", mm_server.url + CH, {"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": 3, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 3
    status, body = http("POST", mm_server.url + CH, {"messages": image_message(data_url(sample_images()[2])),
                                                     "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_dead_render_process_is_replaced(mm_server):
    """SIGKILL one render process: it is started again (a new pid) and image requests are served as before."""
    if not mm_server.render_processes:
        pytest.skip("the render-thread server has no render processes")
    img = data_url(sample_images()[0])
    status, body = http("POST", mm_server.url + CH, {"messages": image_message(img), "max_tokens": 4,
                                                     "temperature": 0})
    assert status == 200, body
    before = render_pids(mm_server)
    assert len(before) == 2
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while render_pids(mm_server).get(0) == before[0] and time.monotonic() < deadline:
        time.sleep(0.3)
    assert render_pids(mm_server)[0] != before[0]
    assert "render process 0 died" in mm_server.log_path.read_text()
    for _ in range(4):  # both processes serve again (the least busy one takes each request)
        status, again = http("POST", mm_server.url + CH, {"messages": image_message(img), "max_tokens": 4,
                                                          "temperature": 0})
        assert status == 200, again
        assert again["choices"][0]["message"]["content"] == body["choices"][0]["message"]["content"]


def test_video_url_on_a_model_without_video_gets_400(mm_server):
    """LLaVA-NeXT takes images only: a well-formed video_url is refused naming the model (issue 52)."""
    pytest.importorskip("av")
    from tests.frontend.test_video_url import frames, mp4_bytes, video_data_url, video_parts

    status, body = http("POST", mm_server.url + CH, {"messages": video_parts(video_data_url(mp4_bytes(frames(2)))),
                                                     "max_tokens": 2})
    assert status == 400, body
    assert "LlavaNextForConditionalGeneration does not take videos" in body["error"]["message"], body
