"""DeepSeek multi-token prediction (MTP) drafts, computed in the runner after each step.

The MTP layers live in the target checkpoint past num_hidden_layers (model.layers.{N+i}.{enorm, hnorm, eh_proj,
<a decoder layer>, shared_head.norm}); embed_tokens and lm_head are the target's. At position t an MTP layer
takes the target's hidden state h_t (the last decoder layer's output, before the final norm) and the embedding of
token t+1, and its head predicts token t+2:

    x_t = eh_proj([enorm(embed(tok_{t+1})), hnorm(h_t)]);  g_t = block(x_t);  logits = lm_head(shared_head.norm(g_t))

With k drafts beyond the number of MTP layers the last layer is reused autoregressively (g_t stands in for h_t at
the next position, with the draft just made as its token), as vLLM does.

The runner keeps no cache for the MTP layer: it recomputes the block over a window of each request's last accepted
positions (kestrel/spec_decode/window_drafter.py), in plain PyTorch (transformers' DeepseekV3 decoder
layer, eager attention), from the target's pre-norm hidden states. Drafts are greedy. A cache group for the MTP
layer's attention (and running the block with the engine's kernels) is the next step.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kestrel.errors import ConfigError
from kestrel.spec_decode.hidden_capture import FinalNormInput
from kestrel.spec_decode.window_drafter import WindowDrafter


def num_mtp_layers(hf_config) -> int:
    """MTP layers the checkpoint declares (DeepSeek's num_nextn_predict_layers; transformers' num_mtp_layers)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or getattr(hf_config, "num_mtp_layers", 0) or 0)


class MtpDrafter(WindowDrafter):
    def __init__(self, target, hf_config, model_path: str, k: int, device, dtype, max_tokens: int = 8192,
                 window: int = 64, max_batch: int | None = None):
        from safetensors import safe_open
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

        from kestrel.loader.safetensors import safetensors_files

        if getattr(hf_config, "quantization_config", None):
            raise ConfigError("speculative_config method 'mtp' does not support quantized checkpoints yet (the MTP "
                              "layer is loaded unquantized): use method 'ngram' or start without speculative_config")
        n_mtp = num_mtp_layers(hf_config)
        arch = type(target).__name__
        if n_mtp == 0 or arch != "DeepseekV3ForCausalLM":  # V3.2's layers (an indexer) are not built here
            raise ConfigError(f"speculative_config method 'mtp' needs a DeepSeek-V3 checkpoint with MTP layers "
                              f"(num_nextn_predict_layers > 0), not {arch} with {n_mtp}: use method 'ngram' or "
                              f"start without speculative_config")
        super().__init__(target, [FinalNormInput()], hf_config.hidden_size, k, device, dtype, max_tokens, window,
                         max_batch)
        self.target = target
        cfg = ds.DeepseekV3Config.from_dict(hf_config.to_dict())
        cfg._attn_implementation = "eager"
        cfg._experts_implementation = "eager"
        n = cfg.num_hidden_layers
        self.layers = torch.nn.ModuleList(_MtpLayer(cfg, ds, n + i) for i in range(n_mtp))
        self.rotary = ds.DeepseekV3RotaryEmbedding(cfg)
        want = {f"model.layers.{n + i}.{name.removeprefix('block.')}": (i, name)
                for i, layer in enumerate(self.layers) for name in layer.state_dict()}
        state = [{} for _ in self.layers]
        for f in safetensors_files(Path(model_path)):
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    if key in want:
                        i, name = want[key]
                        state[i][name] = fh.get_tensor(key)
        for i, layer in enumerate(self.layers):
            missing = sorted(name.removeprefix("block.") for name in set(layer.state_dict()) - set(state[i]))
            if len(missing) == len(layer.state_dict()):
                raise ConfigError(f"speculative_config method 'mtp' needs a checkpoint with MTP layer weights: "
                                  f"{model_path} declares {n_mtp} MTP layers but has no weights under "
                                  f"model.layers.{n + i}.*; use method 'ngram' or start without speculative_config")
            if missing:
                raise ConfigError(f"speculative_config method 'mtp': the checkpoint lacks MTP layer {n + i}'s "
                                  f"weights {missing[:4]}{'...' if len(missing) > 4 else ''}")
            layer.load_state_dict(state[i])
        self.layers.to(device=device, dtype=dtype).eval()
        self.rotary.to(device)

    def embed(self, ids):
        return self.target.embed_input_ids(ids)

    def draft_layer(self, j, embeds, hidden, pos, mask):
        return self.layers[min(j, len(self.layers) - 1)](embeds, hidden, pos, mask, self.rotary)

    def draft_token_ids(self, j, last):
        head_norm = self.layers[min(j, len(self.layers) - 1)].shared_head.norm
        return self.target.compute_logits(head_norm(last)).argmax(-1)


class _SharedHead(torch.nn.Module):
    def __init__(self, cfg, ds):
        super().__init__()
        self.norm = ds.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class _MtpLayer(torch.nn.Module):
    """One MTP layer, its parameters named as in the checkpoint under model.layers.{idx}."""

    def __init__(self, cfg, ds, idx: int):
        super().__init__()
        self.enorm = ds.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hnorm = ds.DeepseekV3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.eh_proj = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = _SharedHead(cfg, ds)
        self.block = ds.DeepseekV3DecoderLayer(cfg, idx)  # checkpoint names: without the "block." part

    def forward(self, embeds, hidden, positions, mask, rotary) -> torch.Tensor:
        """[B, T, H] token embeddings and previous hidden states at positions [B, T] -> the block's output."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.block(x, attention_mask=mask, position_ids=positions,
                         position_embeddings=rotary(x, positions))
        return out[0] if isinstance(out, tuple) else out
