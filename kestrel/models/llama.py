"""Llama-family decoder (Llama, SmolLM2, Mistral-style), also the base of Qwen2 (q/k/v bias) and Qwen3 (q/k norm)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from kestrel.attention.layer import Attention, ForwardContext
from kestrel.layers.activation import SiluAndMul
from kestrel.layers.embedding import LMHead, VocabEmbedding
from kestrel.layers.linear import Linear
from kestrel.layers.norm import RMSNorm
from kestrel.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    qkv_bias_default = False
    use_qk_norm = False

    def __init__(self, cfg, layer_index: int, dtype, prefix: str, quant_config, linear_backend: str, rotary):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = getattr(cfg, "attention_bias", False) or self.qkv_bias_default
        lin = dict(params_dtype=dtype, quant_config=quant_config, backend=linear_backend)
        self.qkv_proj = Linear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size], bias=bias,
                               prefix=f"{prefix}.qkv_proj", **lin)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=getattr(cfg, "attention_bias", False),
                             prefix=f"{prefix}.o_proj", **lin)
        if self.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
        self.rotary = rotary  # shared by all layers
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads, layer_index)

    def forward(self, positions, hidden, ctx: ForwardContext):
        return self.attend(positions, self.qkv_proj(hidden), ctx)

    def attend(self, positions, qkv, ctx: ForwardContext):
        """Attention and o_proj from the projected [q | k | v]."""
        t = qkv.shape[0]
        if self.attn.fuses_qkv_prologue(self.rotary):
            norms = (self.q_norm, self.k_norm) if self.use_qk_norm else (None, None)
            return self.o_proj(self.attn.forward_qkv(qkv, positions, self.rotary, *norms, ctx))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.use_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(t, self.num_kv_heads, self.head_dim), ctx))


class LlamaMLP(nn.Module):
    def __init__(self, cfg, dtype, prefix: str, quant_config, linear_backend: str):
        super().__init__()
        lin = dict(params_dtype=dtype, quant_config=quant_config, backend=linear_backend,
                   bias=getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = Linear(cfg.hidden_size, [cfg.intermediate_size] * 2, prefix=f"{prefix}.gate_up_proj", **lin)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, prefix=f"{prefix}.down_proj", **lin)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, cfg, layer_index, dtype, prefix, quant_config, linear_backend, rotary):
        super().__init__()
        self.self_attn = self.attention_cls(cfg, layer_index, dtype, f"{prefix}.self_attn", quant_config,
                                            linear_backend, rotary)
        self.mlp = LlamaMLP(cfg, dtype, f"{prefix}.mlp", quant_config, linear_backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, hidden, residual, ctx):
        # Each norm runs inside the projection after it where the linear kernel fuses it (small batches on
        # CUDA); residual is None before the first layer.
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_rms_norm(self.input_layernorm, hidden, residual)
        hidden = attn.attend(positions, qkv, ctx)
        act, residual = mlp.gate_up_proj.forward_rms_norm_silu(self.post_attention_layernorm, hidden, residual, mlp.act)
        return mlp.down_proj(act), residual


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer
    # checkpoint module name -> (our merged module name, shard index)
    stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg, dtype: torch.dtype, max_positions: int, quant_config=None, linear_backend: str = "auto"):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rotary = RotaryEmbedding(cfg, head_dim, max_positions, dtype)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, i, dtype, f"model.layers.{i}", quant_config, linear_backend, rotary)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        tied = getattr(cfg, "tie_word_embeddings", False)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, tied_to=self.embed_tokens if tied else None)

    # The embedding contract: forward(inputs_embeds=embed_input_ids(ids)) == forward(input_ids=ids).
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, ctx: ForwardContext, inputs_embeds=None) -> torch.Tensor:
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, ctx)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    # ---- weights
    def _resolve(self, name: str):
        """Checkpoint tensor name -> (module, param name, shard id), or None to skip."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("model."):
            name = name[len("model."):]
        if name == "lm_head.weight" and getattr(self.config, "tie_word_embeddings", False):
            return None
        path, param = name.rsplit(".", 1)
        parts = path.split(".")
        shard = None
        if parts[-1] in self.stacked:
            parts[-1], shard = self.stacked[parts[-1]]
        module = self.get_submodule(".".join(parts))
        return module, param, shard

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._resolve(name)
            if target is None:
                continue
            module, param, shard = target
            if isinstance(module, Linear):
                module.load_weight(param, tensor, shard)
                loaded.add(f"{id(module)}.{param}.{shard}")
            else:
                p = getattr(module, param)
                if p.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(p.shape)}")
                p.data.copy_(tensor)
                loaded.add(f"{id(module)}.{param}")
        for m in self.modules():
            if isinstance(m, Linear):
                m.process_weights_after_loading()
        return loaded
