"""The EAGLE-3 draft network (speculative_config method "eagle3") and its checkpoint loader: one Llama-style
decoder layer whose q/k/v read [embedding, fused target hidden state] (2H), `fc` fusing the target's residual
stream entering three of its layers, and a draft vocabulary mapped to target ids by `d2t`. The drafter that runs it
(KV cache, chaining, CUDA graphs) is kestrel/spec_decode/eagle3_drafter.py, whose docstring has the equations and
the checkpoint layouts read."""
from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch
from torch import nn

from kestrel.attention.layer import Attention
from kestrel.errors import ConfigError

_ALT = "use method 'ngram' or start without speculative_config"


def default_aux_layers(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def read_draft_config(folder: Path) -> dict:
    """The draft's Llama layer config with the EAGLE-3 keys at the top, from either layout's config.json."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"speculative_config method 'eagle3': no config.json in the draft folder {folder}")
    raw = json.loads(path.read_text())
    if "speculators_model_type" in raw:  # Red Hat speculators
        if raw["speculators_model_type"] != "eagle3":
            raise ConfigError(f"speculative_config method 'eagle3': {folder} is a speculators "
                              f"{raw['speculators_model_type']!r} draft, not eagle3")
        d = dict(raw.get("transformer_layer_config") or {})
        d["norm_before_residual"] = raw.get("norm_before_residual", True)
        for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc"):
            if raw.get(key) is not None:
                d[key] = raw[key]
        return d
    return {**raw, **(raw.get("eagle_config") or {})}  # some checkpoints nest the aux layer ids in eagle_config


def read_draft_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of the draft, named as in the speculators layout (`midlayer.` -> `layers.0.`, no `model.`)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if not files and not bins:
        raise ConfigError(f"speculative_config method 'eagle3': no *.safetensors or pytorch_model*.bin in {folder}")
    out = {}
    for f in files or bins:
        state = load_file(str(f)) if files else torch.load(f, map_location="cpu", weights_only=True)
        for name, t in state.items():
            name = name.removeprefix("model.")
            out["layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name] = t
    return out


class _Eagle3Projections(nn.Module):
    """The attention's projections, q/k/v taking the 2H input (the attention itself is the drafter's kestrel
    Attention layer, over its KV cache)."""

    def __init__(self, cfg):
        super().__init__()
        h, hd, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(2 * h, cfg.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(2 * h, cfg.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(cfg.num_attention_heads * hd, h, bias=bias)


class _Eagle3Layer(nn.Module):
    """The decoder layer: q/k/v widened to the 2H input, transformers' Llama norms and MLP."""

    def __init__(self, cfg, ll, norm_before_residual: bool):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.input_layernorm = ll.LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = ll.LlamaRMSNorm(h, eps=eps)
        self.post_attention_layernorm = ll.LlamaRMSNorm(h, eps=eps)
        self.self_attn = _Eagle3Projections(cfg)
        self.mlp = ll.LlamaMLP(cfg)

    def forward(self, embeds, hidden, positions, ctx, attn: Attention) -> torch.Tensor:
        """[T, H] embeddings of tokens t+1 and hidden states at positions t [T] (a flattened batch, `ctx` its
        metadata) -> the layer output g [T, H]; writes the tokens' K/V into the draft's cache."""
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        p = self.self_attn
        out = p.o_proj(attn(torch.cat([p.q_proj(x), p.k_proj(x), p.v_proj(x)], dim=-1), positions, ctx))
        residual = (normed if self.norm_before_residual else hidden) + out
        return residual + self.mlp(self.post_attention_layernorm(residual))


class _Eagle3Net(nn.Module):
    """The draft's parameters, named as the speculators checkpoint names them."""

    def __init__(self, cfg, ll, num_aux: int, target_hidden: int, draft_vocab: int, norm_before_residual: bool,
                 own_embed: bool):
        super().__init__()
        self.fc = nn.Linear(num_aux * target_hidden, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([_Eagle3Layer(cfg, ll, norm_before_residual)])
        self.norm = ll.LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if own_embed else None


def _check_target(target, num_layers: int, aux: list[int]) -> None:
    layers = getattr(target, "layers", None)
    params = list(inspect.signature(layers[0].forward).parameters)[:3] if layers else []
    if params != ["positions", "hidden", "residual"] or not hasattr(target, "embed_input_ids"):
        raise ConfigError(f"speculative_config method 'eagle3' does not support {type(target).__name__} targets "
                          f"yet (it reads the residual stream entering Llama-style decoder layers); {_ALT}")
    if len(set(aux)) != len(aux) or not all(0 <= i < num_layers for i in aux):
        raise ConfigError(f"speculative_config method 'eagle3': eagle_aux_hidden_state_layer_ids {aux} must be "
                          f"distinct layers of the target's {num_layers}; set them in the draft's config.json")



def load_eagle3(draft_path: str, target, hf_config):
    """The draft from its folder, checked against the target: (net, its Llama config, the target layers whose
    input it reads, sorted; the draft -> target vocabulary map [draft_vocab] on the CPU)."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as ll

    folder = Path(draft_path)
    d = read_draft_config(folder)
    num_layers, target_hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    target_vocab = hf_config.vocab_size
    aux = list(d.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers))
    _check_target(target, num_layers, aux)
    refusals = []
    if d.get("quantization_config"):
        refusals.append("a quantized draft")
    if d.get("num_hidden_layers", 1) != 1:
        refusals.append(f"a draft of {d['num_hidden_layers']} layers (one only)")
    if d.get("norm_before_fc"):
        refusals.append("norm_before_fc")
    if d.get("target_hidden_size", d.get("hidden_size")) != target_hidden:
        refusals.append(f"a draft for target hidden size {d.get('target_hidden_size', d.get('hidden_size'))} "
                        f"(the target's is {target_hidden})")
    if d.get("vocab_size") != target_vocab:
        refusals.append(f"a draft vocabulary of {d.get('vocab_size')} tokens (the target has {target_vocab})")
    if refusals:
        raise ConfigError(f"speculative_config method 'eagle3' does not support {'; '.join(refusals)}: "
                          f"{folder}; {_ALT}")
    cfg = LlamaConfig.from_dict({key: v for key, v in d.items() if key not in ("architectures", "auto_map")})
    cfg._attn_implementation = "eager"
    draft_vocab = int(d.get("draft_vocab_size") or d["vocab_size"])
    weights = read_draft_weights(folder)
    own_embed = "embed_tokens.weight" in weights
    if not own_embed and cfg.hidden_size != target_hidden:
        raise ConfigError(f"speculative_config method 'eagle3': the draft {folder} has no embed_tokens and a "
                          f"hidden size ({cfg.hidden_size}) other than the target's ({target_hidden})")
    net = _Eagle3Net(cfg, ll, len(aux), target_hidden, draft_vocab, bool(d.get("norm_before_residual", False)),
                     own_embed)
    d2t = weights.pop("d2t", None)
    weights.pop("t2d", None)  # the target -> draft mask; drafting only needs d2t
    want = set(net.state_dict())
    missing, unexpected = sorted(want - set(weights)), sorted(set(weights) - want)
    if missing or unexpected:
        raise ConfigError(f"speculative_config method 'eagle3': the draft {folder} does not match an EAGLE-3 "
                          f"draft for this target: missing {missing[:4]}, unexpected {unexpected[:4]}")
    bad = [n for n, t in weights.items() if t.shape != net.state_dict()[n].shape]
    if bad:
        raise ConfigError(f"speculative_config method 'eagle3': the draft {folder}'s tensors {bad[:4]} have "
                          f"shapes other than its config and the target's give (fc reads {len(aux)} target "
                          f"layers of {target_hidden})")
    net.load_state_dict(weights)
    if d2t is None and draft_vocab != target_vocab:
        raise ConfigError(f"speculative_config method 'eagle3': the draft {folder} has a {draft_vocab}-token "
                          f"vocabulary and no d2t map to the target's {target_vocab} tokens")
    to_target = torch.arange(draft_vocab) + (d2t.to(torch.int64) if d2t is not None else 0)
    if to_target.shape != (draft_vocab,) or int(to_target.min()) < 0 or int(to_target.max()) >= target_vocab:
        raise ConfigError(f"speculative_config method 'eagle3': the draft {folder}'s d2t maps outside the "
                          f"target's {target_vocab} tokens")
    return net, cfg, sorted(aux), to_target
