"""Tiny random EAGLE-3 drafts in the public formats (kestrel/bench/eagle3_draft.py writes them) for a tiny Llama
target."""
from __future__ import annotations

from pathlib import Path

import torch

from kestrel.bench.eagle3_draft import LLAMA_LAYER, write_eagle3_draft
from tests.tiny import make_checkpoint

LAYER = dict(LLAMA_LAYER, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
             max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
TARGET_LAYERS = 7  # the default aux layers 2, 3, 4 are distinct


def eagle3_target(root: Path, bigram: bool = False, **overrides) -> Path:
    """A tiny Llama target; `bigram`: every o_proj and down_proj zeroed, so the residual stream is the token's
    embedding at every layer and the next token is a function of the last token only."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint("llama", root, name=f"eagle3_target{'_bigram' if bigram else ''}",
                           **{"num_hidden_layers": TARGET_LAYERS, **overrides})
    if bigram:
        weights = load_file(path / "model.safetensors")
        weights["model.norm.weight"] = 1 + 0.3 * torch.randn_like(weights["model.norm.weight"])
        for name, t in weights.items():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                weights[name] = torch.zeros_like(t)
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def eagle3_draft(root: Path, target: Path, layout: str = "midlayer", seed: int = 0, draft_vocab: int = 256,
                 aux: list[int] | None = None, own_embed: bool = False, norm_before_residual: bool = False,
                 copy: bool = False) -> Path:
    """A random draft for `target` over `draft_vocab` target tokens; `copy` (for a bigram target): every greedy draft
    is right (kestrel/bench/eagle3_draft.py says how)."""
    from safetensors.torch import load_file

    tw = load_file(target / "model.safetensors")
    vocab, h = tw["model.embed_tokens.weight"].shape
    out = root / f"eagle3_{layout}_{seed}{'_copy' if copy else ''}{'_embed' if own_embed else ''}"
    return write_eagle3_draft(out, dict(LAYER, vocab_size=vocab, hidden_size=h, attention_bias=copy), draft_vocab,
                              layout, seed, aux, own_embed, norm_before_residual, copy_of=tw if copy else None)
