"""LoRA on Qwen2.5-VL's decoder (the tower takes none): a PEFT adapter over the language model's projections, in
both checkpoint layouts' names, gives transformers + PEFT's greedy tokens on an image prompt; an adapter on the
tower is refused naming its module."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from tests.lora.peft_utils import make_adapter
from tests.mm_tiny import make_image, make_qwen2_5_vl, qwen_vl_processor

TEXT = "first <|vision_start|><|image_pad|><|vision_end|> then describe it"
DECODER = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import Qwen2_5_VLForConditionalGeneration

    root = tmp_path_factory.mktemp("lora_qwen_vl")
    base = make_qwen2_5_vl(root)
    adapter = make_adapter(base, root / "lora", 8, seed=3, targets=DECODER, scale=0.2,
                           model_cls=Qwen2_5_VLForConditionalGeneration)
    return base, adapter, make_image(120, 70, seed=5)


def test_decoder_lora_matches_transformers_peft(setup):
    from peft import PeftModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    base, adapter, image = setup
    model = PeftModel.from_pretrained(Qwen2_5_VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32),
                                      adapter).eval()
    enc = qwen_vl_processor(base)(text=[TEXT], images=[[image]], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**enc, max_new_tokens=16, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8)
    llm.load_lora("a", str(adapter))
    manager = llm.engine.core.executor.runner.lora
    assert manager.kernels and all(name.startswith("model.layers.") for name in manager.kernels)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    req = {"prompt": TEXT, "multi_modal_data": {"image": [image]}}
    with_lora = llm.generate([req], params, lora_request=["a"])[0].outputs[0].token_ids
    plain = llm.generate([req], params)[0].outputs[0].token_ids
    assert with_lora == ref and plain != ref


def test_our_names_for_adapter_modules(setup):
    llm = LLM(str(setup[0]), progress=False)
    model = llm.engine.core.executor.runner.model
    for path in ("model.layers.1.self_attn.q_proj", "model.language_model.layers.1.self_attn.q_proj",
                 "base_model.model.model.language_model.layers.1.self_attn.q_proj"[len("base_model.model."):]):
        assert model.lora_module_name(path) == "model.layers.1.self_attn.q_proj"
    assert model.lora_module_name("model.visual.blocks.0.attn.qkv") == "visual.blocks.0.attn.qkv"


def test_tower_lora_is_refused_by_name(setup, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from kestrel.executor import ControlCallError
    from kestrel.lora.adapter import LoRAAdapterError

    base = setup[0]
    bad = make_adapter(base, tmp_path / "tower", 4, seed=4, targets=r".*visual\..*\.qkv",
                       model_cls=Qwen2_5_VLForConditionalGeneration)
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8)
    with pytest.raises(ControlCallError, match=r"visual\.blocks\.0\.attn\.qkv is not a LoRA target") as err:
        llm.load_lora("tower", str(bad))
    assert isinstance(err.value.outcomes[0], LoRAAdapterError)
