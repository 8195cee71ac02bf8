"""Acceptance 2: every bad request gets a 4xx with the OpenAI error body naming what is wrong; the server keeps
serving afterwards. Each case runs against the shared server and its twin with n-gram speculation on (any_server,
issue 55)."""
from __future__ import annotations

import pytest

from conftest import http

C, CH = "/v1/completions", "/v1/chat/completions"
OK = {"prompt": "hello", "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

CASES = [
    # (id, path, body or raw bytes, status, param, words in the message)
    ("malformed_json", C, b'{"prompt": "x",', 400, None, "JSON"),
    ("not_json_object", C, b"[1, 2]", 400, None, "dictionary"),
    ("unknown_model", C, {**OK, "model": "gpt-17"}, 404, "model", "gpt-17"),
    ("prompt_too_long", C, {"prompt": [5] * 600, "max_tokens": 1}, 400, "prompt", "context"),
    ("prompt_missing", C, {"max_tokens": 2}, 400, "prompt", "required"),
    ("prompt_empty", C, {"prompt": [], "max_tokens": 2}, 400, "prompt", "empty"),
    ("prompt_bad_token_id", C, {"prompt": [1, 99999], "max_tokens": 2}, 400, "prompt", "token ids"),
    ("max_tokens_too_large", C, {**OK, "max_tokens": 100000}, 400, "max_tokens", "context"),
    ("max_tokens_negative", C, {**OK, "max_tokens": -3}, 400, "max_tokens", "at least 1"),
    ("max_tokens_wrong_type", C, {**OK, "max_tokens": "many"}, 400, "max_tokens", "integer"),
    ("n_zero", C, {**OK, "n": 0}, 400, "n", "at least 1"),
    ("best_of_below_n", C, {**OK, "n": 3, "best_of": 2}, 400, "best_of", "n"),
    ("temperature_negative", C, {**OK, "temperature": -0.5}, 400, "temperature", "non-negative"),
    ("temperature_wrong_type", C, {**OK, "temperature": "hot"}, 400, "temperature", "number"),
    ("top_p_zero", C, {**OK, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("top_p_above_one", C, {**OK, "top_p": 1.5}, 400, "top_p", "(0, 1]"),
    ("too_many_stop_strings", C, {**OK, "stop": [f"s{i}" for i in range(17)]}, 400, "stop", "at most"),
    ("stop_wrong_type", C, {**OK, "stop": 5}, 400, "stop", "string"),
    ("logprobs_too_many", C, {**OK, "logprobs": 50}, 400, "logprobs", "logprobs"),
    ("stream_wrong_type", C, {**OK, "stream": "maybe"}, 400, "stream", "boolean"),
    ("chat_messages_missing", CH, {"max_tokens": 2}, 400, "messages", "required"),
    ("chat_messages_empty", CH, {"messages": [], "max_tokens": 2}, 400, "messages", "at least 1"),
    ("chat_bad_role_type", CH, {"messages": [{"role": 3, "content": "x"}]}, 400, "messages", "string"),
    ("chat_unknown_model", CH, {"messages": MSG, "model": "nope"}, 404, "model", "nope"),
    ("chat_max_completion_tokens_neg", CH, {"messages": MSG, "max_completion_tokens": 0}, 400, "max_tokens",
     "at least 1"),
    ("chat_top_p", CH, {"messages": MSG, "top_p": 2}, 400, "top_p", "(0, 1]"),
    ("chat_top_logprobs_without_logprobs", CH, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs",
     "logprobs"),
    ("chat_prompt_too_long", CH, {"messages": [{"role": "user", "content": "stop " * 600}]}, 400, "prompt",
     "context"),
    ("detokenize_bad_ids", "/detokenize", {"tokens": [-1]}, 400, "tokens", "ids"),
    ("unknown_route", "/v1/nothing", {}, 404, None, "Not Found"),
    # issue 17: numbers that are not numbers, integers beyond 64 bits, invalid Unicode, booleans as tokens
    ("temperature_nan", C, b'{"prompt": "hi", "max_tokens": 2, "temperature": NaN}', 400, "temperature", "finite"),
    ("top_p_inf", C, b'{"prompt": "hi", "max_tokens": 2, "top_p": Infinity}', 400, "top_p", "finite"),
    ("presence_penalty_neg_inf", C, b'{"prompt": "hi", "presence_penalty": -Infinity}', 400, "presence_penalty",
     "finite"),
    ("repetition_penalty_nan", CH, b'{"messages": [{"role": "user", "content": "x"}], "repetition_penalty": NaN}',
     400, "repetition_penalty", "finite"),
    ("seed_beyond_64_bits", C, {**OK, "seed": 2**70}, 400, "seed", "less than or equal"),
    ("priority_beyond_64_bits", C, {**OK, "priority": -(2**64)}, 400, "priority", "greater than or equal"),
    ("top_k_beyond_64_bits", C, {**OK, "top_k": 2**64}, 400, "top_k", "less than or equal"),
    ("prompt_lone_surrogate", C, b'{"prompt": "a\\ud800b", "max_tokens": 2}', 400, "prompt", "surrogate"),
    ("chat_lone_surrogate", CH, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "messages",
     "surrogate"),
    ("stop_lone_surrogate", C, b'{"prompt": "hi", "stop": ["\\ud83d"]}', 400, "stop", "surrogate"),
    ("prompt_of_booleans", C, {"prompt": [True, False], "max_tokens": 2}, 400, "prompt", "valid"),
    ("stop_token_ids_booleans", C, {**OK, "stop_token_ids": [True]}, 400, "stop_token_ids", "integer"),
    ("chat_template_kwargs_duplicate", CH, {"messages": MSG, "chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs", "add_generation_prompt"),
    ("chat_template_kwargs_tokenize", CH, {"messages": MSG, "chat_template_kwargs": {"tokenize": True}}, 400,
     "chat_template_kwargs", "tokenize"),
    ("request_id_too_long", C, {**OK, "request_id": "x" * 257}, 400, "request_id", "256"),
    ("timeout_zero", C, {**OK, "timeout": 0}, 400, "timeout", "greater than 0"),
    ("prompt_logprobs_streaming", C, {**OK, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", "stream"),
    ("prompt_logprobs_too_many", C, {**OK, "prompt_logprobs": 21}, 400, "prompt_logprobs", "max-logprobs"),
    # issue 33: were 500s or wrong acceptances
    ("assistant_tool_call_function_string", CH, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": "get_weather"}]}, *MSG]}, 400, "messages", "function"),
    ("assistant_tool_call_function_int", CH, {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": 7}]}, *MSG]}, 400, "messages", "function"),
    ("assistant_tool_call_not_object", CH, {"messages": [{"role": "assistant", "tool_calls": ["call"]}, *MSG]},
     400, "messages", "tool_calls"),
    ("tool_choice_function_not_object", CH, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": "f"}}, 400, "tool_choice", "name"),
    ("stream_yes", C, {**OK, "stream": "yes"}, 400, "stream", "boolean"),
    ("echo_string_true", C, {**OK, "echo": "true"}, 400, "echo", "boolean"),
    ("chat_logprobs_int", CH, {"messages": MSG, "logprobs": 1}, 400, "logprobs", "boolean"),
    ("json_schema_remote_ref", C, {**OK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "https://example.com/s.json"}}}}, 400, "response_format", "$ref"),
    # parameters Kestrel does not implement: refused by name, never silently ignored
    ("guided_decoding_backend", C, {**OK, "guided_decoding_backend": "outlines"}, 400, "guided_decoding_backend",
     "not supported"),
    ("functions", CH, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions", "not supported"),
    ("use_beam_search_with_logit_bias", C, {**OK, "use_beam_search": True, "logit_bias": {"5": 1}}, 400,
     "use_beam_search", "logit changes"),
    ("use_beam_search_with_truncation", C, {**OK, "use_beam_search": True, "truncate_prompt_tokens": 4}, 400,
     "use_beam_search", "truncate_prompt_tokens"),
    # the sampling extras' bad values (issue 36)
    ("chat_continue_final_message_with_generation_prompt", CH, {"messages": MSG, "continue_final_message": True},
     400, "continue_final_message", "add_generation_prompt"),
    ("chat_echo_string", CH, {"messages": MSG, "echo": "yes"}, 400, "echo", "boolean"),
    ("logit_bias_key_not_int", C, {**OK, "logit_bias": {"the": 10}}, 400, "logit_bias", "integers"),
    ("logit_bias_out_of_vocab", C, {**OK, "logit_bias": {"100000": 10}}, 400, "logit_bias", "outside the vocabulary"),
    ("logit_bias_negative_id", CH, {"messages": MSG, "logit_bias": {"-3": 1}}, 400, "logit_bias", "outside"),
    ("logit_bias_value_string", C, {**OK, "logit_bias": {"5": "high"}}, 400, "logit_bias", "number"),
    ("allowed_token_ids_empty", C, {**OK, "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty"),
    ("allowed_token_ids_out_of_vocab", CH, {"messages": MSG, "allowed_token_ids": [1, 99999]}, 400,
     "allowed_token_ids", "token ids in [0, 384)"),
    ("bad_words_empty_word", C, {**OK, "bad_words": ["fox", " "]}, 400, "bad_words", "non-empty"),
    ("suffix", C, {**OK, "suffix": "end"}, 400, "suffix", "not supported"),
]


@pytest.mark.parametrize("path,body,status,param,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_request(any_server, path, body, status, param, words):
    raw = body if isinstance(body, bytes) else None
    s, resp = http("POST", any_server.url + path, None if raw else body, raw=raw)
    assert s == status, resp
    assert set(resp) == {"error"} and set(resp["error"]) == {"message", "type", "param", "code"}, resp
    err = resp["error"]
    assert err["param"] == param, err
    assert words.lower() in err["message"].lower(), err
    assert err["type"] in ("invalid_request_error", "not_found_error")


def test_still_serving_after_bad_requests(any_server):
    s, r = http("POST", any_server.url + C, {**OK, "unknown_extra_field": {"x": 1}})
    assert s == 200 and r["usage"]["completion_tokens"] >= 1
    # the neutral values of unsupported parameters are accepted (clients send them by default)
    s, r = http("POST", any_server.url + CH, {"messages": MSG, "max_tokens": 2, "response_format": {"type": "text"},
                                          "tools": [], "tool_choice": "none", "use_beam_search": False})
    assert s == 200, r
    s, r = http("POST", any_server.url + CH, {"messages": MSG, "max_tokens": 2})
    assert s == 200 and r["choices"][0]["message"]["role"] == "assistant"
    # a well-formed assistant tool call (arguments as JSON text or an object) still renders
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
             {"id": "c2", "type": "function", "function": {"name": "g", "arguments": {"b": 2}}}]
    s, r = http("POST", any_server.url + CH, {"messages": [*MSG, {"role": "assistant", "tool_calls": calls}, *MSG],
                                          "max_tokens": 2})
    assert s == 200, r


def test_tokenize_with_an_image_answers_like_chat(any_server):
    """A text-only model: an image message is the chat route's 400 (before: a 500)."""
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, "PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    msg = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                        {"type": "image_url", "image_url": {"url": url}}]}]
    s, r = http("POST", any_server.url + "/tokenize", {"messages": msg})
    s2, r2 = http("POST", any_server.url + CH, {"messages": msg, "max_tokens": 2})
    assert s == s2 == 400 and r["error"] == r2["error"] and "images" in r["error"]["message"], (r, r2)


def test_video_url_on_a_text_model_gets_400(server):
    """A text-only model: a video_url part is a 400 saying it takes no videos, on /tokenize as on chat (issue 52)."""
    pytest.importorskip("av")
    from tests.frontend.test_video_url import frames, mp4_bytes, video_data_url, video_parts

    msg = video_parts(video_data_url(mp4_bytes(frames(2))))
    s, r = http("POST", server.url + "/tokenize", {"messages": msg})
    s2, r2 = http("POST", server.url + CH, {"messages": msg, "max_tokens": 2})
    assert s == s2 == 400 and r["error"] == r2["error"] and "does not take videos" in r["error"]["message"], (r, r2)
