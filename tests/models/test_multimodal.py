"""PaliGemma and LLaVA-NeXT against transformers on tiny random checkpoints with real processors (CPU float32):
greedy tokens identical for 24 tokens on three images of different sizes and aspect ratios, one and two images
per prompt, also with chunked prefill through an image; PaliGemma's image embeddings at transformers' magnitude;
LLaVA-NeXT token counts equal to the processor's placeholders; prefix caching keyed by image content."""
from __future__ import annotations

import pytest
import torch

from kestrel import LLM, SamplingParams
from kestrel.errors import InvalidRequest
from kestrel.platform.testing import requires_triton_interpreter
from kestrel.worker.addons.images import ImageEncoderCache
from tests.mm_tiny import make_image, sample_images

NUM_TOKENS = 24
PROMPTS = {  # (text, image indices)
    "paligemma": [("<image>caption en", [0]), ("<image>describe", [1]), ("<image>what is it", [2]),
                  ("<image><image>compare", [0, 2]), ("<image><image>which", [1, 0])],
    "llava_next": [("<image>\nwhat is this", [0]), ("describe <image>\nplease", [1]), ("<image>\nhello", [2]),
                   ("<image>\n<image>\ncompare them", [0, 2]), ("first <image>\nthen <image>\nok", [1, 0])],
}
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)


def request(text, idx, images):
    return {"prompt": text, "multi_modal_data": {"image": [images[i] for i in idx]}}


@pytest.fixture(scope="module")
def images():
    return sample_images()


def hf_model(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return (AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(path))


@pytest.fixture(scope="module")
def reference(tiny_mm_models, images):
    out = {}
    for kind, prompts in PROMPTS.items():
        model, proc = hf_model(tiny_mm_models[kind])
        out[kind] = []
        for text, idx in prompts:
            enc = proc(text=[text], images=[[images[i] for i in idx]], return_tensors="pt")
            seq = model.generate(**enc, max_new_tokens=NUM_TOKENS, do_sample=False)
            out[kind].append(seq[0, enc["input_ids"].shape[1]:].tolist())
    return out


def count_encoder_runs(llm):
    model = llm.engine.core.executor.runner.model
    calls = []
    inner = model.embed_image

    def counted(image):
        calls.append(image["pixel_values"].shape)
        return inner(image)
    model.embed_image = counted
    return calls


@pytest.mark.parametrize("kind", ["paligemma", "llava_next"])
def test_greedy_matches_transformers(tiny_mm_models, images, reference, kind):
    llm = LLM(str(tiny_mm_models[kind]), progress=False)
    runs = count_encoder_runs(llm)
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS[kind]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference[kind]
    assert len(runs) == sum(len(i) for _, i in PROMPTS[kind])  # each image encoded once
    assert len({tuple(r) for r in reference[kind]}) == len(reference[kind])  # the images change the outputs


def test_llava_next_qwen2_decoder(tmp_path, images):
    from tests.mm_tiny import make_llava_next

    path = make_llava_next(tmp_path, name="llava_qwen2", decoder="qwen2")
    model, proc = hf_model(path)
    text, idx = PROMPTS["llava_next"][3]
    enc = proc(text=[text], images=[[images[i] for i in idx]], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=NUM_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1]:].tolist()
    llm = LLM(str(path), progress=False, max_num_batched_tokens=32)
    assert llm.generate(request(text, idx, images), GREEDY)[0].outputs[0].token_ids == ref


def test_llava_chunked_prefill_through_images(tiny_mm_models, images, reference):
    """A 16-token budget cuts every image's placeholders (36..96 of them) over several steps: the encoder runs
    once per image and its cached embeddings are dropped after the last placeholder."""
    llm = LLM(str(tiny_mm_models["llava_next"]), progress=False, max_num_batched_tokens=16, block_size=4,
              enable_prefix_caching=False)
    runs = count_encoder_runs(llm)
    runner = llm.engine.core.executor.runner
    (images_addon,) = [a for a in runner.addons if isinstance(a, ImageEncoderCache)]
    steps_inside_image = 0
    orig = images_addon.inputs_embeds

    def watch(chunks, states, input_ids):
        nonlocal steps_inside_image
        out = orig(chunks, states, input_ids)
        for c, st in zip(chunks, states):
            end = c.num_computed_tokens + c.num_new_tokens
            if any(f.offset < end < f.end for f in st.extras.mm_features):
                steps_inside_image += 1
                assert images_addon.cache[c.request_id]  # kept for the image's next chunk
        return out
    runner._hooks["inputs_embeds"] = [watch]
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS["llava_next"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["llava_next"]
    assert steps_inside_image >= 5
    assert len(runs) == 7
    assert not any(images_addon.cache.values())  # every image's cache was released


def test_paligemma_prefix_is_one_chunk(tiny_mm_models, images, reference):
    """PaliGemma's image + prompt attend to each other both ways, so the scheduler never cuts that prefix: with a
    budget just above the longest prefix, other requests wait instead, and the outputs still match."""
    llm = LLM(str(tiny_mm_models["paligemma"]), progress=False, max_num_batched_tokens=40, block_size=4)
    sched = llm.engine.core.scheduler
    orig = sched.schedule

    def checked():
        out = orig()
        for s in out.scheduled:
            r = s.request
            if s.num_computed_tokens < r.extras.bidirectional_len:
                assert s.num_computed_tokens + s.num_new_tokens >= r.extras.bidirectional_len
        return out
    sched.schedule = checked
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS["paligemma"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference["paligemma"]
    small = LLM(str(tiny_mm_models["paligemma"]), progress=False, max_num_batched_tokens=16)
    with pytest.raises(InvalidRequest, match="bidirectional prefix"):
        small.generate([request(*PROMPTS["paligemma"][0], images)], GREEDY)


def test_paligemma_prefix_attention_is_bidirectional(tiny_mm_models, images, reference):
    """The same engine with a causal prefix gives other tokens: the bidirectional mask is what matches."""
    llm = LLM(str(tiny_mm_models["paligemma"]), progress=False)
    llm.engine.input_processor.mm.bidirectional_prefix = False  # the processor sends no prefix length
    outs = llm.generate([request(t, i, images) for t, i in PROMPTS["paligemma"][:3]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] != reference["paligemma"][:3]


@pytest.mark.parametrize("kind", ["paligemma", "llava_next"])
def test_embedding_contract(tiny_mm_models, kind):
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)), as for every text model."""
    from tests.agreement import assert_embedding_contract

    assert_embedding_contract(tiny_mm_models[kind])


@pytest.mark.parametrize("kind", ["paligemma", "llava_next"])
def test_dummy_image_is_the_largest(tiny_mm_models, images, kind):
    """The start-up memory profile and warm-up encode the model's largest image: its embedding count is the one
    num_image_tokens gives for its inputs, and no real image of the processor gives more."""
    from kestrel.config import EngineConfig
    from kestrel.engine.core import EngineCore
    from kestrel.frontend.processor import make_mm_processor

    config = EngineConfig.create(model=str(tiny_mm_models[kind]), num_kv_blocks=8)
    core = EngineCore(config, progress=False)
    runner = core.executor.runner
    (emb,) = [a.warm_up() for a in runner.addons if isinstance(a, ImageEncoderCache)]
    model_cls = type(runner.model)
    mm = make_mm_processor(config)
    n = model_cls.num_image_tokens(mm.hf_config, runner.model.dummy_image_inputs())
    assert emb.shape == (n, mm.hf_config.text_config.hidden_size)
    sizes = [(33, 70), (90, 40), (64, 60), (1000, 30), (30, 1000), (500, 500)]
    real = [model_cls.num_image_tokens(mm.hf_config, data) for w, h in sizes
            for data in model_cls.split_images(mm.hf_config, mm.processor(
                text=[f"{mm.image_token}x"], images=[[make_image(w, h, seed=0)]], return_tensors="pt"))]
    assert max(real) <= n
    if kind == "llava_next":  # the widest grid is reachable: some image size gets exactly the dummy's count
        assert max(real) == n


# ---- PaliGemma's embedding magnitude
def hf_decoder_inputs(model, proc, text, imgs):
    seen = {}

    def hook(module, args, kwargs):
        seen.setdefault("embeds", kwargs["inputs_embeds"][0].detach().clone())
    h = model.model.language_model.register_forward_pre_hook(hook, with_kwargs=True)
    enc = proc(text=[text], images=[imgs], return_tensors="pt")
    with torch.no_grad():
        model(**enc)
    h.remove()
    return enc["input_ids"][0], seen["embeds"]


def kestrel_decoder_inputs(llm, text, imgs):
    lm = llm.engine.core.executor.runner.model.language_model
    seen = {}
    inner = lm.forward

    def spy(input_ids, positions, ctx, inputs_embeds=None):
        seen.setdefault("embeds", inputs_embeds.detach().clone())
        return inner(input_ids, positions, ctx, inputs_embeds=inputs_embeds)
    lm.forward = spy
    llm.generate({"prompt": text, "multi_modal_data": {"image": imgs}}, SamplingParams(temperature=0, max_tokens=1))
    lm.forward = inner
    return seen["embeds"]


def assert_image_embedding_norms_match(llm, model, proc, images):
    ids, ref = hf_decoder_inputs(model, proc, "<image>caption en", images[:1])
    ours = kestrel_decoder_inputs(llm, "<image>caption en", images[:1])
    rows = ids == model.config.image_token_id
    assert rows.sum() == 16
    ref_norm, our_norm = ref[rows].norm(), ours[rows].norm()
    assert torch.allclose(our_norm, ref_norm, rtol=1e-5, atol=0), (float(our_norm), float(ref_norm))
    assert torch.allclose(ours[~rows].norm(), ref[~rows].norm(), rtol=1e-5, atol=0)


def test_paligemma_image_embedding_scale(tiny_mm_models, images, monkeypatch):
    """The merged image rows have transformers' norm (rel 1e-5); a legacy inverse scaling (image embeddings divided
    by sqrt(hidden) to cancel Gemma's normalizer) is caught by the same check."""
    llm = LLM(str(tiny_mm_models["paligemma"]), progress=False, enable_prefix_caching=False)
    model, proc = hf_model(tiny_mm_models["paligemma"])
    assert_image_embedding_norms_match(llm, model, proc, images)

    pg = llm.engine.core.executor.runner.model
    inner = pg.embed_image
    monkeypatch.setattr(pg, "embed_image", lambda image: inner(image) / pg.config.hidden_size ** 0.5)
    with pytest.raises(AssertionError):
        assert_image_embedding_norms_match(llm, model, proc, images)


# ---- LLaVA-NeXT token counts
SIZES = [(28, 28), (90, 40), (33, 70), (64, 60), (1, 1), (200, 13), (13, 200), (55, 111), (300, 299), (84, 28)]
REAL_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]


def llava_processor(pinpoints, tile, patch):
    from transformers import CLIPVisionConfig, LlavaNextConfig, LlavaNextProcessor
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    from kestrel.bench.tiny_tokenizer import tokenizer_with_image_token

    ip = LlavaNextImageProcessorPil(size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile},
                                    image_grid_pinpoints=pinpoints)
    proc = LlavaNextProcessor(image_processor=ip, tokenizer=tokenizer_with_image_token(), patch_size=patch,
                              vision_feature_select_strategy="default", image_token="<image>",
                              num_additional_image_tokens=1)
    cfg = LlavaNextConfig(vision_config=CLIPVisionConfig(image_size=tile, patch_size=patch).to_dict(),
                          text_config={"model_type": "llama"}, image_grid_pinpoints=pinpoints)
    return proc, cfg


@pytest.mark.parametrize("pinpoints,tile,patch,scale", [
    ([[28, 56], [56, 28], [56, 56], [28, 84]], 28, 7, 1),  # the tiny model's
    (REAL_PINPOINTS, 336, 14, 4),  # llava-v1.6's, images 4x larger
])
def test_llava_next_token_counts(pinpoints, tile, patch, scale):
    from kestrel.models.llava_next import LlavaNextForConditionalGeneration as Llava

    proc, cfg = llava_processor(pinpoints, tile, patch)
    image_id = proc.tokenizer.convert_tokens_to_ids("<image>")
    table = []
    for i, (w, h) in enumerate(SIZES):
        enc = proc(text=["<image>"], images=[[make_image(w * scale, h * scale, i)]], return_tensors="pt")
        (image,) = Llava.split_images(cfg, enc)
        table.append(((w * scale, h * scale), Llava.num_image_tokens(cfg, image),
                      int((enc["input_ids"][0] == image_id).sum())))
    assert all(ours == theirs for _, ours, theirs in table), table
    assert len({ours for _, ours, _ in table}) >= 4  # the sizes exercise different grids and unpadding


# ---- prefix caching by image content
def test_prefix_cache_keyed_by_image(tiny_mm_models, images):
    llm = LLM(str(tiny_mm_models["llava_next"]), progress=False, block_size=4)
    kv = llm.engine.core.kv
    text = "describe this picture for me please <image>\nnow"
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": images[0]}}, GREEDY)[0]
    offset = first.prompt_token_ids.index(llm.engine.input_processor.mm.image_token_id)
    assert offset >= 8
    hits = kv.prefix_hits
    other = llm.generate({"prompt": text, "multi_modal_data": {"image": images[1]}}, GREEDY)[0]
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    # only whole blocks before the image can be shared
    assert 0 < other.num_cached_tokens <= offset // 4 * 4
    assert kv.prefix_hits - hits == other.num_cached_tokens
    hits = kv.prefix_hits
    again = llm.generate({"prompt": text, "multi_modal_data": {"image": images[0]}}, GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens > offset + 36 and kv.prefix_hits - hits == again.num_cached_tokens


def test_paligemma_prefix_cache_needs_the_whole_prefix(tiny_mm_models, images, reference):
    """Blocks of a bidirectional prefix saw every prefix token: another prompt after the same image shares none."""
    llm = LLM(str(tiny_mm_models["paligemma"]), progress=False, block_size=4)
    a = llm.generate(request(*PROMPTS["paligemma"][0], images), GREEDY)[0]
    b = llm.generate({"prompt": "<image>caption de", "multi_modal_data": {"image": images[0]}}, GREEDY)[0]
    assert b.num_cached_tokens == 0
    again = llm.generate(request(*PROMPTS["paligemma"][0], images), GREEDY)[0]
    assert again.num_cached_tokens > 16 and again.outputs[0].token_ids == a.outputs[0].token_ids == \
        reference["paligemma"][0]


# ---- inputs the engine refuses
def test_bad_multimodal_inputs(tiny_mm_models, tiny_llama, images):
    llm = LLM(str(tiny_mm_models["llava_next"]), progress=False, limit_mm_per_prompt=2)
    with pytest.raises(InvalidRequest, match="at most 2"):
        llm.generate({"prompt": "<image><image><image>", "multi_modal_data": {"image": images}}, GREEDY)
    with pytest.raises(InvalidRequest, match="not a PIL image"):
        llm.generate({"prompt": "<image>", "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(InvalidRequest, match="placeholder"):
        llm.generate("<image>\nwhat", GREEDY)
    with pytest.raises(InvalidRequest, match="modalities"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"audio": b""}}, GREEDY)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3))[0]
    assert len(out.outputs[0].token_ids) == 3
    text_llm = LLM(str(tiny_llama), progress=False)
    with pytest.raises(InvalidRequest, match="does not take images"):
        text_llm.generate({"prompt": "hi", "multi_modal_data": {"image": images[0]}}, GREEDY)


@pytest.mark.parametrize("kind", ["paligemma", "llava_next"])
def test_image_processing_on_render_threads(tiny_mm_models, images, kind):
    """The server runs the image processor on several render threads: each thread gets its own processor copy and
    the same ids, hashes and pixels as the thread that built it; a ProcessedPrompt made there gives generate() the
    requests the prompt dict gives."""
    from concurrent.futures import ThreadPoolExecutor

    from kestrel.config import EngineConfig
    from kestrel.frontend.processor import InputProcessor, ProcessedPrompt, make_mm_processor
    from kestrel.loader import load_hf_config

    config = EngineConfig()
    config.model.model = str(tiny_mm_models[kind])
    mm = make_mm_processor(config)
    hf = load_hf_config(config.model.model)
    inp = InputProcessor(None, 512, hf.text_config.vocab_size, mm=mm)
    prompts = [request(text, idx, images) for text, idx in PROMPTS[kind]] * 2
    here = [inp.process_images(p) for p in prompts]
    assert all(isinstance(p, ProcessedPrompt) for p in here)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda _: mm.warm_up(), range(3)))  # what the server does on each render thread at start-up
        there = list(pool.map(inp.process_images, prompts))
        procs = set(pool.map(lambda _: id(mm._thread_processor()), range(12)))
    assert id(mm.processor) not in procs and 1 <= len(procs) <= 3
    for a, b in zip(here, there):
        assert a.token_ids == b.token_ids and a.extras.bidirectional_len == b.extras.bidirectional_len
        fa, fb = a.extras.mm_features, b.extras.mm_features
        assert [f.mm_hash for f in fa] == [f.mm_hash for f in fb]
        assert [f.data == g.data for f, g in zip(fa, fb)] == [True] * len(fa)
    mm.pixel_dtype = torch.bfloat16  # a GPU server's model dtype: float pixels travel in it (the towers cast first)
    half = inp.process_images(prompts[0])
    mm.pixel_dtype = None
    for f, g in zip(half.extras.mm_features, here[0].extras.mm_features):
        assert f.data.keys() == g.data.keys() and f.mm_hash != g.mm_hash
        for name, td in f.data.items():
            ref, got = g.data[name].to_tensor(), td.to_tensor()
            assert got.dtype == (torch.bfloat16 if ref.is_floating_point() else ref.dtype)
            assert torch.equal(got, ref.to(got.dtype))
    ids, reqs = inp.process("r", there[0], SamplingParams(max_tokens=4))
    ids2, reqs2 = inp.process("r", prompts[0], SamplingParams(max_tokens=4))
    assert ids == ids2 and reqs[0].extras == reqs2[0].extras and reqs[0].extras.mm_features


def test_paligemma_with_siglip_pooling_head_flag_matches_transformers(tmp_path, images):
    """A PaliGemma checkpoint whose SigLIP config has `vision_use_head` on (SigLIP's default) also holds the pooling
    head's weights. PaliGemma never runs that head: the checkpoint loads, the head's tensors are dropped, and the
    greedy tokens are transformers'."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from kestrel.models.multimodal import rename_checkpoint
    from tests.mm_tiny import make_paligemma

    path = make_paligemma(tmp_path, name="paligemma_head", vision_use_head=True)
    assert AutoConfig.from_pretrained(path).vision_config.vision_use_head is True
    names = [rename_checkpoint(k) for f in path.glob("*.safetensors") for k in safe_open(str(f), "pt").keys()]
    assert any(k.startswith("vision_tower.head.") for k in names), names  # the tensors the loader must drop
    model, proc = hf_model(path)
    llm = LLM(str(path), progress=False)
    for text, idx in PROMPTS["paligemma"][:3]:
        enc = proc(text=[text], images=[[images[i] for i in idx]], return_tensors="pt")
        ref = model.generate(**enc, max_new_tokens=NUM_TOKENS, do_sample=False)[0, enc["input_ids"].shape[1]:]
        assert llm.generate(request(text, idx, images), GREEDY)[0].outputs[0].token_ids == ref.tolist(), text


@requires_triton_interpreter  # the Triton backend class imports triton (installed by scripts/setup.sh)
def test_wide_llava_gets_head_dim_64_and_the_triton_backend_on_a_gpu(tmp_path):
    """tests/gpu widens LLaVA-NeXT's decoder (hidden 256, 4 heads) for head dim 64, which the Triton backend takes.
    The width must reach the config's constructor, which derives head_dim: set afterwards, head_dim stayed 16 and
    the GPU picked the reference backend. Selection on a fake H200 from the loaded model's cache spec."""
    from kestrel.attention.selector import select_attention_backend
    from kestrel.core.kv_spec import group_layers
    from kestrel.platform import fake_platform
    from tests.mm_tiny import make_llava_next

    path = make_llava_next(tmp_path, name="llava_wide", hidden_size=256, intermediate_size=512)
    llm = LLM(str(path), dtype="bfloat16", progress=False)
    (group,) = group_layers(llm.engine.core.executor.runner.loaded.context.kv_cache_specs)
    assert group.spec.head_dim == 64
    h200 = fake_platform("sm_90", triton_available=True)
    assert select_attention_backend(group.spec, 16, platform=h200).name == "triton"
