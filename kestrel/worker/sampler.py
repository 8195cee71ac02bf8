"""Turns the logits of the rows that sample into tokens (and logprobs).

Order: penalties -> min_tokens mask -> temperature -> top-k -> top-p -> min-p -> sample. Returned logprobs are
of the raw model distribution (before penalties and temperature), as vLLM reports them by default.
A seeded request draws its noise from a generator seeded by (seed, output position), so its tokens do not
depend on what else is in the batch, nor on preemption and recompute."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kestrel.core.device import to_device
from kestrel.core.sampling_params import SamplingParams

_MASK = float("-inf")


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_token_ids_for_min: list[int]  # eos + stop ids, masked while fewer than min_tokens outputs exist


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [N] on the logits' device (no host sync until token_ids is read)
    # per row: (sampled logprob, sampled rank, [(token, logprob)] top-N) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.tolist()


def position_seed(seed: int, position: int) -> int:
    """The noise seed of a seeded request's token at `position`: independent of the batch and of preemption."""
    return (seed * 1_000_003 + position * 7919 + 0x9E3779B1) & 0x7FFF_FFFF_FFFF_FFFF


def _position_generator(seed: int, position: int, device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(position_seed(seed, position))
    return g


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), device=logits.device,
                                dtype=torch.long)
            if seen.numel():
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            ids = torch.tensor(r.output_token_ids, device=logits.device, dtype=torch.long)
            counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                  use_top_k_p: bool = True, use_min_p: bool = True) -> torch.Tensor:
    """Mask everything outside each row's top-k / top-p (nucleus) / min-p set. Inputs are temperature-scaled.
    The use_* flags (known on the host) skip work no row asks for without a device sync."""
    vocab = logits.shape[1]
    if use_top_k_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, vocab)[:, None]
        drop = ranks >= k
        probs = sorted_logits.masked_fill(drop, _MASK).softmax(dim=-1)
        cum_before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
        drop |= cum_before >= top_p[:, None]
        drop[:, 0] = False  # the most likely token always stays
        logits = torch.full_like(logits, _MASK).scatter(1, order, sorted_logits.masked_fill(drop, _MASK))
    if use_min_p:
        probs = logits.softmax(dim=-1)
        thresh = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < thresh, _MASK)
    return logits


def compute_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num: int):
    """Per row: (logprob of token, its rank (1 = most likely), top-`num` (token, logprob))."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_ids = logprobs.topk(num, dim=-1) if num > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    out = []
    for i in range(logprobs.shape[0]):
        out.append((chosen[i, 0].item(), int(ranks[i]), list(zip(top_ids[i].tolist(), top_vals[i].tolist()))))
    return out


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}
        self._rng: random.Random | None = None  # per-step noise seeds of unseeded rows (fused GPU path)
        self._gumbel_sample = None  # kestrel.worker.triton_sampling.gumbel_sample once imported; False: none

    def _global_generator(self, device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[key]

    def _fused_ok(self, logits: torch.Tensor) -> bool:
        if not logits.is_cuda:
            return False
        if self._gumbel_sample is None:
            try:
                from kestrel.worker.triton_sampling import gumbel_sample
            except ImportError:  # no Triton: the torch path samples
                gumbel_sample = False
            self._gumbel_sample = gumbel_sample
        return bool(self._gumbel_sample)

    def _fused_sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature-only rows (and greedy ones) in one pass over the logits (kestrel/worker/triton_sampling)."""
        if self._rng is None:
            self._rng = random.Random(self.seed)
        base = self._rng.getrandbits(62)
        inv_temp, seeds = [], []
        for i, r in enumerate(rows):
            p = r.params
            inv_temp.append(0.0 if p.greedy else 1.0 / max(p.temperature, 1e-5))
            seeds.append(base + i if p.seed is None else position_seed(p.seed, len(r.output_token_ids)))
        dev = logits.device
        return self._gumbel_sample(logits, to_device(inv_temp, torch.float32, dev), to_device(seeds, torch.int64, dev))

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        n = logits.shape[0]
        want_logprobs = [r.params.logprobs for r in rows]
        raw_logprobs = logits.float().log_softmax(dim=-1) if any(w is not None for w in want_logprobs) else None

        all_greedy = all(r.params.greedy for r in rows)
        needs_processing = any(
            r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
            or (len(r.output_token_ids) < r.params.min_tokens and r.stop_token_ids_for_min) for r in rows)
        plain = not needs_processing and not any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0
                                                 for r in rows)
        if plain and all_greedy:
            tokens = logits.argmax(dim=-1)  # exact in the logits' own dtype: no float copy
        elif plain and self._fused_ok(logits):
            tokens = self._fused_sample(logits, rows)
        else:
            tokens = self._torch_sample(logits.float(), rows, all_greedy, needs_processing)
        return SampleResult(tokens, self._logprobs(raw_logprobs, tokens, want_logprobs))

    def _torch_sample(self, logits: torch.Tensor, rows: list[SamplingRow], all_greedy: bool,
                      needs_processing: bool) -> torch.Tensor:
        n = logits.shape[0]
        if needs_processing:
            logits = apply_penalties(logits.clone(), rows)
            for i, r in enumerate(rows):
                if len(r.output_token_ids) < r.params.min_tokens and r.stop_token_ids_for_min:
                    logits[i, r.stop_token_ids_for_min] = _MASK

        if all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            dev = logits.device
            ps = [r.params for r in rows]
            temps = [max(p.temperature, 1e-5) for p in ps]
            any_greedy = any(p.greedy for p in ps)
            use_top_k_p = any(p.top_k > 0 or p.top_p < 1 for p in ps)
            use_min_p = any(p.min_p > 0 for p in ps)
            if len(set(temps)) == 1:
                scaled = logits / temps[0]
            else:
                scaled = logits / to_device(temps, torch.float32, dev)[:, None]
            if use_top_k_p or use_min_p:
                scaled = filter_logits(
                    scaled,
                    to_device([p.top_k for p in ps], torch.int64, dev),
                    to_device([p.top_p for p in ps], torch.float32, dev),
                    to_device([p.min_p for p in ps], torch.float32, dev),
                    use_top_k_p, use_min_p)
            probs = scaled.softmax(dim=-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p (Gumbel-max in another guise).
            noise = torch.empty_like(probs)
            seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
            if len(seeded) < n:
                noise.exponential_(generator=self._global_generator(dev))
            for i in seeded:
                g = _position_generator(rows[i].params.seed, len(rows[i].output_token_ids), dev)
                noise[i].exponential_(generator=g)
            tokens = (probs / noise).argmax(dim=-1)
            if any_greedy:
                greedy_rows = to_device([p.greedy for p in ps], torch.bool, dev)
                tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
        return tokens

    @staticmethod
    def _logprobs(raw_logprobs, tokens, want_logprobs) -> list:
        lp: list = [None] * len(want_logprobs)
        if raw_logprobs is not None:
            idx = [i for i, w in enumerate(want_logprobs) if w is not None]
            k = max(want_logprobs[i] for i in idx)
            entries = compute_logprobs(raw_logprobs[idx], tokens[idx], k)
            for j, i in enumerate(idx):
                chosen, rank, top = entries[j]
                lp[i] = (chosen, rank, top[: want_logprobs[i]])
        return lp
