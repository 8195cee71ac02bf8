"""benchmarks/step_trace.py's per-step floor: the weights read once, the decode rows' KV context, the prefill FLOPs."""
from benchmarks.common import shape_facts
from benchmarks.step_trace import step_roofline_s

CEIL = {"copy_bytes_per_s": 4e12, "bf16_flops_per_s": 8e14}


def test_decode_step_reads_weights_and_kv_context():
    facts = shape_facts("qwen3-0.6b")
    rec = dict(tokens=256, decodes=256, decode_ctx=256 * 1000)
    want = (facts.weight_bytes + 256_000 * facts.kv_bytes_per_token) / 4e12
    assert step_roofline_s(rec, facts, CEIL) == want


def test_prefill_tokens_add_their_flops():
    facts = shape_facts("qwen3-0.6b")
    decode_only = dict(tokens=10, decodes=10, decode_ctx=5000)
    mixed = dict(tokens=1010, decodes=10, decode_ctx=5000)
    extra = step_roofline_s(mixed, facts, CEIL) - step_roofline_s(decode_only, facts, CEIL)
    assert abs(extra - 1000 * facts.flops_per_token / 8e14) < 1e-12


def test_moe_step_reads_only_the_experts_its_tokens_hit():
    facts = shape_facts("qwen3-30b-a3b")
    one = step_roofline_s(dict(tokens=1, decodes=1, decode_ctx=0), facts, CEIL)
    many = step_roofline_s(dict(tokens=256, decodes=256, decode_ctx=0), facts, CEIL)
    assert one < many <= facts.weight_bytes / 4e12
