"""What the M-RoPE image tests (Qwen-VL, Qwen3.5, GLM-4.xV) share: a prompt with some of the test's images, and
transformers' reference for each prompt: its prompt ids, greedy tokens and M-RoPE positions."""
import torch


def image_request(text: str, idx: list[int], images: list):
    """The engine's prompt: plain text, or text with images[i] for i in idx."""
    return {"prompt": text, "multi_modal_data": {"image": [images[i] for i in idx]}} if idx else text


def reference_model(path):
    """transformers' model of the checkpoint, float32, for inference."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def mrope_reference(path, proc, prompts: list[tuple[str, list[int]]], images: list, max_new_tokens: int) -> list:
    """Per (text, image indices): (prompt ids, greedy tokens, positions [3, 1, T] or None for text), float32."""
    model = reference_model(path)
    out = []
    for text, idx in prompts:
        enc = proc(text=[text], images=[[images[i] for i in idx]] if idx else None, return_tensors="pt")
        seq = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        positions = None
        if idx:
            positions = model.model.get_rope_index(enc["input_ids"], enc["mm_token_type_ids"],
                                                   image_grid_thw=enc["image_grid_thw"])
        out.append((enc["input_ids"][0].tolist(), seq[0, enc["input_ids"].shape[1]:].tolist(), positions))
    return out


def sized_images(sizes: list[tuple[int, int]]) -> list:
    """The image tests' images: one per (width, height), each drawn from its own seed."""
    from tests.mm_tiny import make_image

    return [make_image(w, h, seed=10 + i) for i, (w, h) in enumerate(sizes)]


def assert_greedy_and_positions(llm, prompts: list[tuple[str, list[int]]], images: list, reference: list,
                                params) -> None:
    """Against mrope_reference's (ids, tokens, positions) per prompt: the engine's prompt ids and greedy tokens,
    the images changing the outputs, and each prompt with images getting its M-RoPE positions and delta."""
    import numpy as np

    outs = llm.generate([image_request(t, i, images) for t, i in prompts], params)
    assert [o.prompt_token_ids for o in outs] == [ids for ids, _, _ in reference]
    assert [o.outputs[0].token_ids for o in outs] == [toks for _, toks, _ in reference]
    assert len({tuple(t) for _, t, _ in reference}) == len(reference)  # the images change the outputs
    for (text, idx), (_, _, ref) in zip(prompts, reference):
        if ref is None:  # text only
            continue
        _, (req,) = llm.engine.input_processor.process("r", image_request(text, idx, images), params)
        assert np.array_equal(req.extras.positions.array(), ref[0][:, 0].numpy())
        assert req.extras.positions.delta == int(ref[1])


def video_request(text: str, frames, meta: dict | None, with_image: bool) -> dict:
    """The engine's prompt with one video (with its metadata where given) and, `with_image`, the video tests' image."""
    from tests.mm_tiny import make_image

    data = {"video": (frames, meta) if meta else frames}
    if with_image:
        data["image"] = [make_image(120, 70, seed=10)]
    return {"prompt": text, "multi_modal_data": data}


def video_inputs(proc, text: str, frames, meta: dict | None, with_image: bool, **kw):
    """transformers' processor outputs for the same prompt (the metadata dropped: the model takes none)."""
    from tests.mm_tiny import make_image

    if meta:
        kw["video_metadata"] = [meta]
    images = [[make_image(120, 70, seed=10)]] if with_image else None
    enc = proc(text=[text], videos=[frames], images=images, return_tensors="pt", **kw)
    enc.pop("video_metadata", None)
    return enc


def assert_matches_reference(llm, requests: list, reference: list, params, chunked: bool = False) -> None:
    """The engine's prompt ids, greedy tokens and M-RoPE positions equal the reference's (ids, tokens, positions
    [3, 1, T], delta) per request; `chunked` (an engine whose prefill is cut in chunks): the tokens only."""
    import numpy as np

    outs = llm.generate(requests, params)
    assert [o.outputs[0].token_ids for o in outs] == [r[1] for r in reference]
    if chunked:
        return
    assert [o.prompt_token_ids for o in outs] == [r[0] for r in reference]
    for request, (_, _, positions, delta) in zip(requests, reference):
        _, (req,) = llm.engine.input_processor.process("r", request, params)
        assert np.array_equal(req.extras.positions.array(), positions[:, 0].numpy())
        assert req.extras.positions.delta == int(delta)
