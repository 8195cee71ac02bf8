"""Every tool-call and reasoning parser (issue 54) through a real server and the real openai client, whole and
streamed. A random model does not write any format by itself, so each request carries an EBNF grammar that
admits exactly one hand-written output in the parser's format (one call, several, none, a reasoning block): the
server generates it token by token, and the parsers read what came out, as they would a real model's."""
from __future__ import annotations

import json

import openai
import pytest

from conftest import Server
from tests.tiny import make_checkpoint

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
W = ("get_weather", {"city": "Paris", "days": 2})
T = ("get_time", {"tz": "CET"})

# (tool parser, reasoning parser, [(model output, reasoning, content, calls)])
CASES = [
    ("qwen3_coder", "qwen3", [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n"
         "</parameter>\n</function>\n</tool_call>", None, None, [W]),
        ("<think>\nTwo calls.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>"
         "\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
         "<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>", "\nTwo calls.\n", None, [W, T]),
        ("<think>\nNo tool.\n</think>\n\nIt is sunny.", "\nNo tool.\n", "\n\nIt is sunny.", []),
    ]),
    ("qwen3_xml", None, [
        ("Checking.\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>",
         None, "Checking.", [T]),
    ]),
    ("openai", "openai_gptoss", [
        ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
         'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|>',
         "Need the weather.", None, [W]),
        ("<|channel|>analysis<|message|>Both.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
         ' <|constrain|>json<|message|>{"city": "Paris", "days": 2}<|call|><|start|>assistant<|channel|>commentary '
         'to=functions.get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>', "Both.", None, [W, T]),
        ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.",
         "Easy.", "It is sunny.", []),
        ("<|channel|>final<|message|>It is sunny.", None, "It is sunny.", []),
    ]),
    ("mistral", "mistral", [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}', None, None, [W]),
        ('[THINK]Two.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]'
         '{"tz": "CET"}', "Two.", None, [W, T]),
        ('[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "CET"}}]', None, None, [T]),
        ("[THINK]Nothing to call.[/THINK]It is sunny.", "Nothing to call.", "It is sunny.", []),
    ]),
    ("pythonic", "seed_oss", [
        ('[get_weather(city="Paris", days=2), get_time(tz="CET")]', None, None, [W, T]),
        ("<seed:think>Plain.</seed:think>It is sunny.", "Plain.", "It is sunny.", []),
    ]),
    ("llama4_pythonic", "hunyuan_a13b", [
        ('<|python_start|>[get_time(tz="CET")]<|python_end|>', None, None, [T]),
        ("<think>\nPlain.\n</think>\n<answer>\nIt is sunny.\n</answer>", "Plain.", "It is sunny.", []),
    ]),
    ("deepseek_v31", "deepseek_v3", [
        ('Both.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris", "days": 2}'
         '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         "Both.", None, [W, T]),
        ("Sure.</think>It is sunny.", "Sure.", "It is sunny.", []),  # with {"thinking": true} (below)
    ]),
    ("deepseek_v3", "deepseek_r1", [
        ("Weather first.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Paris", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "Weather first.", None, [W]),
    ]),
    ("kimi_k2", "kimi_k2", [
        ("<think>Two.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
         '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>'
         'functions.get_time:1<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>',
         "Two.", None, [W, T]),
        ("<think>Plain.</think>It is sunny.", "Plain.", "It is sunny.", []),
    ]),
    ("glm45", "glm45", [
        ("<think>One.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
         "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>", "One.", None, [W]),
        ("<think>Plain.</think>It is sunny.", "Plain.", "It is sunny.", []),
    ]),
    ("minimax_m2", "minimax_m2", [
        ('Both.</think>\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
         '<parameter name="days">2</parameter>\n</invoke>\n<invoke name="get_time">\n<parameter name="tz">CET'
         "</parameter>\n</invoke>\n</minimax:tool_call>", "Both.", None, [W, T]),
        ("Plain.</think>It is sunny.", "Plain.", "It is sunny.", []),
    ]),
    ("granite", "granite", [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]', None, None, [W]),
        ("Here is my thought process: plain. Here is my response: It is sunny.", " plain. ", " It is sunny.", []),
    ]),
    ("hermes", "ernie45", [
        ('Weather.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
         "Weather.\n", None, [T]),
    ]),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_tokenizer):
    return make_checkpoint("llama", tmp_path_factory.mktemp("parsers_model"), tokenizer=tiny_tokenizer,
                           name="parsers-tiny", max_position_embeddings=2048)


def _grammar(text: str) -> dict:
    return {"structured_outputs": {"grammar": "root ::= " + json.dumps(text, ensure_ascii=False)}}


def _streamed(stream):
    parts, calls, finish = {"reasoning": "", "content": ""}, {}, None
    for chunk in stream:
        for ch in chunk.choices:
            parts["reasoning"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            parts["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][1] += d.function.arguments
            finish = ch.finish_reason or finish
    return parts, [(n, json.loads(a)) for n, a in (calls[k] for k in sorted(calls))], finish


@pytest.mark.parametrize("tool_parser, reasoning_parser, outputs", CASES, ids=[f"{t}+{r}" for t, r, _ in CASES])
def test_parser_through_the_server(model, tmp_path, tool_parser, reasoning_parser, outputs):
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser, "--max-model-len", "2048",
             "--num-kv-blocks", "200"] + (["--reasoning-parser", reasoning_parser] if reasoning_parser else [])
    server = Server(model, tmp_path / "server.log", flags).wait_ready()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        for text, reasoning, content, calls in outputs:
            kw = dict(model="parsers-tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
                      max_tokens=600, temperature=0, extra_body={**_grammar(text), "chat_template_kwargs": {
                          "thinking": True}})
            r = client.chat.completions.create(**kw)
            ch = r.choices[0]
            got = [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls or []]
            assert got == calls, (text, ch.message)
            assert all(c.id and c.type == "function" for c in ch.message.tool_calls or [])
            assert (ch.message.model_extra or {}).get("reasoning_content") == reasoning, ch.message
            assert (ch.message.content or None) == content, ch.message
            assert ch.finish_reason == ("tool_calls" if calls else "stop")
            parts, streamed, finish = _streamed(client.chat.completions.create(stream=True, **kw))
            assert streamed == calls and finish == ch.finish_reason, (text, parts)
            assert parts["reasoning"] == (reasoning or "")
            assert (parts["content"].strip() if calls else parts["content"]) == (content or ""), parts
    finally:
        client.close()
        server.stop()
