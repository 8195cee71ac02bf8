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
target's full-attention KV group (kestrel/spec_decode/draft_kv.py says why and how it stays valid). After each step the
drafter runs its layer over every position the target just computed (writing their draft K/V; for a request that
samples, its last row gives the first draft), then k - 1 forwards of one token per drafting request, each writing
its position's K/V (kestrel/spec_decode/draft_chain.py: CUDA graphs per batch bucket): a draft step processes only new
positions, never a window again.

Checkpoint layouts read: the EAGLE authors' / SGLang one (config architectures LlamaForCausalLMEagle3, weights
`midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`, as safetensors or pytorch_model.bin) and Red Hat speculators'
(config `speculators_model_type: eagle3` with the layer's Llama config under transformer_layer_config, weights
`layers.0.*`; norm_before_residual defaults to true there, as vLLM reads it). Refused at start-up: drafts of more than
one layer, norm_before_fc, a target hidden size or vocabulary other than the draft's, quantized drafts, targets
whose decoder layers do not take (positions, hidden, residual, ...), targets without full-attention layers.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from kestrel.attention.layer import Attention
from kestrel.core.device import to_device
from kestrel.layers.rotary import RotaryEmbedding
from kestrel.models.eagle3 import load_eagle3
from kestrel.spec_decode.draft_chain import DraftChain
from kestrel.spec_decode.draft_kv import DraftKV
from kestrel.spec_decode.hidden_capture import HiddenCapture, LayerInput, kept_positions
from kestrel.spec_decode.runner_addon import DrafterAddon

logger = logging.getLogger(__name__)


class Eagle3Drafter(DrafterAddon):
    """`context`: the target's ModelContext, where the draft's attention layer registers (before binding).
    `max_tokens`: the most tokens of one target forward (the capture's rows). Above `max_batch` sampling requests
    a step drafts nothing (the draft K/V are still written)."""

    def __init__(self, target, hf_config, context, draft_path: str, k: int, device, dtype, max_tokens: int = 8192,
                 max_batch: int | None = None):
        self.net, cfg, aux, to_target = load_eagle3(draft_path, target, hf_config)  # kestrel/models/eagle3.py
        target_hidden = hf_config.hidden_size
        self.k, self.device, self.dtype, self.max_batch = k, device, dtype, max_batch
        self.capture = HiddenCapture(target, [LayerInput(i) for i in aux], target_hidden, max_tokens, device, dtype)
        self.target, self.aux_layers, self.draft_to_target = target, aux, to_target.to(device)
        self.net.to(device=device, dtype=dtype).eval()
        self.max_positions = context.max_positions
        rotary = RotaryEmbedding(cfg, cfg.head_dim, self.max_positions, dtype).to(device)
        self.attn = Attention(context, "eagle3_draft.layers.0.self_attn.attn", cfg.num_attention_heads, cfg.head_dim,
                              cfg.num_key_value_heads, rotary).to(device)
        context.draft_layers.append(self.attn.layer_name)  # its KV cache rides on the target's (draft_kv.py)
        self.kv: DraftKV | None = None  # once bound (bind)
        self.chained: DraftChain | None = None

    def bind_kv(self, builders, block_rows) -> None:
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
