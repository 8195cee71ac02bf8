"""EAGLE-3 drafts (speculative_config method "eagle3") on a tiny random Llama target with tiny random drafts written
in both public layouts (CPU, float32): the drafts equal a plain-PyTorch EAGLE-3 forward written here (fed
transformers' hidden states of the target); outputs token-identical to the engine without speculation in mixed
batches (greedy, seeded, penalties, logprobs) with chunked prefill and forced preemption; a draft that copies the
target gets every draft accepted; the start-up refusals."""
import json

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import ConfigError
from kestrel.spec_decode.draft_chain import DraftChain
from kestrel.spec_decode.draft_kv import DraftKV
from kestrel.spec_decode.eagle3_drafter import Eagle3Drafter
from tests.spec_decode.eagle3_tiny import TARGET_LAYERS, eagle3_draft, eagle3_target
from tests.spec_decode.mixed import tokens, workload as mixed_workload


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return eagle3_target(tmp_path_factory.mktemp("eagle3_target"))


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("eagle3_drafts")
    return {"midlayer": eagle3_draft(root, target, "midlayer", seed=1),
            # explicit aux layers (the last one included), its own embeddings, norm_before_residual
            "speculators": eagle3_draft(root, target, "speculators", seed=2, aux=[1, 3, 6], own_embed=True,
                                        norm_before_residual=True)}


def eagle3(path, k, **kw):
    return {"method": "eagle3", "model": str(path), "num_speculative_tokens": k, **kw}


def workload():
    return mixed_workload(3)


# ---- a plain-PyTorch EAGLE-3 draft, from the checkpoint's tensors

def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate(x, pos, theta):
    """Llama rotary (rotate-half layout): x [T, heads, hd] at positions [T]."""
    hd = x.shape[-1]
    ang = pos[:, None].double() * (1.0 / theta ** (torch.arange(0, hd, 2).double() / hd))[None]
    cos, sin = (torch.cat([f, f], -1)[:, None].float() for f in (ang.cos(), ang.sin()))
    half = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + half * sin


def reference_layer(w, cfg, embeds, hidden, pos):
    """One EAGLE-3 layer over a whole sequence: [T, H] embeddings of tokens t+1, hidden states at positions t."""
    p = "layers.0."
    heads, kv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = h // heads
    normed = rms(hidden, w[p + "hidden_norm.weight"])
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], -1)

    def proj(name, n):
        out = x @ w[p + f"self_attn.{name}.weight"].T + w.get(p + f"self_attn.{name}.bias", 0)
        return out.view(len(x), n, hd)

    q = rotate(proj("q_proj", heads), pos, cfg["rope_theta"])
    k = rotate(proj("k_proj", kv), pos, cfg["rope_theta"]).repeat_interleave(heads // kv, 1)
    v = proj("v_proj", kv).repeat_interleave(heads // kv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    scores = scores + torch.full(scores.shape[1:], float("-inf")).triu(1)
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(x), h) @ w[p + "self_attn.o_proj.weight"].T
    attn = attn + w.get(p + "self_attn.o_proj.bias", 0)
    r = (normed if cfg["norm_before_residual"] else hidden) + attn
    m = rms(r, w[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T))
    return r + mlp @ w[p + "mlp.down_proj.weight"].T


def reference_drafts(target_model, target_w, draft_dir, seq: list[int], k: int, aux: list[int]) -> list[int]:
    """k chained greedy drafts after `seq`, from transformers' hidden states of the target."""
    from safetensors.torch import load_file

    raw = json.loads((draft_dir / "config.json").read_text())
    cfg = dict(raw.get("transformer_layer_config", raw), norm_before_residual=raw.get("norm_before_residual", False))
    w = {n.replace("midlayer.", "layers.0."): t for n, t in load_file(draft_dir / "model.safetensors").items()}
    embed = w.get("embed_tokens.weight", target_w["model.embed_tokens.weight"])
    with torch.no_grad():
        hs = target_model(torch.tensor([seq]), output_hidden_states=True).hidden_states  # hs[i]: entering layer i
        hidden = torch.cat([hs[i][0] for i in aux], -1)[:-1] @ w["fc.weight"].T  # positions 0 .. n-2
        ids, drafts = list(seq[1:]), []
        for _ in range(k):
            out = reference_layer(w, cfg, embed[torch.tensor(ids)], hidden, torch.arange(len(ids)))
            d = int((rms(out[-1], w["norm.weight"]) @ w["lm_head.weight"].T).argmax())
            drafts.append(d + int(w["d2t"][d]))
            hidden, ids = torch.cat([hidden, out[-1:]]), ids + [drafts[-1]]
    return drafts


def record_drafts(monkeypatch) -> list:
    """Make the drafter record (the request's tokens, the drafts made after them) of every draft step, and check
    that no draft forward writes a slot outside the blocks its request holds (padding rows write none)."""
    seen = []
    after_step, context, chain = Eagle3Drafter.after_step, DraftKV.context, DraftChain.run

    def recording(self, inf, out, requests):
        after_step(self, inf, out, requests)
        seen.extend((requests[rid].tokens_slice(0, n), d) for rid, (n, d) in out.next_drafts.items())

    def checked(self, table_rows, starts, counts):
        for row, start, n in zip(table_rows, starts, counts):
            assert (start + n - 1) // self.block_size < self.block_rows.lens[row, self.layer.group_id]
        return context(self, table_rows, starts, counts)

    def chain_checked(self, table_rows, first_pos, hidden, token):
        drafts = chain(self, table_rows, first_pos, hidden, token)
        rows, gid, bs = self.drafter.kv.block_rows, self.drafter.attn.group_id, self.drafter.kv.block_size
        b = len(table_rows)
        padded = min((size for size in self.sizes if size >= b), default=b)
        for slots in self.slots:
            for i, slot in enumerate(slots[:padded].tolist()):
                held = rows.ids[table_rows[i], gid, :rows.lens[table_rows[i], gid]] if i < b else []
                assert slot == -1 or slot // bs in held
        return drafts

    monkeypatch.setattr(Eagle3Drafter, "after_step", recording)
    monkeypatch.setattr(DraftKV, "context", checked)
    monkeypatch.setattr(DraftChain, "run", chain_checked)
    return seen


@pytest.mark.parametrize("layout, aux", [("midlayer", [2, 3, 4]), ("speculators", [1, 3, 6])])
def test_drafts_equal_plain_pytorch_eagle3_over_the_full_context(target, drafts, monkeypatch, layout, aux):
    """Every draft chain equals the reference's, which attends over the whole sequence: prompts of up to 150 tokens
    (a window of the last 64 positions would draft otherwise), computed in chunks of 24 tokens with requests
    preempted and recomputed, then a prompt that shares 100 tokens with an earlier one, its first 96 a prefix-cache
    hit (blocks whose draft K/V the earlier request wrote; the shared prefix does not end on a block boundary: see
    kestrel/spec_decode/draft_kv.py). Checks the aux layers captured (2, L//2, L-3 by default), fc, the layer, the
    chaining,
    d2t, that draft writes stay in the request's blocks (k - 1 lookahead slots) and that the chain's batches, padded
    to buckets, give the drafts of unpadded ones."""
    import random

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    seen = record_drafts(monkeypatch)
    rng = random.Random(7)
    prompts, _ = workload()
    long = [[rng.randrange(3, 380) for _ in range(n)] for n in (120, 150)]
    llm = LLM(str(target), progress=False, speculative_config=eagle3(drafts[layout], 3), max_num_batched_tokens=24,
              num_kv_blocks=12)
    drafter = llm.engine.core.executor.runner.drafter
    assert drafter.aux_layers == aux
    drafter.chained.sizes = [2, 4, 8]  # batch buckets, as where graphs are captured: padded batches run eagerly
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(prompts[:4] + long, params)
    core = llm.engine.core
    assert core.scheduler.num_preemptions > 0
    hits = core.kv.prefix_hits
    llm.generate([long[1][:100] + [5, 6, 7, 8]], params)
    assert core.kv.prefix_hits >= hits + 96
    assert sum(len(ids) > 64 + 4 for ids, _ in seen) >= 8 and len(seen) >= 20

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    target_w = load_file(target / "model.safetensors")
    for ids, got in seen:
        assert got == reference_drafts(model, target_w, drafts[layout], ids, 3, aux)


def test_drafts_after_pipelined_steps_equal_plain_pytorch_eagle3(target, drafts, monkeypatch):
    """Above disable_by_batch_size the engine pipelines its steps (no drafts; each step's tokens arrive after the
    next one is launched): the drafter still writes every computed position's draft K/V, so the drafts made once
    the batch has shrunk below it, over those positions, equal the reference's."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    seen = record_drafts(monkeypatch)
    prompts, _ = workload()
    llm = LLM(str(target), progress=False, async_scheduling="on",
              speculative_config=eagle3(drafts["midlayer"], 3, disable_by_batch_size=2))
    params = [SamplingParams(temperature=0, max_tokens=8 + 6 * i, ignore_eos=True) for i in range(len(prompts))]
    llm.generate(prompts, params)
    assert llm.engine.core.speculation.num_drafts > 0 and len(seen) >= 10
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    target_w = load_file(target / "model.safetensors")
    for ids, got in seen:
        assert got == reference_drafts(model, target_w, drafts["midlayer"], ids, 3, [2, 3, 4])


_REFS = {}


@pytest.mark.parametrize("layout, k, opts", [
    ("midlayer", 1, "plain"), ("midlayer", 3, "plain"), ("midlayer", 1, "chunked+preempt"),
    ("midlayer", 3, "chunked+preempt"), ("speculators", 3, "chunked+preempt")])
def test_same_outputs_as_without_speculation(target, drafts, layout, k, opts):
    kw = dict(max_num_batched_tokens=24, num_kv_blocks=12) if opts != "plain" else {}
    prompts, params = workload()
    if opts not in _REFS:
        _REFS[opts] = tokens(LLM(str(target), progress=False, **kw), prompts, params)
    llm = LLM(str(target), progress=False, speculative_config=eagle3(drafts[layout], k), **kw)
    assert tokens(llm, prompts, params) == _REFS[opts]
    sp = llm.engine.core.speculation
    assert sp.num_drafts > 0 and sp.num_draft_tokens >= sp.num_drafts
    if opts != "plain":
        assert llm.engine.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("layout, k", [("midlayer", 1), ("midlayer", 3), ("speculators", 3)])
def test_copying_draft_gets_every_greedy_draft_accepted(tmp_path, layout, k):
    """A bigram target and a draft that computes the target's next token after token t+1 (d2t a permutation):
    every greedy draft is right, so a misplaced position or token (off by one) would show as rejections."""
    bigram = eagle3_target(tmp_path, bigram=True)
    draft = eagle3_draft(tmp_path, bigram, layout, copy=True, own_embed=layout == "speculators")
    prompts, _ = workload()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = tokens(LLM(str(bigram), progress=False), prompts, params)
    assert any(len(set(r[0])) > 4 for r in ref)  # not a constant output
    llm = LLM(str(bigram), progress=False, speculative_config=eagle3(draft, k), max_num_batched_tokens=24)
    assert tokens(llm, prompts, params) == ref
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > len(prompts) * k and sp.num_accepted_tokens == sp.num_draft_tokens
    assert sp.accepted_per_pos[k - 1] > 0


def test_chains_stop_at_the_end_of_the_context(tmp_path, monkeypatch):
    """Requests that run up to max_model_len: a chain whose next position is past the context (or outside the
    request's blocks) stops there (an empty row in the padded batch: it writes and reads nothing), its drafts
    cut short; the outputs stay the target's and every draft of the copying draft is accepted."""
    bigram = eagle3_target(tmp_path, bigram=True)
    draft = eagle3_draft(tmp_path, bigram, "midlayer", copy=True)
    prompts = [list(range(3 + i, 33 + 2 * i)) for i in range(4)]  # 30..36 tokens
    params = [SamplingParams(temperature=0, max_tokens=40 - len(p) - 1, ignore_eos=True) for p in prompts]
    ref = tokens(LLM(str(bigram), progress=False, max_model_len=40), prompts, params)
    cut = []
    num_valid = DraftChain.num_valid
    monkeypatch.setattr(DraftChain, "num_valid",
                        lambda self, row, pos: cut.append(num_valid(self, row, pos)) or cut[-1])
    llm = LLM(str(bigram), progress=False, max_model_len=40, speculative_config=eagle3(draft, 4))
    assert tokens(llm, prompts, params) == ref
    assert min(cut) < 3 and max(cut) == 3
    sp = llm.engine.core.speculation
    assert sp.num_draft_tokens > 0 and sp.num_accepted_tokens == sp.num_draft_tokens


def test_memory_profile_forward_runs_the_draft_over_the_token_budget(target, drafts, monkeypatch):
    """The profiled forward (GPU start-up; its dummy batch on the CPU here) runs the draft step's first forward
    over every token of the budget after the target's (a prefill step's draft forward covers all its tokens), and
    the draft layer is one more layer of the target's KV group (one more cache slot per block, as wide as its
    page)."""
    from kestrel.worker import kv_allocation
    from kestrel.worker.memory_profile import dummy_prefill_batch, profile_forward

    llm = LLM(str(target), progress=False, speculative_config=eagle3(drafts["midlayer"], 3),
              max_num_batched_tokens=200)
    runner = llm.engine.core.executor.runner
    (group,) = runner.kv_cache_groups  # the draft's K/V heads are 2, the target's 4
    assert group.layer_names[-1] == runner.drafter.attn.layer_name and len(group.layer_names) == TARGET_LAYERS + 1
    assert kv_allocation.bytes_per_block(runner.kv_cache_groups) == (TARGET_LAYERS + 0.5) * group.spec.page_bytes
    seen = []
    layer = Eagle3Drafter.layer
    monkeypatch.setattr(Eagle3Drafter, "layer", lambda self, ids, *a: seen.append(len(ids)) or layer(self, ids, *a))
    ids, positions, ctx = dummy_prefill_batch(runner, 200)
    profile_forward(runner, ids, positions, ctx)
    assert seen == [200]


def test_config_needs_a_model(target):
    with pytest.raises(ConfigError, match=r"method 'eagle3' needs \"model\""):
        LLM(str(target), progress=False, speculative_config={"method": "eagle3", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match=r"\"model\" is for method 'eagle3' only, not 'ngram'"):
        LLM(str(target), progress=False, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                                             "model": "x"})


def test_tensor_parallelism_is_refused(target, drafts):
    with pytest.raises(ConfigError, match=r"does not support method 'eagle3' with tensor parallelism"):
        LLM(str(target), progress=False, speculative_config=eagle3(drafts["midlayer"], 2), tensor_parallel_size=2)


def _rewrite(src, dst, config=None, drop=(), rename=None):
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    w = {k: v for k, v in load_file(src / "model.safetensors").items() if k not in drop}
    save_file(rename(w) if rename else w, dst / "model.safetensors")
    return dst


def test_unsupported_drafts_are_refused(tmp_path, target, drafts):
    src = drafts["midlayer"]
    cases = [
        (dict(config=lambda c: {**c, "vocab_size": 500}),
         r"does not support a draft vocabulary of 500 tokens \(the target has 384\)"),
        (dict(config=lambda c: {**c, "num_hidden_layers": 2}), r"does not support a draft of 2 layers"),
        (dict(config=lambda c: {**c, "hidden_size": 32}), r"a draft for target hidden size 32 \(the target's is 64\)"),
        (dict(config=lambda c: {**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 9]}}),
         rf"eagle_aux_hidden_state_layer_ids \[1, 1, 9\] must be distinct layers of the target's {TARGET_LAYERS}"),
        (dict(drop=("d2t",)), r"has a 256-token vocabulary and no d2t map to the target's 384 tokens"),
        (dict(drop=("midlayer.hidden_norm.weight",)), r"missing \['layers.0.hidden_norm.weight'\]"),
        (dict(rename=lambda w: {**w, "d2t": w["d2t"] + 200}), r"d2t maps outside the target's 384 tokens"),
    ]
    for i, (edit, match) in enumerate(cases):
        bad = _rewrite(src, tmp_path / f"bad{i}", **edit)
        with pytest.raises(ConfigError, match=match):
            LLM(str(target), progress=False, speculative_config=eagle3(bad, 2))
    with pytest.raises(ConfigError, match=r"no config.json in the draft folder"):
        LLM(str(target), progress=False, speculative_config=eagle3(tmp_path / "nowhere", 2))


def test_a_draft_layer_rides_on_the_first_full_attention_group():
    """The draft's attention joins the model's full-attention group as one more layer with a page of its own (other
    KV heads here), never cutting the model's groups; a model without full attention has nothing to ride on."""
    from kestrel.core.kv_spec import FullAttentionSpec, SlidingWindowSpec, attach_riders, group_layers
    from kestrel.worker.kv_allocation import slot_row_bytes

    full, sliding = FullAttentionSpec(torch.float32, num_kv_heads=4, head_dim=16), \
        SlidingWindowSpec(torch.float32, num_kv_heads=4, head_dim=16, sliding_window=8)
    draft = FullAttentionSpec(torch.float32, num_kv_heads=2, head_dim=16, block_size=32)
    groups = group_layers({"f0": full, "s0": sliding, "f1": full, "s1": sliding, "s2": sliding}, block_size=16)
    assert [g.layer_names for g in groups] == [["f0", "f1"], ["s0", "s1"], ["s2"]]
    host = attach_riders(groups, {"draft": draft})
    assert host is groups[0] and host.layer_names == ["f0", "f1", "draft"]
    assert host.spec_of("draft") == FullAttentionSpec(torch.float32, num_kv_heads=2, head_dim=16, block_size=16)
    assert host.spec_of("f1") == host.spec
    page = full.page_bytes  # 16 tokens x 4 heads x 16 x 2 (K and V) x 4 bytes
    assert slot_row_bytes(groups) == [page, page, page // 2]
    assert attach_riders(group_layers({"s0": sliding}, block_size=16), {"draft": draft}) is None


def test_default_aux_layers_of_a_shallow_target_are_refused(tmp_path, tiny_llama, drafts):
    """A 2-layer target has no layers 2, 1, -1: the draft must name its aux layers."""
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids \[2, 1, -1\] must be distinct layers"):
        LLM(str(tiny_llama), progress=False, speculative_config=eagle3(drafts["midlayer"], 2))


def test_qwen3_target_same_outputs(tmp_path):
    """A Qwen3 target (q/k norms, its own head dim): its layers take the same (positions, hidden, residual) inputs,
    so the aux capture works there too (the public drafts for Qwen3 are EAGLE-3 heads)."""
    from tests.tiny import make_checkpoint

    qwen3 = make_checkpoint("qwen3", tmp_path, num_hidden_layers=4)
    draft = eagle3_draft(tmp_path, qwen3, "speculators", aux=[0, 1, 3])
    prompts, params = workload()
    ref = tokens(LLM(str(qwen3), progress=False), prompts, params)
    llm = LLM(str(qwen3), progress=False, speculative_config=eagle3(draft, 2), max_num_batched_tokens=24)
    assert tokens(llm, prompts, params) == ref
    assert llm.engine.core.speculation.num_drafts > 0
