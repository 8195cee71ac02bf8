"""DeepSeek multi-token prediction (MTP) drafts, computed in the runner after each step.

The MTP layers live in the target checkpoint past num_hidden_layers (model.layers.{N+i}.{enorm, hnorm, eh_proj,
<a decoder layer>, shared_head.norm}); embed_tokens and lm_head are the target's. At position t an MTP layer
takes the target's hidden state h_t (the last decoder layer's output, before the final norm) and the embedding of
token t+1, and its head predicts token t+2:

    x_t = eh_proj([enorm(embed(tok_{t+1})), hnorm(h_t)]);  g_t = block(x_t);  logits = lm_head(shared_head.norm(g_t))

With k drafts beyond the number of MTP layers the last layer is reused autoregressively (g_t stands in for h_t at
the next position, with the draft just made as its token), as vLLM does.

This first version keeps no cache of its own: for each request the runner keeps the target's pre-norm hidden
states of its last `window` accepted positions (with the token after each), and every step recomputes the MTP
block over that window in plain PyTorch (transformers' DeepseekV3 decoder layer, eager attention, a causal mask).
Drafts are greedy. Attention beyond the window is dropped, so drafts are approximate where the MTP layer would look
further back: that costs acceptance, never correctness (the verifier keeps exactly the target's tokens). A cache
group for the MTP layer's attention (and running the block with the engine's kernels) is the next step.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kestrel.errors import ConfigError


def num_mtp_layers(hf_config) -> int:
    """MTP layers the checkpoint declares (DeepSeek's num_nextn_predict_layers; transformers' num_mtp_layers)."""
    return int(getattr(hf_config, "num_nextn_predict_layers", 0) or getattr(hf_config, "num_mtp_layers", 0) or 0)


class MtpDrafter:
    def __init__(self, target, hf_config, model_path: str, k: int, device, dtype, window: int = 64,
                 max_batch: int | None = None):
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
        self.target, self.k, self.window, self.device, self.max_batch = target, k, window, device, max_batch
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
        self.dtype = dtype
        # request id -> (positions [W], pre-norm hidden states [W, H], the token after each position [W])
        self.windows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def after_step(self, inf, out, requests) -> None:
        after_step(self, inf, out, requests)

    def forget(self, rid: str) -> None:
        self.windows.pop(rid, None)

    def extend(self, rid: str, start: int, hidden: torch.Tensor, next_ids: list[int]) -> None:
        """Positions start.. (len(next_ids) of them) were computed with these hidden states, and these tokens follow
        them. A gap or an overlap (a preempted request recomputed) starts the window again."""
        m = len(next_ids)
        pos = torch.arange(start, start + m, device=self.device)
        h, ids = hidden[:m].to(self.dtype), torch.tensor(next_ids, device=self.device)
        old = self.windows.get(rid)
        if old is not None and int(old[0][-1]) == start - 1:
            pos, h, ids = torch.cat([old[0], pos]), torch.cat([old[1], h]), torch.cat([old[2], ids])
        w = self.window
        self.windows[rid] = (pos[-w:], h[-w:], ids[-w:])

    @torch.inference_mode()
    def propose(self, rid: str) -> list[int]:
        """Up to k greedy drafts after the request's last token (the last window entry's next token)."""
        if rid not in self.windows:
            return []
        pos, h, ids = self.windows[rid]
        drafts = []
        for j in range(self.k):
            layer = self.layers[min(j, len(self.layers) - 1)]
            out = layer(self.target.embed_input_ids(ids), h, pos, self.rotary)
            tok = int(self.target.compute_logits(layer.shared_head.norm(out[-1:])).argmax(-1))
            drafts.append(tok)
            # the next position: this layer's output stands in for the target's hidden state
            pos = torch.cat([pos, pos[-1:] + 1])[-self.window:]
            h = torch.cat([h, out[-1:]])[-self.window:]
            ids = torch.cat([ids, ids.new_tensor([tok])])[-self.window:]
        return drafts


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

    def forward(self, embeds, hidden, positions, rotary) -> torch.Tensor:
        """[T, H] token embeddings and previous hidden states at positions [T] -> the block's output [T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))[None]
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1)[None, None]
        pe = rotary(x, positions[None])
        out = self.block(x, attention_mask=mask, position_ids=positions[None], position_embeddings=pe)
        return (out[0] if isinstance(out, tuple) else out)[0]


class PreNormCapture:
    """A forward hook on the target's final norm: its pre-norm input (hidden + residual, the norm's second
    output) of the last forward."""

    def __init__(self):
        self.last = None

    def __call__(self, module, args, output):
        self.last = output[1] if isinstance(output, tuple) else args[0]

    def pop(self) -> torch.Tensor:
        out, self.last = self.last, None
        return out


def capture_pre_norm(model) -> PreNormCapture:
    capture = PreNormCapture()
    model.norm.register_forward_hook(capture)
    return capture


def after_step(drafter: MtpDrafter, inf, out, requests) -> None:
    """Append each chunk's accepted positions to its request's window, then draft for the requests that sampled
    (out.next_drafts). A step without captured hidden states (a CUDA graph replay) drops the windows it touched."""
    if inf.pre_norm is None:
        for rid in inf.rows:
            drafter.forget(rid)
        return
    hidden, qsl, chunks = inf.pre_norm
    inf.pre_norm = None
    # above disable_by_batch_size the engine asks for no drafts: keep the windows, skip the drafting
    drafting = drafter.max_batch is None or len(inf.rows) <= drafter.max_batch
    for b, c in enumerate(chunks):
        rid, st = c.request_id, requests.get(c.request_id)
        if st is None:
            continue
        m = c.num_new_tokens - len(c.draft_token_ids) + len(out.more_sampled.get(rid, ()))
        start = c.num_computed_tokens
        nxt = st.tokens_slice(start + 1, start + m + 1)
        if len(nxt) < m or any(t < 0 for t in nxt):  # a placeholder: a pipelined step's token not known yet
            drafter.forget(rid)
            continue
        drafter.extend(rid, start, hidden[qsl[b]:qsl[b] + m], list(nxt))
        if c.samples and rid in out.sampled and drafting:
            out.next_drafts[rid] = (start + m + 1, drafter.propose(rid))
