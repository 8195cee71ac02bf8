"""Acceptance 3 (CPU): LLaVA-NeXT with adapters on the CLIP tower (q/k/v/out_proj, fc1/fc2) and the projector
(linear_1/linear_2), alone or with the decoder, equals transformers + PEFT on images of different sizes, in one batch
with a base-model request; the tower's and projector's adapter mappings count the rows of the processed tiles
(tiles x patches per image) while the decoder's cover exactly the processor's placeholders."""
import numpy as np
import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.executor import ControlCallError
from kestrel.lora.adapter import LoRAAdapterError
from tests.lora.peft_utils import make_adapter
from tests.mm_tiny import sample_images

NUM_TOKENS = 24
VISION_ONLY = r".*vision_tower\..*\.(q_proj|k_proj|v_proj|out_proj|fc1|fc2)|.*multi_modal_projector\.linear_[12]"
EVERYWHERE = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj", "out_proj", "fc1", "fc2", "linear_1", "linear_2"]
# (text, image indices, adapter): images 0 (90x40) and 1 (33x70) and 2 (64x60) take different anyres grids
REQUESTS = [("<image>\nwhat is this", [0], "vision"), ("first <image>\nthen <image>\nok", [1, 2], "all"),
            ("describe <image>\nplease", [1], "vision"), ("<image>\nwhat is this", [0], None)]


@pytest.fixture(scope="module")
def setup(tiny_mm_models):
    from transformers import LlavaNextForConditionalGeneration

    base = tiny_mm_models["llava_next"]
    root = base.parent
    adapters = {"vision": make_adapter(base, root / "lora_vision", 8, seed=1, targets=VISION_ONLY, scale=0.3,
                                       model_cls=LlavaNextForConditionalGeneration),
                "all": make_adapter(base, root / "lora_all", 16, seed=2, targets=EVERYWHERE, scale=0.15,
                                    model_cls=LlavaNextForConditionalGeneration)}
    return base, adapters, sample_images()


def hf_references(base, adapters, images) -> list[list[int]]:
    """transformers (+ PEFT with each request's adapter): greedy tokens of every request, one model per adapter."""
    from peft import PeftModel
    from transformers import AutoProcessor, LlavaNextForConditionalGeneration

    proc = AutoProcessor.from_pretrained(base)
    refs = {}
    for name in {a for _, _, a in REQUESTS}:
        model = LlavaNextForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        for i, (text, idx, a) in enumerate(REQUESTS):
            if a == name:
                enc = proc(text=[text], images=[[images[j] for j in idx]], return_tensors="pt")
                with torch.no_grad():
                    seq = model.eval().generate(**enc, max_new_tokens=NUM_TOKENS, do_sample=False)
                refs[i] = seq[0, enc["input_ids"].shape[1]:].tolist()
    return [refs[i] for i in range(len(REQUESTS))]


def lora_llm(base, adapters):
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=16, max_loras=2)
    for name, path in adapters.items():
        llm.load_lora(name, str(path))
    return llm


def test_tower_and_connector_lora_match_transformers_peft(setup):
    base, adapters, images = setup
    llm = lora_llm(base, adapters)
    manager = llm.engine.core.executor.runner.lora
    mappings = {"decoder": manager.mapping, **manager.encoder_mappings}
    parts = {(name.split(".")[0], next(s for s, m in mappings.items() if k.mapping is m))
             for name, k in manager.kernels.items()}
    assert parts == {("language_model", "decoder"), ("vision_tower", "tower"), ("multi_modal_projector", "connector")}
    reqs = [{"prompt": t, "multi_modal_data": {"image": [images[i] for i in idx]}} for t, idx, _ in REQUESTS]
    outs = llm.generate(reqs, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True),
                        lora_request=[a for _, _, a in REQUESTS])
    refs = hf_references(base, adapters, images)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert refs[0] != refs[3]  # the vision-only adapter changes what the decoder sees


def test_encoder_rows_come_from_tiles_and_decoder_rows_are_the_placeholders(setup):
    from transformers import AutoProcessor

    base, adapters, images = setup
    llm = lora_llm(base, adapters)
    runner = llm.engine.core.executor.runner
    manager, model = runner.lora, runner.model
    encoder_rows, decoder_rows = [], []
    set_encoder, set_decoder = manager.set_encoder_mapping, manager.mapping.set

    def spy_encoder(lora_id, rows, live):
        encoder_rows.append((lora_id, dict(rows)))
        set_encoder(lora_id, rows, live)

    def spy_decoder(token_slots):
        decoder_rows.append((token_slots.copy(), runner.buffers.ids_np[:len(token_slots)].copy()))
        set_decoder(token_slots)
    manager.set_encoder_mapping, manager.mapping.set = spy_encoder, spy_decoder
    text, idx, name = REQUESTS[1]
    imgs = [images[i] for i in idx]
    out = llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}},
                       SamplingParams(temperature=0, max_tokens=1), lora_request=name)[0]

    proc = AutoProcessor.from_pretrained(base)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    lora_id = llm.engine.loras[name].lora_id
    patches = (model.hf.vision_config.image_size // model.hf.vision_config.patch_size) ** 2
    expected, placeholders = [], []
    for img in imgs:  # each image alone: its own tiles, no padding to another image's
        enc = proc(text=["<image>"], images=[[img]], return_tensors="pt")
        tiles = enc["pixel_values"].shape[1]
        expected.append((lora_id, {"tower": tiles * (patches + 1), "connector": tiles * patches}))
        placeholders.append(int((enc["input_ids"][0] == image_id).sum()))
    assert encoder_rows == expected
    assert all(rows["tower"] != n for (_, rows), n in zip(encoder_rows, placeholders))  # not the placeholders
    assert len({rows["tower"] for _, rows in encoder_rows}) == 2  # two tilings
    slot = manager.slot_of[lora_id]
    slots, ids = decoder_rows[0]  # the prefill step
    assert int(((ids == image_id) & (slots == slot)).sum()) == sum(placeholders) == \
        out.prompt_token_ids.count(image_id) == int((ids == image_id).sum())
    assert np.all(slots[:len(out.prompt_token_ids)] == slot)

    # a mapping built from the placeholder count instead is refused by the first tower layer
    manager.set_encoder_mapping = set_encoder
    model.lora_encoder_tokens = lambda image: {"tower": placeholders[0], "connector": placeholders[0]}
    with pytest.raises(RuntimeError, match="input rows"):
        llm.generate({"prompt": "<image>\nx", "multi_modal_data": {"image": imgs[:1]}},
                     SamplingParams(temperature=0, max_tokens=1), lora_request=name)


def test_paligemma_refuses_tower_lora(tiny_mm_models, tmp_path):
    """PaliGemma takes LoRA on its decoder only: an adapter on its SigLIP tower is refused, naming the module."""
    from transformers import PaliGemmaForConditionalGeneration

    base = tiny_mm_models["paligemma"]
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=8, max_loras=1)
    bad = make_adapter(base, tmp_path / "pg_tower", 4, seed=3, targets=r".*vision_tower\..*\.fc1",
                       model_cls=PaliGemmaForConditionalGeneration)
    with pytest.raises(ControlCallError,
                       match=r"vision_tower\.encoder\.layers\.0\.mlp\.fc1 is not a LoRA target") as err:
        llm.load_lora("tower", str(bad))
    assert err.value.status_code == 400 and isinstance(err.value.outcomes[0], LoRAAdapterError)
    ok = make_adapter(base, tmp_path / "pg_decoder", 4, seed=4, targets=r".*language_model\..*\.(q_proj|down_proj)",
                      model_cls=PaliGemmaForConditionalGeneration)
    llm.load_lora("decoder", str(ok))
    adapter = llm.engine.core.executor.runner.lora.cpu[llm.engine.loras["decoder"].lora_id]
    assert sorted(adapter.layers) == [f"language_model.layers.{i}.{m}" for i in range(2)
                                      for m in ("mlp.down_proj", "self_attn.qkv_proj")]


def test_legacy_adapter_names_load_the_same(setup, tmp_path):
    """An adapter saved with transformers 4's LLaVA layout (language_model.model.*, vision_tower.vision_model.*)
    reads into the same layers as transformers 5's (model.language_model.*, model.vision_tower.*)."""
    import shutil

    from safetensors.torch import load_file, save_file

    base, adapters, _ = setup
    legacy = tmp_path / "legacy"
    shutil.copytree(adapters["all"], legacy)
    renames = [("base_model.model.model.language_model.", "base_model.model.language_model.model."),
               ("base_model.model.model.vision_tower.", "base_model.model.vision_tower.vision_model."),
               ("base_model.model.model.multi_modal_projector.", "base_model.model.multi_modal_projector.")]
    tensors = {}
    for key, t in load_file(str(adapters["all"] / "adapter_model.safetensors")).items():
        for old, new in renames:
            key = key.replace(old, new)
        tensors[key] = t
    assert not any(k.startswith("base_model.model.model.") for k in tensors)
    save_file(tensors, str(legacy / "adapter_model.safetensors"))
    llm = LLM(str(base), progress=False, enable_lora=True, max_lora_rank=16, max_loras=2)
    manager = llm.engine.core.executor.runner.lora
    new_layers, old_layers = (manager.cpu[llm.load_lora(n, str(p)).lora_id].layers
                              for n, p in (("new", adapters["all"]), ("old", legacy)))
    assert sorted(new_layers) == sorted(old_layers) and any(n.startswith("vision_tower.") for n in new_layers)
    for name, shards in new_layers.items():
        for mine, theirs in zip(shards, old_layers[name]):
            assert (mine is None) == (theirs is None)
            if mine is not None:
                assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
