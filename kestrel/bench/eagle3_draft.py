"""Random EAGLE-3 drafts written in the public formats (config.json + model.safetensors): the EAGLE authors' /
SGLang layout (`midlayer.*`, architectures LlamaForCausalLMEagle3) and Red Hat speculators' (`layers.0.*`, a
speculators config with the layer's config under transformer_layer_config). The tests' tiny drafts
(tests/spec_decode/eagle3_tiny.py) and the drafter-cost benchmark's full-size one (benchmarks/spec_eagle.py) are
both written here."""
from __future__ import annotations

import json
from pathlib import Path

import torch

LLAMA_LAYER = dict(model_type="llama", num_hidden_layers=1, hidden_act="silu", tie_word_embeddings=False)


def draft_config(layout: str, layer: dict, draft_vocab: int, aux: list[int] | None,
                 norm_before_residual: bool) -> dict:
    if layout == "midlayer":
        cfg = dict(layer, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                   norm_before_residual=norm_before_residual)
        if aux is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
        return cfg
    cfg = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"], transformer_layer_config=layer,
               draft_vocab_size=draft_vocab, norm_before_residual=norm_before_residual,
               target_hidden_size=layer["hidden_size"],
               speculators_config={"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                                   "verifier": {"name_or_path": "tiny-llama", "architectures": ["LlamaForCausalLM"]}})
    if aux is not None:
        cfg["eagle_aux_hidden_state_layer_ids"] = aux
    return cfg


def write_eagle3_draft(out: Path, layer: dict, draft_vocab: int, layout: str = "midlayer", seed: int = 0,
                       aux: list[int] | None = None, own_embed: bool = False, norm_before_residual: bool = False,
                       copy_of: dict | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """A random draft whose decoder layer is `layer` (a Llama config: vocab_size and hidden_size the target's),
    over `draft_vocab` target tokens (d2t/t2d). `copy_of` (a bigram target's weights): a draft that predicts exactly
    the target's next token after token t+1, so every greedy draft is right. Its attention attends to its own
    position only (q = k = a large constant bias, whose rotary score is largest at distance 0), carries
    input_layernorm(embed(t+1)) through v/o_proj, hidden_norm is zero (norm_before_residual: the hidden path adds
    nothing), the MLP adds nothing, and norm/lm_head are the target's final norm and head over a permuted full
    vocabulary."""
    from safetensors.torch import save_file

    copy = copy_of is not None
    vocab, h = layer["vocab_size"], layer["hidden_size"]
    heads, kv_heads, inter = layer["num_attention_heads"], layer["num_key_value_heads"], layer["intermediate_size"]
    if copy:
        layer = dict(layer, attention_bias=True, num_key_value_heads=heads)
        kv_heads, norm_before_residual, draft_vocab = heads, True, vocab
    hd = layer.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (0.08 * torch.randn(*shape, generator=g)).to(dtype)

    def norm_w():
        return (1 + 0.2 * torch.randn(h, generator=g)).to(dtype)

    n_aux = 3
    w = {"fc.weight": rand(h, n_aux * h), "norm.weight": norm_w()}
    mid = {"input_layernorm.weight": norm_w(), "hidden_norm.weight": norm_w(),
           "post_attention_layernorm.weight": norm_w(),
           "self_attn.q_proj.weight": rand(heads * hd, 2 * h), "self_attn.k_proj.weight": rand(kv_heads * hd, 2 * h),
           "self_attn.v_proj.weight": rand(kv_heads * hd, 2 * h), "self_attn.o_proj.weight": rand(h, heads * hd),
           "mlp.gate_proj.weight": rand(inter, h), "mlp.up_proj.weight": rand(inter, h),
           "mlp.down_proj.weight": rand(h, inter)}
    if copy:
        big = torch.full((heads * hd,), 20.0)
        mid.update({"self_attn.q_proj.weight": torch.zeros(heads * hd, 2 * h), "self_attn.q_proj.bias": big,
                    "self_attn.k_proj.weight": torch.zeros(heads * hd, 2 * h), "self_attn.k_proj.bias": big.clone(),
                    "self_attn.v_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1),
                    "self_attn.v_proj.bias": torch.zeros(h), "self_attn.o_proj.weight": torch.eye(h),
                    "self_attn.o_proj.bias": torch.zeros(h),
                    "input_layernorm.weight": torch.ones(h), "hidden_norm.weight": torch.zeros(h),
                    "mlp.down_proj.weight": torch.zeros(h, inter)})
        w["norm.weight"] = copy_of["model.norm.weight"].clone()
    # the draft vocabulary: some target ids (all of them, permuted, for the copy draft)
    ids = torch.randperm(vocab, generator=g)[:draft_vocab]
    ids = ids if copy else ids.sort().values
    w["lm_head.weight"] = copy_of["lm_head.weight"][ids].clone() if copy else rand(draft_vocab, h)
    w["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    if own_embed:
        w["embed_tokens.weight"] = copy_of["model.embed_tokens.weight"].clone() if copy else rand(vocab, h)
    prefix = "midlayer." if layout == "midlayer" else "layers.0."
    w.update({prefix + k: v for k, v in mid.items()})
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(draft_config(layout, layer, draft_vocab, aux, norm_before_residual)))
    save_file({k: v.contiguous() for k, v in w.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out
