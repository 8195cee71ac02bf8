"""MoE families against transformers (tiny random HF checkpoints, CPU float32), with fused shared experts (FSE)
on and off, and the FSE contract: decided once at construction, recorded, and the only input of the loader."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.kernels.moe import MoESpec, TorchMoE
from kestrel.layers.moe import FseError, SharedExperts, SparseMoeBlock, resolve_fused_shared_experts
from kestrel.loader import load_model
from kestrel.loader.safetensors import iter_safetensors
from kestrel.models.context import ModelContext
from kestrel.models.hf_config import HFConfig
from tests.models.test_hf_equivalence import PROMPTS, hf_greedy
from tests.tiny import MOE_CONFIGS, make_checkpoint

NUM_TOKENS = 32


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("tiny_moe")
    return {k: make_checkpoint(k, root, tokenizer=tiny_tokenizer) for k in MOE_CONFIGS}


def model_context(hf, dtype=torch.float32, quant_config=None, **kernel) -> ModelContext:
    return ModelContext(HFConfig.from_hf(hf, 64), dtype, quant_config, **kernel)


def blocks_of(llm) -> dict[str, SparseMoeBlock]:
    return llm.engine.core.executor.runner.model.moe_blocks()


# family -> (FSE settings to run, whether `auto` fuses on the CPU reference kernel)
FAMILIES = {"qwen2_moe": (("auto", "off"), True), "glm4_moe": (("auto", "off"), True),
            "qwen3_moe": (("auto",), False), "mixtral": (("auto",), False)}


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_greedy_matches_transformers_with_fse_on_and_off(moe_models, kind):
    path = moe_models[kind]
    ref = [tokens for tokens, _ in hf_greedy(path, PROMPTS, NUM_TOKENS)]
    settings, fuses = FAMILIES[kind]
    outputs = {}
    for fse in settings:
        llm = LLM(str(path), progress=False, fuse_shared_experts=fse)
        blocks = blocks_of(llm)
        assert blocks and all(type(b.experts.kernel) is TorchMoE for b in blocks.values())
        assert all(b.fse.fused == (fuses and fse == "auto") for b in blocks.values()), \
            {n: b.fse for n, b in blocks.items()}
        out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        outputs[fse] = [o.outputs[0].token_ids for o in out]
        assert outputs[fse] == ref, f"{kind} fuse_shared_experts={fse}"
    assert len({tuple(map(tuple, v)) for v in outputs.values()}) == 1


def test_dense_layers_where_the_config_says(moe_models):
    from kestrel.models.llama import LlamaMLP

    for kind, dense in (("qwen2_moe", [1]), ("glm4_moe", [0])):
        model = load_model(_model_config(moe_models[kind]), torch.device("cpu"), progress=False).model
        for i, layer in enumerate(model.layers):
            assert isinstance(layer.mlp, LlamaMLP) == (i in dense), (kind, i)


def _model_config(path):
    from kestrel.config import ModelConfig

    return ModelConfig(model=str(path))


def _checkpoint(path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(path, False))


def _assert_shared_in_fused_tensor(model, ckpt, inter=32):
    for prefix, block in model.moe_blocks().items():
        assert block.fse.fused and block.shared_mlp is None
        e, slots = block.experts.spec.num_experts, block.fse.slots
        gate, up = ckpt[f"{prefix}.shared_experts.gate_proj.weight"], ckpt[f"{prefix}.shared_experts.up_proj.weight"]
        down = ckpt[f"{prefix}.shared_experts.down_proj.weight"]
        assert slots == gate.shape[0] // inter == 2
        for c in range(slots):
            w13, w2 = block.experts.w13[e + c], block.experts.w2[e + c]
            torch.testing.assert_close(w13[:inter], gate[c * inter:(c + 1) * inter], rtol=0, atol=0)
            torch.testing.assert_close(w13[inter:], up[c * inter:(c + 1) * inter], rtol=0, atol=0)
            torch.testing.assert_close(w2, down[:, c * inter:(c + 1) * inter], rtol=0, atol=0)


def test_fused_model_loads_shared_experts_into_the_fused_tensor(moe_models):
    path = moe_models["glm4_moe"]
    model = load_model(_model_config(path), torch.device("cpu"), progress=False).model
    assert set(model.fse_decisions) == {"model.layers.1.mlp", "model.layers.2.mlp"}
    _assert_shared_in_fused_tensor(model, _checkpoint(path))


class NoFseMoE(TorchMoE):
    """A kernel that cannot run shared experts as extra experts (the decision table's third kernel)."""

    name = "no_fse_moe"
    supports_fused_shared_experts = False


def test_loader_follows_the_recorded_decision_not_the_current_kernel(moe_models):
    """Swap every block's kernel for one without FSE support after construction: loading still places the shared
    experts per the recorded (fused) decision. A loader that re-derived it would look for the separate MLP."""
    from kestrel.loader import load_hf_config
    from kestrel.models.glm4_moe import Glm4MoeForCausalLM

    path = moe_models["glm4_moe"]
    model = Glm4MoeForCausalLM(model_context(load_hf_config(path)))
    for block in model.moe_blocks().values():
        block.experts.kernel = NoFseMoE(block.experts.spec)
        block.experts.w13.data.zero_()
    model.load_weights(iter_safetensors(path, False))
    _assert_shared_in_fused_tensor(model, _checkpoint(path))


def _spec(quant=None, dtype=torch.float32, inter=64):
    return MoESpec("model.layers.3.mlp.experts", 16, 2, 256, inter, dtype, "silu", quant)


FP8 = None


def _fp8_block():
    from kestrel.kernels.fp8_scheme import Fp8Scheme

    return Fp8Scheme("block", "group", True, (128, 128), 128, True, "weight_scale_inv", "fp8")


def test_fse_decision_table():
    """family x kernel x quantization -> fused or not, and why. Kernels: the CPU reference, the Triton kernels
    (chosen for a fake H200), a kernel without FSE support. The quantization check runs only when fusion is
    requested: with mode off, a mismatched quantization is never the reason."""
    from kestrel import kernels
    from kestrel.kernels.moe import TritonFp8BlockMoE, TritonFusedMoE
    from kestrel.platform import fake_platform

    cpu, h200 = fake_platform("cpu"), fake_platform("sm_90", triton_available=True)
    fp8 = _fp8_block()
    bf16_128 = _spec(None, torch.bfloat16, 128)
    fp8_128 = _spec(fp8, torch.bfloat16, 128)
    families = {"qwen3_moe": None, "deepseek": SharedExperts(256), "qwen2_moe": SharedExperts(512, gated=True),
                "odd_shared": SharedExperts(96)}
    rows = [  # family, spec, platform or kernel, shared quant, mode -> (fused, slots, kernel, reason substring)
        ("qwen3_moe", _spec(), cpu, None, "auto", (False, 0, "torch_moe", "no shared experts")),
        ("deepseek", _spec(), cpu, None, "auto", (True, 4, "torch_moe", "")),
        ("deepseek", _spec(), cpu, None, "off", (False, 0, "torch_moe", "disabled")),
        ("qwen2_moe", _spec(), cpu, None, "auto", (True, 8, "torch_moe", "")),
        ("odd_shared", _spec(), cpu, None, "auto", (False, 0, "torch_moe", "not a multiple")),
        ("deepseek", _spec(), NoFseMoE, None, "auto", (False, 0, "no_fse_moe", "does not run shared experts")),
        ("deepseek", bf16_128, h200, None, "auto", (True, 2, "triton_fused_moe", "")),
        ("qwen2_moe", bf16_128, h200, None, "auto", (True, 4, "triton_fused_moe", "")),
        ("deepseek", fp8_128, h200, fp8, "auto", (True, 2, "triton_fp8_block_moe", "")),
        ("deepseek", fp8_128, h200, None, "auto", (False, 0, "triton_fp8_block_moe", "unquantized while")),
        ("deepseek", fp8_128, h200, None, "off", (False, 0, "triton_fp8_block_moe", "disabled")),
    ]
    for family, spec, where, squant, mode, (fused, slots, kname, why) in rows:
        if isinstance(where, type):
            kernel_cls = where
        else:
            kernel_cls = type(kernels.select("moe", spec, "auto", where))
        assert kernel_cls.name == kname
        shared = families[family]
        if shared is not None:
            shared = SharedExperts(shared.intermediate_size, shared.gated, squant)
        d = resolve_fused_shared_experts(spec, shared, kernel_cls, mode)
        assert (d.fused, d.slots) == (fused, slots), (family, kname, mode, d)
        assert why in d.reason and (d.reason == "") == fused, (family, kname, mode, d)
    # "on" raises, naming the layer, where "auto" falls back
    for shared, kernel_cls, spec in ((SharedExperts(256, quant=None), TritonFp8BlockMoE, fp8_128),
                                     (SharedExperts(256), NoFseMoE, _spec())):
        with pytest.raises(FseError, match="model.layers.3.mlp.experts"):
            resolve_fused_shared_experts(spec, shared, kernel_cls, "on")
    assert TritonFusedMoE.supports_fused_shared_experts and TorchMoE.supports_fused_shared_experts


def test_mixed_fse_state_raises_naming_the_layers():
    """FP8 experts on a (fake) H200 where layer 2's shared experts are left unquantized: layer 1 can fuse, layer 2
    cannot, and the Triton MoE cannot mix the two states: construction raises naming both layers."""
    from transformers import AutoConfig

    from kestrel.layers.quant import Fp8Config
    from kestrel.models.glm4_moe import Glm4MoeForCausalLM
    from kestrel.platform import fake_platform
    from kestrel.platform.testing import use_platform

    cfg = AutoConfig.for_model("glm4_moe", vocab_size=256, hidden_size=128, intermediate_size=256,
                               moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                               num_key_value_heads=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=1, n_group=1, topk_group=1)
    quant = Fp8Config(_fp8_block(), ignore=["model.layers.2.mlp.shared_experts"])
    h200 = fake_platform("sm_90", triton_available=True)
    with use_platform(h200), pytest.raises(FseError) as err:
        Glm4MoeForCausalLM(model_context(cfg, torch.bfloat16, quant))
    msg = str(err.value)
    assert "fused in model.layers.1.mlp" in msg and "not fused in model.layers.2.mlp" in msg and "unquantized" in msg
    # the same model with fusion off builds, every layer unfused
    with use_platform(h200):
        model = Glm4MoeForCausalLM(model_context(cfg, torch.bfloat16, quant, fuse_shared_experts="off"))
    assert not any(d.fused for d in model.fse_decisions.values())
    assert {type(b.experts.kernel).__name__ for b in model.moe_blocks().values()} == {"TritonFp8BlockMoE"}


def test_fp8_block_checkpoint_with_fused_quantized_shared_experts(tmp_path, tiny_tokenizer):
    """A DeepSeek-style FP8 checkpoint (128x128 block scales on experts, shared experts and attention) through the
    real loader on the CPU: the experts run dequantized (fp8_dequant_moe), the quantized shared expert is fused
    into the FP8 expert tensors with its scales, and the bf16 engine agrees, teacher-forced, with transformers on
    the same weights dequantized into a plain checkpoint (one position may carry a router near-tie flip)."""
    from tests.agreement import assert_teacher_forced
    from tests.fp8_utils import make_fp8_checkpoint
    from tests.kernels.test_fp8_end_to_end import dequantized_copy

    src = make_checkpoint("glm4_moe", tmp_path, tokenizer=tiny_tokenizer, name="glm_src", hidden_size=128,
                          intermediate_size=256, moe_intermediate_size=128, num_attention_heads=2,
                          num_key_value_heads=1, n_shared_experts=1)
    fp8 = make_fp8_checkpoint(src, tmp_path / "glm_fp8", fmt="block")
    llm = LLM(str(fp8), dtype="bfloat16", progress=False)
    blocks = blocks_of(llm)
    assert {b.experts.kernel_name for b in blocks.values()} == {"fp8_dequant_moe"}
    assert all(b.fse.fused and b.fse.slots == 1 for b in blocks.values())
    assert_teacher_forced(llm, dequantized_copy(fp8, tmp_path / "glm_deq"), PROMPTS, NUM_TOKENS, spare=1)


# ---- DeepSeek-V2/V3: the MoE block at module level (their attention is MLA: a later issue)
def _hf_block_weights(hf_block, prefix=""):
    """transformers 5 keeps experts fused in memory; the checkpoint (and our loader) has them per expert."""
    out = {}
    for name, t in hf_block.state_dict().items():
        if name == "experts.gate_up_proj":
            for j in range(t.shape[0]):
                gate, up = t[j].chunk(2)
                out[f"experts.{j}.gate_proj.weight"], out[f"experts.{j}.up_proj.weight"] = gate, up
        elif name == "experts.down_proj":
            for j in range(t.shape[0]):
                out[f"experts.{j}.down_proj.weight"] = t[j]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("variant", ["v3", "v2_greedy", "v2_group_limited"])
def test_deepseek_moe_block_matches_transformers(variant):
    from transformers import AutoConfig

    from kestrel.models.deepseek_moe import deepseek_moe_block, deepseek_router, deepseek_v2_router

    common = dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=3,
                  n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    if variant == "v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

        cfg = AutoConfig.for_model("deepseek_v3", norm_topk_prob=True, **common)
        hf = DeepseekV3MoE(cfg)
        router = deepseek_router(cfg)
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

        method = "greedy" if variant == "v2_greedy" else "group_limited_greedy"
        cfg = AutoConfig.for_model("deepseek_v2", topk_method=method, **common)
        hf = DeepseekV2Moe(cfg)
        router = deepseek_v2_router(cfg)
    hf = hf.float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.1)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    x = torch.randn(2, 11, 64)
    with torch.no_grad():
        ref = hf(x).reshape(-1, 64)
    weights = _hf_block_weights(hf)
    outs = {}
    for fse in ("auto", "off"):
        block = deepseek_moe_block(model_context(cfg, fuse_shared_experts=fse), "model.layers.1.mlp", router)
        for name, t in weights.items():
            block.load_weight(name, t, block.fse)
        assert block.fse.fused == (fse == "auto")
        with torch.no_grad():
            outs[fse] = block(x.reshape(-1, 64))
        torch.testing.assert_close(outs[fse], ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs["auto"], outs["off"], rtol=1e-5, atol=1e-5)
