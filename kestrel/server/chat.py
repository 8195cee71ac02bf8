"""POST /v1/chat/completions: messages through the model's chat template."""
from __future__ import annotations

import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kestrel.frontend.outputs import Logprob
from kestrel.frontend.processor import ProcessedPrompt
from kestrel.server.common import (ServerState, beam_searches, client_of, final_outputs, json_logprob,
                                   prompt_logprobs_json, request_ids, sse_chunk, stream_error, unless_disconnected,
                                   usage_json)
from kestrel.server.openai_protocol import ChatCompletionRequest
from kestrel.server.tool_calls import MessageStream, build_message, plan_tools


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": json_logprob(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None, num: int, tokenizer) -> dict:
    content = []
    for t, d in zip(token_ids, entries or []):
        lp = d.get(t)
        text = (lp.decoded_token if lp is not None else None) or tokenizer.decode([t])
        item = _entry(text, lp.logprob if lp is not None else float("-inf"))
        top = sorted((v for v in d.values() if v.rank <= num), key=lambda v: v.rank)[:num]
        item["top_logprobs"] = [_entry(v.decoded_token or "", v.logprob) for v in top]
        content.append(item)
    return {"content": content}


async def render_prompt(state: ServerState, req, tools: list[dict] | None = None) -> list[int] | ProcessedPrompt | str:
    """messages -> the chat template's text -> token ids (the template already holds the special tokens); with
    image parts, the processed prompt (kestrel/frontend/media.py loads the images, the image processor expands them).
    Runs on a render thread: a huge conversation or a large image never stalls the event loop."""
    engine = state.engine
    template = state.chat_template(req)
    kwargs = {k: v for k, v in state.template_kwargs(req).items() if k != "chat_template"}
    if any(m.has_non_text_parts() for m in req.messages):
        from kestrel.frontend.media import resolve_image_parts

        parts = [m.as_parts() for m in req.messages]
        if engine.render_procs is not None:  # template, images and image processor in a render process
            return await engine.render_chat_images(parts, req.add_generation_prompt, template, kwargs, tools,
                                                   req.continue_final_message)

        def render_with_images() -> dict | str:
            messages = resolve_image_parts(parts, engine.config.multimodal)
            prompt = engine.input_processor.render_chat(messages, req.add_generation_prompt, template, kwargs, tools,
                                                        req.continue_final_message)
            return engine.input_processor.process_images(prompt)

        return await engine.run_tokenizer(render_with_images)
    messages = [m.as_dict() for m in req.messages]

    def render() -> list[int]:
        text = engine.input_processor.apply_chat_template(messages, req.add_generation_prompt, template, kwargs, tools,
                                                          req.continue_final_message)
        return engine.tokenizer.encode(text, add_special_tokens=False)

    return await engine.run_tokenizer(render)


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, raw: Request):
    lora = state.check_model(req.model)
    engine = state.engine
    plan = plan_tools(req.tools, req.tool_choice, state.tool_parser, state.enable_auto_tool_choice,
                      req.parallel_tool_calls)
    params = req.sampling_params(state.sampling_defaults, plan.structured)
    reasoning = plan.reasoning_for(state.reasoning_parser, state.template_kwargs(req), params)
    beam = req.beam_search_params(params.max_tokens, params)
    await state.grammar.check(params.structured_outputs, "tools" if plan.structured else req.constraint_param,
                              client_of(raw))
    params = await engine.tokenize_bad_words(params)  # on a render thread
    rid, public_id = request_ids("chatcmpl", req.request_id, raw)
    prompt_ids = await render_prompt(state, req, plan.tools)
    gen = (beam_searches(state, beam, [prompt_ids], rid, lora, req.logprobs, req)[0] if beam else
           engine.generate(prompt_ids, params, rid, req.priority, timeout=state.timeout(req), lora_request=lora,
                           stream=req.stream))
    created = int(time.time())
    if req.stream:
        return StreamingResponse(_stream(state, req, public_id, created, gen, plan, reasoning),
                                 media_type="text/event-stream")
    (out,) = await unless_disconnected(raw, final_outputs([gen]))
    choices = []
    echoed = req.echoed()
    for c in out.outputs:
        lp = chat_logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0, engine.tokenizer) if req.logprobs else None
        message, finish_reason = build_message(plan, reasoning, c.text, c.finish_reason)
        message["role"] = req.response_role
        if echoed:
            message["content"] = echoed + (message.get("content") or "")
        choices.append({"index": c.index, "message": message, "logprobs": lp, "finish_reason": finish_reason,
                        "stop_reason": c.stop_reason})
    p = len(out.prompt_token_ids)
    comp = sum(len(c.token_ids) for c in out.outputs)
    body = {"id": public_id, "object": "chat.completion", "created": created, "model": state.model_name,
            "choices": choices, "usage": usage_json(state, p, comp, out.num_cached_tokens)}
    if params.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs_json(out)
    return JSONResponse(body)


async def _stream(state: ServerState, req: ChatCompletionRequest, rid: str, created: int, gen,
                  plan, reasoning) -> AsyncIterator[str]:
    tok = state.engine.tokenizer

    def chunk(choices, usage=None):
        return sse_chunk(rid, "chat.completion.chunk", created, state.model_name, choices, usage)

    started: set[int] = set()
    done: set[int] = set()
    messages: dict[int, MessageStream] = {}
    echoed = req.echoed()
    last = None
    try:
        async for out in gen:
            last = out
            for c in out.outputs:
                if c.index in done:
                    continue
                if c.index not in started:
                    started.add(c.index)
                    messages[c.index] = MessageStream(plan, reasoning)
                    yield chunk([{"index": c.index, "delta": {"role": req.response_role, "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                    if echoed:
                        yield chunk([{"index": c.index, "delta": {"content": echoed}, "logprobs": None,
                                      "finish_reason": None}])
                if not c.text_delta and not c.token_ids_delta and c.finish_reason is None:
                    continue
                lp = (chat_logprobs(c.token_ids_delta, c.logprobs_delta, req.top_logprobs or 0, tok)
                      if req.logprobs else None)
                message = messages[c.index]
                delta = message.feed(c.text_delta, final=c.finish_reason is not None)
                if c.finish_reason is not None:
                    done.add(c.index)
                elif not delta and lp is None:
                    continue  # held back (a partial tag or call): nothing to send yet
                yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                              "finish_reason": message.finish_reason(c.finish_reason), "stop_reason": c.stop_reason}])
        if req.stream_options and req.stream_options.include_usage and last is not None:
            p = len(last.prompt_token_ids)
            comp = sum(len(c.token_ids) for c in last.outputs)
            yield chunk([], usage_json(state, p, comp, last.num_cached_tokens))
        yield "data: [DONE]\n\n"
    except Exception as e:
        yield stream_error(e)
