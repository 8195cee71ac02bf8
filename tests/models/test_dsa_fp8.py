"""FP8 indexer keys (--indexer-key-dtype fp8) end to end on the tiny DeepSeek-V3.2 and GLM-5 (CPU, float32, the
reference backend). The yardstick is transformers with its indexer scoring the way DeepSeek's own inference code
does (written out below, independently of kestrel/attention/indexer_keys.py: a Sylvester Hadamard matrix, then
float8 e4m3 with a power-of-two scale per 128-value row for the query's heads and the key): 24 greedy tokens
identical at index_topk 4 and 8 (the selection decides; GLM-5.2's shared layers too), with chunked prefill, preemption
and a prefix-cache hit.

transformers itself skips the rotation and the quantization (its docstring says so): against it, fp8 keys flip
the tiny random indexer's many near-tied picks, which is why bf16 stays the default. Measured teacher-forced
agreement with transformers at index_topk 8 (5 prompts x 32 tokens): V3.2 96/160, GLM-5 106/160 (the bf16
keys: 160/160). With every token selected (index_topk 2048 on the sparse route) fp8 changes nothing: identical."""
import pytest
import torch
import torch.nn.functional as F

from kestrel.attention.sparse_mla import SparseMLAAttention
from tests.agreement import hf_greedy, kestrel_greedy

NUM_TOKENS = 24
PROMPTS = [[5, 17, 99, 3, 8], list(range(10, 40)), [200 + (7 * i) % 97 for i in range(48)], [7] * 11 + [42, 43]]


def sylvester_hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5


def deepseek_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rotated, then float8 e4m3 with a ue8m0 scale per row (DeepSeek's act_quant), dequantized."""
    x = x.float() @ sylvester_hadamard(x.shape[-1]).to(x.device)
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 448.0)))
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale


def fp8_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                        past_key_values=None):
    """transformers' DeepseekV32Indexer / GlmMoeDsaIndexer scoring, with q and k through deepseek_fp8 after rotary."""
    import importlib

    module = importlib.import_module(type(self).__module__)
    rope = (module.apply_rotary_pos_emb if type(self).__name__.startswith("DeepseekV32")
            else module.apply_rotary_pos_emb_interleave)
    b, s, _ = hidden_states.shape
    r = self.qk_rope_head_dim
    q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
    q_rot, k_rot = rope(q[..., :r], k[..., :r], *position_embeddings, unsqueeze_dim=2)
    if rope is not getattr(module, "apply_rotary_pos_emb", None):
        # transformers' interleaved rotary returns the pairs de-interleaved ([evens | odds]): the same dot products,
        # but not the same Hadamard input as DeepSeek's and vLLM's in-place rotation, which keeps the pairs adjacent
        q_rot, k_rot = (torch.stack(x.chunk(2, -1), -1).flatten(-2) for x in (q_rot, k_rot))
    q = deepseek_fp8(torch.cat([q_rot, q[..., r:]], -1))
    k = deepseek_fp8(torch.cat([k_rot, k[..., r:]], -1).squeeze(2))
    if past_key_values is not None:
        k = past_key_values.update_indexer(k, self.layer_idx)
    scores = F.relu(torch.matmul(q, k.transpose(-1, -2).unsqueeze(1)) * self.softmax_scale)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
    index = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    index = index.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool \
        else index + attention_mask
    return index.topk(min(self.index_topk, index.shape[-1]), dim=-1).indices.to(torch.int32)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root, built = tmp_path_factory.mktemp("tiny_dsa_fp8"), {}

    def get(kind: str, topk: int):
        if (kind, topk) not in built:
            built[kind, topk] = make_checkpoint(kind, root, tokenizer=tiny_tokenizer, name=f"{kind}_{topk}",
                                                index_topk=topk)
        return built[kind, topk]
    return get


def fp8_reference(path, prompts):
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    with pytest.MonkeyPatch.context() as mp:
        for cls in (DeepseekV32Indexer, GlmMoeDsaIndexer):
            mp.setattr(cls, "forward", fp8_indexer_forward)
        return hf_greedy(path, prompts, NUM_TOKENS)


def test_reference_fp8_indexer_changes_the_selection(checkpoints):
    """The yardstick is not transformers in disguise: at index_topk 4 its tokens differ from transformers'."""
    path = checkpoints("deepseek_v32", 4)
    assert fp8_reference(path, PROMPTS) != hf_greedy(path, PROMPTS, NUM_TOKENS)


@pytest.mark.parametrize("kind,topk", [("deepseek_v32", 4), ("deepseek_v32", 8), ("glm_moe_dsa", 8),
                                       ("glm_moe_dsa_shared", 4)])
def test_fp8_keys_match_deepseek_fp8_indexer(checkpoints, kind, topk):
    path = checkpoints(kind, topk)
    tokens, llm = kestrel_greedy(path, PROMPTS, NUM_TOKENS, indexer_key_dtype="fp8")
    (group,) = llm.engine.core.executor.runner.kv_cache_groups
    assert group.spec.index_dtype == torch.float8_e4m3fn
    assert tokens == fp8_reference(path, PROMPTS)


def test_fp8_keys_chunked_prefill_preemption_prefix_hit(checkpoints):
    from kestrel import SamplingParams

    path = checkpoints("deepseek_v32", 4)
    want = fp8_reference(path, PROMPTS)
    tokens, llm = kestrel_greedy(path, PROMPTS, NUM_TOKENS, indexer_key_dtype="fp8", block_size=4,
                                 num_kv_blocks=28, max_num_batched_tokens=8)
    core = llm.engine.core
    assert tokens == want and core.scheduler.num_preemptions > 0
    again = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == want[2]


def test_fp8_keys_with_every_token_selected_equal_transformers(checkpoints, monkeypatch):
    """index_topk above every context on the sparse route: the fp8 keys are scored (quantized, rotated) but the
    selection is every visible token, so the tokens are transformers' own."""
    monkeypatch.setattr(SparseMLAAttention, "supports_dense_mha_prefill", False)
    path = checkpoints("glm_moe_dsa", 2048)
    tokens, _ = kestrel_greedy(path, PROMPTS, NUM_TOKENS, indexer_key_dtype="fp8")
    assert tokens == hf_greedy(path, PROMPTS, NUM_TOKENS)
