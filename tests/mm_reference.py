"""What the M-RoPE image tests (Qwen-VL, Qwen3.5, GLM-4.xV) share: a prompt with some of the test's images, and
transformers' reference for each prompt: its prompt ids, greedy tokens and M-RoPE positions."""
import torch


def image_request(text: str, idx: list[int], images: list):
    """The engine's prompt: plain text, or text with images[i] for i in idx."""
    return {"prompt": text, "multi_modal_data": {"image": [images[i] for i in idx]}} if idx else text


def mrope_reference(path, proc, prompts: list[tuple[str, list[int]]], images: list, max_new_tokens: int) -> list:
    """Per (text, image indices): (prompt ids, greedy tokens, positions [3, 1, T] or None for text), float32."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
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
