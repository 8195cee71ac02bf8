"""GPU checks of image input (skipped without CUDA): tiny LLaVA-NeXT with head dim 64 on the Triton backend in
bf16 against transformers in bf16, and in float32 (reference attention on CUDA) token-identical; PaliGemma selects
the reference backend (the Triton kernels have no bidirectional prefix)."""
import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.mm_tiny import make_llava_next, make_paligemma, sample_images

pytestmark = pytest.mark.gpu
PROMPT = "<image>\nwhat is this"
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_mm")
    return {"llava": make_llava_next(root, name="llava_wide", hidden_size=256, intermediate_size=512),
            "paligemma": make_paligemma(root)}


def hf_greedy(path, dtype, images):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).cuda().eval()
    proc = AutoProcessor.from_pretrained(path)
    out = []
    for img in images:
        enc = proc(text=[PROMPT], images=[[img]], return_tensors="pt").to("cuda")
        enc["pixel_values"] = enc["pixel_values"].to(dtype)
        seq = model.generate(**enc, max_new_tokens=16, do_sample=False)
        out.append(seq[0, enc["input_ids"].shape[1]:].tolist())
    return out


def run(path, dtype, images):
    llm = LLM(str(path), dtype=dtype, progress=False, num_kv_blocks=512)
    outs = llm.generate([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images], PARAMS)
    return [o.outputs[0].token_ids for o in outs], llm


def test_llava_float32_on_cuda_matches(models):
    images = sample_images()
    ours, llm = run(models["llava"], "float32", images)
    assert ours == hf_greedy(models["llava"], torch.float32, images)


def test_llava_bf16_triton(models):
    images = sample_images()
    ours, llm = run(models["llava"], "bfloat16", images)
    assert llm.engine.core.executor.runner.backend.name == "triton"
    ref = hf_greedy(models["llava"], torch.bfloat16, images)
    assert sum(a[:8] == b[:8] for a, b in zip(ours, ref)) >= 2, (ours, ref)


def test_paligemma_selects_reference_attention(models):
    _, llm = run(models["paligemma"], "bfloat16", sample_images()[:1])
    assert llm.engine.core.executor.runner.backend.name == "torch_ref"
