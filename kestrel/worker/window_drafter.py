"""What the runner's draft models (speculative_config method "mtp": kestrel/worker/mtp_drafter.py, "eagle3":
kestrel/worker/eagle3_drafter.py) share: a hook that captures the target's hidden states during its forward, a window
of each request's last accepted positions, and greedy chained drafting over that window.

A draft model at position t reads a hidden state derived from the target's forward at t (`window_hidden` of what the
capture gave) and the embedding of token t+1, and predicts token t+2. For each request the drafter keeps the last
`window` accepted positions (positions, hidden states, the token after each) and every step recomputes its draft
layer over that window in plain PyTorch with a causal mask: no cache of its own. Attention beyond the window is
dropped, so drafts are approximate where the draft layer would look further back: that costs acceptance, never
correctness (the verifier keeps exactly the target's tokens). The j-th draft feeds the layer's output back as the
hidden state of the next position, with the draft just made as its token (vLLM's chaining for MTP and EAGLE-3).
The windows of all requests that draft in a step are left-padded into one batch: k forwards a step, not k per request.
"""
from __future__ import annotations

import torch


class WindowDrafter:
    """Subclasses set `self.capture` (whose pop() gives the last target forward's hidden states, one row per token)
    and implement embed, draft_layer and draft_tokens; window_hidden maps captured rows to the draft's hidden input."""

    capture = None

    def __init__(self, k: int, device, dtype, window: int = 64, max_batch: int | None = None):
        self.k, self.device, self.dtype, self.window, self.max_batch = k, device, dtype, window, max_batch
        # request id -> (positions [W], hidden states [W, H], the token after each position [W])
        self.windows: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def window_hidden(self, captured: torch.Tensor) -> torch.Tensor:
        return captured.to(self.dtype)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def draft_layer(self, j: int, embeds: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
        """The j-th draft's layer output [B, W, H] over B windows (embeddings and hidden states [B, W, H],
        positions [B, W], the attention mask [B, 1, W, W] of padded_causal_mask)."""
        raise NotImplementedError

    def draft_tokens(self, j: int, last: torch.Tensor) -> list[int]:
        """The greedy target token ids predicted from the layer outputs at the windows' last positions [B, H]."""
        raise NotImplementedError

    def after_step(self, inf, out, requests) -> None:
        after_step(self, inf, out, requests)

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
        h, ids = self.window_hidden(captured[skip:m]), torch.tensor(next_ids[skip:], device=self.device)
        if joined:
            pos, h, ids = torch.cat([old[0], pos]), torch.cat([old[1], h]), torch.cat([old[2], ids])
        self.windows[rid] = (pos[-w:], h[-w:], ids[-w:])

    @torch.inference_mode()
    def propose(self, rids: list[str]) -> dict[str, list[int]]:
        """Up to k greedy drafts after each request's last token (its last window entry's next token), the
        windows left-padded into one batch, so a draft step is one forward for all of them."""
        rids = [r for r in rids if r in self.windows]
        if not rids:
            return {}
        rows = [self.windows[r] for r in rids]
        b, w = len(rows), max(len(r[0]) for r in rows)
        pos = torch.zeros(b, w, dtype=torch.int64, device=self.device)
        ids = torch.zeros(b, w, dtype=torch.int64, device=self.device)
        h = torch.zeros(b, w, rows[0][1].shape[-1], dtype=self.dtype, device=self.device)
        valid = torch.zeros(b, w, dtype=torch.bool, device=self.device)
        for i, (p, hid, nxt) in enumerate(rows):
            n = len(p)
            pos[i, w - n:], h[i, w - n:], ids[i, w - n:], valid[i, w - n:] = p, hid, nxt, True
        drafts: list[list[int]] = [[] for _ in rids]
        for j in range(self.k):
            out = self.draft_layer(j, self.embed(ids), h, pos, padded_causal_mask(valid, self.dtype))
            toks = self.draft_tokens(j, out[:, -1])
            for row, tok in zip(drafts, toks):
                row.append(tok)
            # the next position: the layer's output stands in for the target's hidden state (a row's window keeps
            # its last `window` entries: the first column goes once the batch is wider than that)
            keep = slice(1, None) if w >= self.window else slice(None)
            pos = torch.cat([pos[:, keep], pos[:, -1:] + 1], dim=1)
            h = torch.cat([h[:, keep], out[:, -1:]], dim=1)
            ids = torch.cat([ids[:, keep], ids.new_tensor(toks)[:, None]], dim=1)
            valid = torch.cat([valid[:, keep], valid.new_ones(b, 1)], dim=1)
            w = pos.shape[1]
        return dict(zip(rids, drafts))


def padded_causal_mask(valid: torch.Tensor, dtype) -> torch.Tensor:
    """[B, 1, W, W] additive mask for left-padded windows (`valid` [B, W]): a query sees the valid keys at or
    before it; a padding query sees itself only (no row is all -inf)."""
    w = valid.shape[1]
    causal = torch.ones(w, w, dtype=torch.bool, device=valid.device).tril()
    see = causal[None] & (valid[:, None, :] | torch.eye(w, dtype=torch.bool, device=valid.device)[None])
    mask = torch.zeros(see.shape, dtype=dtype, device=valid.device).masked_fill_(~see, float("-inf"))
    return mask[:, None]


class PreNormCapture:
    """A forward hook on the target's final norm: its pre-norm input (hidden + residual, the norm's second
    output) of the last forward."""

    def __init__(self, model):
        self.last = None
        model.norm.register_forward_hook(self)

    def __call__(self, module, args, output):
        self.last = output[1] if isinstance(output, tuple) else args[0]

    def pop(self) -> torch.Tensor:
        out, self.last = self.last, None
        return out


class LayerInputCapture:
    """Forward pre-hooks on some of the target's decoder layers (called as layer(positions, hidden, residual,
    ...)): the residual stream entering each (hidden + residual; the embeddings for layer 0) of the last forward,
    concatenated along the hidden dimension in layer order."""

    def __init__(self, model, layer_ids: list[int]):
        self.layer_ids = sorted(layer_ids)
        self.seen: dict[int, torch.Tensor] = {}
        for i in self.layer_ids:
            model.layers[i].register_forward_pre_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module, args):
            hidden, residual = args[1], args[2]
            self.seen[i] = hidden if residual is None else hidden + residual
        return hook

    def pop(self) -> torch.Tensor | None:
        if len(self.seen) != len(self.layer_ids):
            self.seen = {}
            return None
        out = torch.cat([self.seen[i] for i in self.layer_ids], dim=-1)
        self.seen = {}
        return out


def after_step(drafter: WindowDrafter, inf, out, requests) -> None:
    """Append each chunk's accepted positions to its request's window, then draft for the requests that sampled
    (out.next_drafts). A step without captured hidden states (a CUDA graph replay) drops the windows it touched."""
    if inf.target_hidden is None or inf.target_hidden[0] is None:
        for rid in inf.rows:
            drafter.forget(rid)
        inf.target_hidden = None
        return
    hidden, qsl, chunks = inf.target_hidden
    inf.target_hidden = None
    # above disable_by_batch_size the engine asks for no drafts: keep the windows, skip the drafting
    drafting = drafter.max_batch is None or len(inf.rows) <= drafter.max_batch
    wanted = []
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
            wanted.append((rid, start + m + 1))
    drafts = drafter.propose([rid for rid, _ in wanted])
    for rid, count in wanted:
        out.next_drafts[rid] = (count, drafts.get(rid, []))
