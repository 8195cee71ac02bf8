"""The MTP drafter's window recompute (kestrel/spec_decode/mtp_drafter.py): a window of each request's last accepted
positions and greedy chained drafting over it. (EAGLE-3 keeps a KV cache of its own instead:
kestrel/spec_decode/eagle3_drafter.py. MTP stays here until its layer, MLA attention with MoE experts, runs on the
engine's kernels and cache.)

A draft model at position t reads the target's hidden state at t (captured during its forward:
kestrel/spec_decode/hidden_capture.py) and the embedding of token t+1, and predicts token t+2. For each request the
drafter keeps the last `window` accepted positions (positions, hidden states, the token after each) and every step
recomputes its draft layer over that window in plain PyTorch with a causal mask: no cache of its own. Attention
beyond the window is dropped, so drafts are approximate where the draft layer would look further back: that costs
acceptance, never correctness (the verifier keeps exactly the target's tokens). The j-th draft feeds the layer's
output back as the hidden state of the next position, with the draft just made as its token (vLLM's chaining).
The windows of all requests that draft in a step are left-padded to `window` positions in one batch [B, window]:
k forwards a step, not k per request. The chain runs eagerly: DeepSeek's MoE experts, run by transformers' eager
code, pick the experts hit on the host (a sync no CUDA graph can hold).
"""
from __future__ import annotations

import torch

from kestrel.spec_decode.hidden_capture import HiddenCapture, kept_positions
from kestrel.spec_decode.runner_addon import DrafterAddon


class WindowDrafter(DrafterAddon):
    """Subclasses pass the target, the hidden states they read (`taps`, each `width` wide) and implement embed,
    draft_layer and draft_token_ids. `max_tokens`: the most tokens of one target forward (the runner's
    max(max_num_batched_tokens, max_num_seqs))."""

    def __init__(self, target, taps: list, width: int, k: int, device, dtype, max_tokens: int, window: int = 64,
                 max_batch: int | None = None):
        self.k, self.device, self.dtype, self.window, self.max_batch = k, device, dtype, window, max_batch
        self.capture = HiddenCapture(target, taps, width, max_tokens, device, dtype)
        # request id -> (positions [W], hidden states [W, H], the token after each position [W])
        self.windows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def bind_kv(self, builders, block_rows) -> None:
        """Nothing to bind: the window keeps no KV cache (the runner calls this on every drafter)."""

    def capture_graphs(self, sizes: list[int]) -> None:
        """None: the chain runs eagerly (see the module docstring)."""

    def profile_forward(self, ids, positions, ctx) -> None:
        """Nothing to profile: a draft step's forwards are B x window tokens, small beside the target's."""

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_layer(self, j: int, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """The j-th draft's layer output [B, W, H] over B windows (embeddings and hidden states [B, W, H],
        positions [B, W], the attention mask [B, 1, W, W] of padded_causal_mask)."""
        raise NotImplementedError

    def draft_token_ids(self, j: int, last: torch.Tensor) -> torch.Tensor:
        """The greedy target token ids [B] predicted from the layer outputs at the windows' last positions [B, H]
        (on the device: no host sync inside the chain)."""
        raise NotImplementedError

    def after_step(self, inf, out, requests) -> None:
        """Append each chunk's accepted positions to its request's window, then draft for the requests that sampled
        (out.next_drafts)."""
        hidden, kept = kept_positions(inf, out, requests, self.max_batch)
        wanted = []
        for k in kept:
            m = len(k.next_ids)
            if any(t < 0 for t in k.next_ids):  # a placeholder: a pipelined step's token not known yet
                self.forget(k.request_id)
                continue
            self.extend(k.request_id, k.start, hidden[k.first_row:k.first_row + m], k.next_ids)
            if k.drafts:
                wanted.append((k.request_id, k.start + m + 1))
        drafts = self.propose([rid for rid, _ in wanted])
        for rid, count in wanted:
            out.next_drafts[rid] = (count, drafts.get(rid, []))

    def forget(self, rid: str) -> None:
        self.windows.pop(rid, None)

    @torch.inference_mode()
    def extend(self, rid: str, start: int, captured: torch.Tensor, next_ids: list[int]) -> None:
        """Positions start.. (len(next_ids) of them) were computed with these captured hidden states, and these
        tokens follow them. A gap or an overlap (a preempted request recomputed) starts the window again."""
        m, w = len(next_ids), self.window
        old = self.windows.get(rid)
        joined = old is not None and int(old[0][-1]) == start - 1
        skip = max(0, m - w)  # a long prefill chunk: only its last `window` positions can stay
        pos = torch.arange(start + skip, start + m, device=self.device)
        h, ids = captured[skip:m].to(self.dtype), torch.tensor(next_ids[skip:], device=self.device)
        if joined:
            pos, h, ids = torch.cat([old[0], pos]), torch.cat([old[1], h]), torch.cat([old[2], ids])
        self.windows[rid] = (pos[-w:], h[-w:], ids[-w:])

    @torch.inference_mode()
    def propose(self, rids: list[str]) -> dict[str, list[int]]:
        """k greedy drafts after each request's last token (its last window entry's next token), the windows
        left-padded to `window` positions in one batch [B, window], so a draft step is k forwards for all of them."""
        rids = [r for r in rids if r in self.windows]
        if not rids:
            return {}
        rows = [self.windows[r] for r in rids]
        b, w = len(rows), self.window
        pos = torch.zeros(b, w, dtype=torch.int64, device=self.device)
        ids = torch.zeros(b, w, dtype=torch.int64, device=self.device)
        h = torch.zeros(b, w, rows[0][1].shape[-1], dtype=self.dtype, device=self.device)
        valid = torch.zeros(b, w, dtype=torch.bool, device=self.device)
        for i, (p, hid, nxt) in enumerate(rows):
            n = len(p)
            pos[i, w - n:], h[i, w - n:], ids[i, w - n:], valid[i, w - n:] = p, hid, nxt, True
        return dict(zip(rids, self.chain(pos, ids, h, valid).tolist()))

    def chain(self, pos: torch.Tensor, ids: torch.Tensor, h: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The k chained drafts [B, k] from left-padded windows (positions, next tokens, hidden states, valid
        [B, W])."""
        toks = []
        for j in range(self.k):
            out = self.draft_layer(j, self.embed(ids), h, pos, padded_causal_mask(valid, self.dtype))
            tok = self.draft_token_ids(j, out[:, -1])
            toks.append(tok)
            # the next position: the layer's output stands in for the target's hidden state; the oldest column
            # goes (a row's window keeps its last W entries; for a shorter row it is padding)
            pos = torch.cat([pos[:, 1:], pos[:, -1:] + 1], dim=1)
            h = torch.cat([h[:, 1:], out[:, -1:]], dim=1)
            ids = torch.cat([ids[:, 1:], tok[:, None]], dim=1)
            valid = torch.cat([valid[:, 1:], torch.ones_like(valid[:, -1:])], dim=1)
        return torch.stack(toks, dim=1)


def padded_causal_mask(valid: torch.Tensor, dtype) -> torch.Tensor:
    """[B, 1, W, W] additive mask for left-padded windows (`valid` [B, W]): a query sees the valid keys at or
    before it; a padding query sees itself only (no row is all -inf)."""
    w = valid.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=valid.device).tril()
    see = causal[None] & (valid[:, None, :] | torch.eye(w, dtype=torch.bool, device=valid.device)[None])
    mask = torch.zeros(see.shape, dtype=dtype, device=valid.device).masked_fill_(~see, float("-inf"))
    return mask[:, None]
