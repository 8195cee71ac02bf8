"""A tiny DeepSeek-V3 (MLA + MoE) checkpoint with MTP layers past num_hidden_layers, named as DeepSeek's
checkpoints name them (model.layers.{N+i}.{enorm, hnorm, eh_proj, shared_head.norm, <decoder layer>}), built with
transformers' own MtpModel."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import make_checkpoint


def mtp_checkpoint(root: Path, num_mtp_layers: int = 1, seed: int = 0, bigram: bool = False, **checkpoint_kw) -> Path:
    """`bigram`: every attention and MLP output projection zeroed in the target (its next token is a function of
    the last token only) and an MTP layer that passes enorm(embed(token t+1)) through, so its draft is exactly the
    target's next token after token t+1: every greedy draft is accepted. `checkpoint_kw` go to make_checkpoint
    (wider dimensions for the GPU kernels, a tokenizer)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    path = make_checkpoint("deepseek_v3_moe", root, seed=seed,
                           name=f"deepseek_v3_mtp{num_mtp_layers}{'_bigram' if bigram else ''}",
                           num_mtp_layers=num_mtp_layers, **checkpoint_kw)
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n = target.config.num_hidden_layers
    torch.manual_seed(seed + 1)
    mtp = MtpModel(target, num_mtp_layers).float()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if not name.startswith(("embed_tokens", "shared_head")):
                p.normal_(0, 0.08) if p.dim() > 1 else p.fill_(1.0)
        if bigram:
            for layer in mtp.layers:
                h = layer.eh_proj.weight.shape[0]
                layer.eh_proj.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
    weights = load_file(path / "model.safetensors")
    # a final norm weight other than ones, so the MTP layer's hnorm tells pre-norm from post-norm hidden states
    weights["model.norm.weight"] = 1 + 0.3 * torch.randn_like(weights["model.norm.weight"])
    for name, t in mtp.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head", "rotary")):
            continue
        i, rest = name.removeprefix("layers.").split(".", 1)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        weights[f"model.layers.{n + int(i)}.{rest}"] = t.contiguous()
    if bigram:
        for i in range(num_mtp_layers):  # the MTP head's norm is then the target's final norm
            weights[f"model.layers.{n + i}.shared_head.norm.weight"] = weights["model.norm.weight"].clone()
        for name, t in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                weights[name] = torch.zeros_like(t)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
