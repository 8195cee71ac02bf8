"""EAGLE-3 drafts (speculative_config method "eagle3", "model": the draft checkpoint's folder), computed in the runner
after each step.

An EAGLE-3 draft is one Llama-style decoder layer that reads the target's residual stream entering three of its
layers (eagle_aux_hidden_state_layer_ids; by default 2, L // 2 and L - 3 of L), fused by `fc` (3 x H_target -> H):

    h_t = fc([aux_a(t), aux_b(t), aux_c(t)])
    x = [input_layernorm(embed(tok_{t+1})), hidden_norm(h_t)]          (2H: q/k/v take 2H inputs)
    r = h_t (or hidden_norm(h_t) with norm_before_residual) + o_proj(attention(x))
    g_t = r + mlp(post_attention_layernorm(r));   draft id = argmax lm_head(norm(g_t))

over a draft vocabulary (draft_vocab_size) mapped back to target ids by the `d2t` offsets (target = draft + d2t[draft]).
The next draft feeds g_t back in place of h_t (at position t+1, with the draft just made as its token: vLLM's
chaining). The token embedding is the draft's own embed_tokens, or the target's when the checkpoint has none.

The draft layer attends over the request's whole context through a KV cache of its own, one more layer of the
target's full-attention KV group (kestrel/worker/draft_kv.py says why and how it stays valid). After each step the
drafter runs its layer over every position the target just computed (writing their draft K/V; for a request that
samples, its last row gives the first draft), then k - 1 forwards of one token per drafting request, each writing
its position's K/V (kestrel/worker/draft_chain.py: CUDA graphs per batch bucket): a draft step processes only new
positions, never a window again.

Checkpoint layouts read: the EAGLE authors' / SGLang one (config architectures LlamaForCausalLMEagle3, weights
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, as safetensors or pytorch_model.bin) and Red Hat speculators'
(config `speculators_model_type: eagle3` with the layer's Llama config under transformer_layer_config, weights
`layers.0.*`; norm_before_residual defaults to true there, as vLLM reads it). Refused at start-up: drafts of more than
one layer, norm_before_fc, a target hidden size or vocabulary other than the draft's, quantized drafts, targets
whose decoder layers do not take (positions, hidden, residual, ...), targets without full-attention layers.
"""
from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kestrel.attention.layer import Attention
from kestrel.core.device import to_device
from kestrel.errors import ConfigError
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.worker.draft_chain import DraftChain
from kestrel.worker.draft_kv import DraftKV
from kestrel.worker.hidden_capture import HiddenCapture, LayerInput, kept_positions

logger = logging.getLogger(__name__)

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


class Eagle3Drafter:
    """`context`: the target's ModelContext, where the draft's attention layer registers (before binding).
    `max_tokens`: the most tokens of one target forward (the capture's rows). Above `max_batch` sampling requests
    a step drafts nothing (the draft K/V are still written)."""

    def __init__(self, target, hf_config, context, draft_path: str, k: int, device, dtype, max_tokens: int = 8192,
                 max_batch: int | None = None):
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
        self.net = _Eagle3Net(cfg, ll, len(aux), target_hidden, draft_vocab,
                              bool(d.get("norm_before_residual", False)), own_embed)
        d2t = weights.pop("d2t", None)
        weights.pop("t2d", None)  # the target -> draft mask; drafting only needs d2t
        want = set(self.net.state_dict())
        missing, unexpected = sorted(want - set(weights)), sorted(set(weights) - want)
        if missing or unexpected:
            raise ConfigError(f"speculative_config method 'eagle3': the draft {folder} does not match an EAGLE-3 "
                              f"draft for this target: missing {missing[:4]}, unexpected {unexpected[:4]}")
        bad = [n for n, t in weights.items() if t.shape != self.net.state_dict()[n].shape]
        if bad:
            raise ConfigError(f"speculative_config method 'eagle3': the draft {folder}'s tensors {bad[:4]} have "
                              f"shapes other than its config and the target's give (fc reads {len(aux)} target "
                              f"layers of {target_hidden})")
        self.net.load_state_dict(weights)
        if d2t is None and draft_vocab != target_vocab:
            raise ConfigError(f"speculative_config method 'eagle3': the draft {folder} has a {draft_vocab}-token "
                              f"vocabulary and no d2t map to the target's {target_vocab} tokens")
        to_target = torch.arange(draft_vocab) + (d2t.to(torch.int64) if d2t is not None else 0)
        if to_target.shape != (draft_vocab,) or int(to_target.min()) < 0 or int(to_target.max()) >= target_vocab:
            raise ConfigError(f"speculative_config method 'eagle3': the draft {folder}'s d2t maps outside the "
                              f"target's {target_vocab} tokens")
        self.k, self.device, self.dtype, self.max_batch = k, device, dtype, max_batch
        self.capture = HiddenCapture(target, [LayerInput(i) for i in sorted(aux)], target_hidden, max_tokens, device,
                                     dtype)
        self.target, self.aux_layers, self.draft_to_target = target, sorted(aux), to_target.to(device)
        self.net.to(device=device, dtype=dtype).eval()
        self.max_positions = context.max_positions
        rotary = RotaryEmbedding(cfg, cfg.head_dim, self.max_positions, dtype).to(device)
        self.attn = Attention(context, "eagle3_draft.layers.0.self_attn.attn", cfg.num_attention_heads, cfg.head_dim,
                              cfg.num_key_value_heads, rotary).to(device)
        context.draft_layers.append(self.attn.layer_name)  # its KV cache rides on the target's (draft_kv.py)
        self.kv: DraftKV | None = None  # once bound (bind)
        self.chained: DraftChain | None = None

    def bind(self, builders, block_rows) -> None:
        """The attention layer is bound to its group (self.attn.group_id): draft forwards build that group's
        metadata over the runner's block table rows."""
        self.kv = DraftKV(self.attn, builders[self.attn.group_id], block_rows, self.device)
        if self.k > 1:
            rows, max_blocks = block_rows.ids.shape[0], block_rows.ids.shape[2]
            self.chained = DraftChain(self, min(rows, self.max_batch or rows), max_blocks,
                                      self.net.fc.out_features)

    def capture_graphs(self, sizes: list[int]) -> None:
        """CUDA graphs of the chained drafts at these batch sizes (the decode graphs'). A failed capture logs and
        leaves them eager (drafts cost acceptance only)."""
        if self.chained is None:
            return
        try:
            self.chained.capture(sizes)
        except Exception as e:  # noqa: BLE001  (an optimisation: eager drafting stays correct)
            logger.warning("draft CUDA graphs not captured (%s: %s); drafting runs eagerly", type(e).__name__, e)
            torch.cuda.synchronize()
            self.chained.graphs, self.chained.sizes = {}, []

    def forget(self, rid: str) -> None:
        """Nothing per request: its draft K/V live in its blocks."""

    def embed(self, ids):
        return self.net.embed_tokens(ids) if self.net.embed_tokens is not None else self.target.embed_input_ids(ids)

    def draft_logits(self, last: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary from layer outputs."""
        return self.net.lm_head(self.net.norm(last))

    def draft_token_ids(self, last: torch.Tensor) -> torch.Tensor:
        """The greedy target token ids [B] from layer outputs [B, H] (on the device)."""
        return self.draft_to_target[self.draft_logits(last).argmax(-1)]

    def layer(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """The draft layer over a flattened batch (token ids of the next positions [T], hidden states [T, H], their
        positions [T], `ctx` its metadata); writes their K/V. Returns its output [T, H]."""
        return self.net.layers[0](self.embed(ids).to(self.dtype), hidden, positions, ctx, self.attn)

    @torch.inference_mode()
    def profile_forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> None:
        """A draft step's first forward over every token of the target forward that just ran on (ids, positions,
        ctx) and filled the capture: what the memory profile measures (and the precompile compiles)."""
        g = self.layer(ids, self.net.fc(self.capture.rows(ids.shape[0]).to(self.dtype)), positions, ctx)
        self.draft_token_ids(g[-1:])

    @torch.inference_mode()
    def after_step(self, inf, out, requests) -> None:
        """Write the draft K/V of every position the step computed (a request's accepted ones: its verified drafts,
        not the rejected), then draft for the requests that sampled (out.next_drafts)."""
        hidden, kept = kept_positions(inf, out, requests, self.max_batch)
        rows = []
        for k in kept:
            # a placeholder (a pipelined step's token not known yet) ends what can be written: a position left
            # unwritten costs later drafts acceptance, never correctness (above disable_by_batch_size, where
            # steps pipeline, no request drafts)
            known = next((i for i, t in enumerate(k.next_ids) if t < 0), len(k.next_ids))
            if known:
                k.drafts = k.drafts and known == len(k.next_ids)
                k.next_ids = k.next_ids[:known]
                rows.append(k)
        if not rows:
            return
        rows.sort(key=lambda k: len(k.next_ids) != 1)  # decode rows first, as the backends expect
        counts = [len(k.next_ids) for k in rows]
        captured = to_device([i for k in rows for i in range(k.first_row, k.first_row + len(k.next_ids))],
                             torch.int64, self.device)
        ctx, positions = self.kv.context([k.state.table_row for k in rows], [k.start for k in rows], counts)
        g = self.layer(to_device([t for k in rows for t in k.next_ids], torch.int64, self.device),
                       self.net.fc(hidden[captured].to(self.dtype)), positions, ctx)
        want = [i for i, k in enumerate(rows) if k.drafts]
        if not want:
            return
        table_rows = [rows[i].state.table_row for i in want]
        first = [rows[i].start + counts[i] for i in want]  # the position after the last kept one
        last = g[to_device((np.cumsum(counts) - 1)[want], torch.int64, self.device)]
        token = self.draft_token_ids(last)  # the first draft, predicted at the last kept position
        drafts = token[:, None]
        if self.chained is not None:  # the others: one token per request at each next position
            drafts = torch.cat([drafts, self.chained.run(table_rows, first, last, token)], dim=1)
        for i, row, pos, d in zip(want, table_rows, first, drafts.tolist()):  # the one host sync of a draft step
            n = 1 + (self.chained.num_valid(row, pos) if self.chained is not None else 0)
            out.next_drafts[rows[i].request_id] = (pos + 1, d[:n])
