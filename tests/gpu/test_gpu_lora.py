"""GPU checks of multi-LoRA (skipped without CUDA): the Triton shrink/expand path in bf16 agrees with
transformers with the adapter (teacher-forced, >= 30 of 32 tokens, logprobs within bf16 tolerance) for each
adapter of a mixed batch, and CUDA-graph replay gives the same tokens as eager on a batch mixing 3 adapters and
the base. The reference is transformers + PEFT where peft is installed, else transformers with the adapter merged
into its weights (the CPU tests check our adapter reading against PEFT itself)."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.agreement import bf16_logprob_tolerance
from tests.lora.peft_utils import hf_with_merged_adapter, write_random_adapter

pytestmark = pytest.mark.gpu
KV_BLOCKS = 2048
PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206]]


@pytest.fixture(scope="module")
def model_and_adapters(tmp_path_factory, tiny_tokenizer):
    from tests.tiny import make_checkpoint

    root = tmp_path_factory.mktemp("gpu_lora")
    base = make_checkpoint("llama", root, tokenizer=tiny_tokenizer, hidden_size=256, intermediate_size=512,
                           logit_scale=4.0)
    return base, {"r8": write_random_adapter(base, root / "r8", 8, seed=1, scale=0.08),
                  "r64": write_random_adapter(base, root / "r64", 64, seed=2, scale=0.03),
                  "attn16": write_random_adapter(base, root / "attn16", 16, seed=3, scale=0.08,
                                                 targets=["q_proj", "v_proj", "down_proj"])}


def reference_model(base, adapter):
    try:
        from peft import PeftModel
    except ImportError:
        return hf_with_merged_adapter(base, adapter, torch.bfloat16, "cuda")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).cuda()
    return PeftModel.from_pretrained(hf, adapter).cuda().eval()


def _lora_llm(base, adapters, **kw):
    llm = LLM(str(base), dtype="bfloat16", progress=False, num_kv_blocks=KV_BLOCKS, enable_lora=True,
              max_lora_rank=64, max_loras=4, **kw)
    return llm, [llm.load_lora(n, str(p)) for n, p in adapters.items()]


def test_triton_lora_matches_transformers_peft(model_and_adapters):
    base, adapters = model_and_adapters
    llm, loras = _lora_llm(base, adapters)
    assert llm.engine.core.runner.lora.backend == "triton"
    for lora in loras:
        hf = reference_model(base, adapters[lora.name])
        for p in PROMPTS:
            ids = torch.tensor([p], device="cuda")
            with torch.no_grad():
                seq = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                  do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
                logits = hf(input_ids=torch.tensor([seq], device="cuda")).logits[0].float()
            ref = logits.log_softmax(-1)
            tol = bf16_logprob_tolerance(logits[len(p) - 1:].abs().max().item())
            # score transformers' sequence with the adapter, next to base-model requests in the same batch
            outs = llm.generate([seq, seq], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0),
                                lora_request=[lora, None])
            out = outs[0]
            agree, lp_err = 0, 0.0
            for j in range(len(p), len(seq)):
                entry = out.prompt_logprobs[j]
                agree += next(t for t, lp in entry.items() if lp.rank == 1) == seq[j]
                lp_err = max(lp_err, abs(entry[seq[j]].logprob - ref[j - 1, seq[j]].item()))
            assert agree >= 30, (lora.name, p, agree)
            assert lp_err < tol, (lora.name, p, lp_err, tol)


def test_lora_cuda_graphs_equal_eager(model_and_adapters):
    base, adapters = model_and_adapters
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompts = PROMPTS * 3  # 12 requests, padded to a captured size of 16
    results = []
    for eager in (False, True):
        llm, loras = _lora_llm(base, adapters, enforce_eager=eager, async_scheduling="off")
        assert (llm.engine.core.runner.graphs is None) == eager
        per_prompt = [(loras + [None])[(i + i // 4) % 4] for i in range(len(prompts))]  # each prompt: 3 choices
        results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=per_prompt)])
        del llm
        torch.cuda.empty_cache()
    assert results[0] == results[1]
    assert results[0][3] != results[0][7]  # prompt 3: the base model vs adapter r8
