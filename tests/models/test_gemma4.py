"""Gemma 4 text against transformers 5.17 on the same tiny weights (CPU, float32): greedy tokens identical for 24
tokens on mixed-length prompts (longer than the sliding window), in one batch and again with chunked prefill and
preemption forced (asserted to have happened), for four checkpoints: K = V on the global layers with per-layer head
shapes, the 26B-A4B-like MoE block beside the MLP, E2B-like per-layer inputs, and KV shared across layers (the
readers on their sources' groups); each asserted to have been built with its option. The text part of a
Gemma4ForConditionalGeneration checkpoint: towers skipped with one log line, images and audio refused by name."""
import logging

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.core.kv_spec import FullAttentionSpec, SharedKVSpec, SlidingWindowSpec, group_layers
from kestrel.errors import ConfigError, InvalidRequest
from tests.agreement import assert_embedding_contract, hf_greedy
from tests.tiny import GEMMA4_CONFIGS, gemma4_vl_checkpoint, make_checkpoint

NUM_TOKENS = 24
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206, 300, 301],
           [77]]
SHARED = [(7 * i + 3) % 200 + 20 for i in range(30)]  # a 30-token shared prefix (7.5 blocks of 4)
FIRST, SECOND = SHARED + [11, 12, 13], SHARED + [300, 301, 302, 303, 304]


@pytest.fixture(scope="module", params=sorted(GEMMA4_CONFIGS))
def case(request, tmp_path_factory, tiny_tokenizer):
    """(kind, checkpoint, transformers' tokens per prompt)."""
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), tokenizer=tiny_tokenizer)
    prompts = [*PROMPTS, FIRST, SECOND]
    return request.param, path, dict(zip(map(tuple, prompts), hf_greedy(path, prompts, NUM_TOKENS)))


def params():
    return SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def check_built(kind, runner):
    """The option each checkpoint exercises, read from the built model and its KV groups."""
    model, groups = runner.model, runner.kv_cache_groups
    by_kind = {type(g.spec): g.spec for g in groups}
    assert (by_kind[FullAttentionSpec].head_dim, by_kind[SlidingWindowSpec].head_dim) == (32, 16)
    attn = [layer.self_attn.attn for layer in model.layers]
    assert all(a.scale == 1.0 and a.rotary.rot_dim == a.head_dim for a in attn)
    assert sum(a.rotary.cos_sin_cache[5, :16].eq(1.0).sum().item() for a in attn[1:2]) == 12  # 3/4 of 16 angles
    assert all(float(layer.layer_scalar) != 1.0 for layer in model.layers)
    if kind in ("gemma4_k_eq_v", "gemma4_moe"):
        assert [a.k_eq_v for a in attn] == [False, True, False, True]
        assert by_kind[FullAttentionSpec].num_kv_heads == 1 and by_kind[SlidingWindowSpec].num_kv_heads == 2
        assert model.layers[1].self_attn.qkv_proj.spec.output_sizes == (4 * 32, 32)  # q | k, no v
    if kind == "gemma4_moe":
        moe = model.layers[0].moe
        assert moe.experts.spec.activation == "gelu" and moe.gate.cfg.input_norm and moe.gate.cfg.per_expert_scale
        assert moe.gate.per_expert_scale.std() > 0 and moe.gate.scale.std() > 0  # loaded, not the init
    if kind in ("gemma4_e2b", "gemma4_kv_shared"):
        assert model.per_layer_inputs is not None and model.embed_tokens_per_layer.weight.shape == (384, 4 * 16)
    if kind == "gemma4_kv_shared":
        readers = {r: s for g in groups for r, s in g.readers.items()}
        assert readers == {"model.layers.2.self_attn.attn": "model.layers.0.self_attn.attn",
                           "model.layers.3.self_attn.attn": "model.layers.1.self_attn.attn"}
        assert attn[2].kv_cache[0] is attn[0].kv_cache[0] and attn[3].kv_cache[1] is attn[1].kv_cache[1]
        assert sum(len(g.layer_names) for g in groups) == 2  # the readers keep no cache
        assert [layer.mlp.down_proj.spec.input_size for layer in model.layers] == [128, 128, 256, 256]


def test_greedy_matches_transformers(case):
    kind, path, reference = case
    llm = LLM(str(path), progress=False, max_model_len=256)
    outs = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
    check_built(kind, llm.engine.core.executor.runner)


def test_chunked_prefill_preemption_and_prefix_hit(case):
    """Block 4, 8 tokens a step (every prompt but two cut into chunks) and a small pool (preemption); SECOND hits
    FIRST's shared prefix in the prefix cache."""
    kind, path, reference = case
    llm = LLM(str(path), progress=False, max_model_len=256, block_size=4, num_kv_blocks=40,
              max_num_batched_tokens=8, max_num_seqs=4)
    core = llm.engine.core
    prompts = [FIRST, SECOND, *PROMPTS]
    outs = llm.generate(prompts, params())
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in prompts]
    assert core.scheduler.num_preemptions > 0
    assert outs[1].num_cached_tokens >= 24 and core.kv.prefix_hits > 0


def test_embedding_contract(case):
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)): the per-layer inputs come from the
    ids and the embeddings alike."""
    assert_embedding_contract(case[1])


def test_vl_checkpoint_text_part(tmp_path, tiny_tokenizer, caplog):
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    path = gemma4_vl_checkpoint(tmp_path, tokenizer=tiny_tokenizer)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    reference = [hf.generate(torch.tensor([p]), max_new_tokens=NUM_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    placeholders = {hf.config.image_token_id, hf.config.video_token_id, hf.config.audio_token_id}
    assert placeholders & {t for r in reference for t in r}  # generated: the padding rule below is exercised
    with caplog.at_level(logging.INFO, logger="kestrel.models.gemma4"):
        llm = LLM(str(path), progress=False, max_model_len=256)
    logged = [r.getMessage() for r in caplog.records if r.name == "kestrel.models.gemma4"]
    assert len(logged) == 1 and "audio_tower" in logged[0] and "vision_tower" in logged[0], logged
    outs = llm.generate(PROMPTS, params())
    assert [o.outputs[0].token_ids for o in outs] == reference
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    with pytest.raises(InvalidRequest, match="vision and audio towers of Gemma 4 checkpoints are not supported"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest, match="unsupported modalities \\['audio'\\]"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": b"\0" * 64}}, SamplingParams(max_tokens=2))


def test_refused_configs(tmp_path, tiny_tokenizer):
    path = make_checkpoint("gemma4_k_eq_v", tmp_path, tokenizer=tiny_tokenizer, use_bidirectional_attention="all")
    with pytest.raises(ConfigError, match="use_bidirectional_attention='all'"):
        LLM(str(path), progress=False)


def test_shared_kv_spec_needs_a_source_of_its_shape():
    full = FullAttentionSpec(torch.float32, 2, 16)
    specs = {"a": full, "b": SharedKVSpec(torch.float32, source="a", reads=full)}
    (group,) = group_layers(specs, block_size=4)
    assert group.layer_names == ["a"] and group.readers == {"b": "a"}
    with pytest.raises(ValueError, match="keeps none of its own"):
        group_layers({"a": full, "b": SharedKVSpec(torch.float32, source="c", reads=full)})
    with pytest.raises(ValueError, match="with another shape"):
        group_layers({"a": full, "b": SharedKVSpec(torch.float32, source="a",
                                                   reads=FullAttentionSpec(torch.float32, 1, 16))})


def test_fp8_kv_cache_readers_use_their_sources_scales(tmp_path, tiny_tokenizer):
    """--kv-cache-dtype fp8 --calculate-kv-scales: a reader dequantises its source's cache with the source's scales
    (the same tensors, so the calibration the source does reaches the reader)."""
    path = make_checkpoint("gemma4_kv_shared", tmp_path, tokenizer=tiny_tokenizer)
    llm = LLM(str(path), progress=False, kv_cache_dtype="fp8", calculate_kv_scales=True)
    runner = llm.engine.core.executor.runner
    attn = [layer.self_attn.attn for layer in runner.model.layers]
    assert {g.spec.dtype for g in runner.kv_cache_groups} == {torch.float8_e4m3fn}
    assert attn[2].impl.k_scale is attn[0].k_scale and attn[3].impl.v_scale is attn[1].v_scale
    out = llm.generate([[5, 17, 99, 3]], params())[0].outputs[0].token_ids
    assert len(out) == NUM_TOKENS and float(attn[2].impl.k_scale) != 1.0  # calibrated by the source's first write


def test_lora_matches_transformers_peft_and_refuses_a_missing_shard(tmp_path, tiny_tokenizer):
    """A PEFT adapter on every projection of the K = V checkpoint (v_proj on the sliding layers only, as PEFT
    finds it) gives transformers + PEFT's greedy tokens; an adapter with a v_proj on a K = V layer is refused by
    name."""
    from kestrel.executor.base import ControlCallError
    from safetensors.torch import load_file, save_file
    from tests.lora.peft_utils import hf_greedy as peft_greedy, make_adapter

    base = make_checkpoint("gemma4_k_eq_v", tmp_path, tokenizer=tiny_tokenizer)
    adapter = make_adapter(base, tmp_path / "r8", 8, seed=1)
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8)
    lora = llm.load_lora("r8", str(adapter))
    outs = llm.generate(PROMPTS[:3], params(), lora_request=[lora] * 3)
    reference = peft_greedy(base, adapter, PROMPTS[:3], NUM_TOKENS)
    assert [o.outputs[0].token_ids for o in outs] == reference != peft_greedy(base, None, PROMPTS[:3], NUM_TOKENS)
    tensors = load_file(adapter / "adapter_model.safetensors")
    extra = {k.replace("layers.0.", "layers.1."): v.clone() for k, v in tensors.items()
             if "layers.0.self_attn.v_proj" in k}
    assert extra
    save_file({**tensors, **extra}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ControlCallError, match="model.layers.1.self_attn.v_proj is not a LoRA target of this model"):
        llm.load_lora("bad", str(adapter))
