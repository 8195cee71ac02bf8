"""Greedy references from transformers. `hf_greedy`: its tokens for float32 comparisons, where ours must be
identical. `teacher_forced_agreement`, per token: transformers generates greedily; our engine scores that very
sequence (prompt logprobs) and we count the positions where our argmax is transformers' token. In bf16 one
near-tie flip would otherwise make every later token of a free-running comparison differ."""
from __future__ import annotations

import torch

from kestrel import SamplingParams


# mixed-length prompts (a short one, repeats, a long run, ascending ids) the agreement tests share
MIXED_PROMPTS = [[5, 17, 99, 3], [7] * 11 + [42, 43], list(range(10, 40)), [200, 201, 202, 203, 204, 205, 206]]


def hf_causal_lm(path, **load_kwargs):
    """transformers' model of a checkpoint: AutoModelForCausalLM, or the checkpoint's own class where the auto
    mapping lacks its config (Mistral4ForCausalLM in transformers 5.17)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path)
    cls = AutoModelForCausalLM
    if type(cfg) not in AutoModelForCausalLM._model_mapping:
        cls = getattr(transformers, cfg.architectures[0])
    model = cls.from_pretrained(path, **load_kwargs)
    if "quantization_config" in load_kwargs and (dtype := load_kwargs.get("dtype")) is not None:
        # a dequantising load (MXFP4 on CUDA) leaves its weights in bf16 whatever dtype was asked for
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model


def import_without_fla(module_name: str, functions: tuple[str, ...]):
    """transformers 5.17 binds fla's Triton kernels into its linear-attention models (Kimi Linear, Qwen3-Next,
    Qwen3.5) at import where fla is importable (the GPU machine carries fla-core for our prefill): import
    `module_name` with fla hidden, so the reference stays its float32 PyTorch form, and check that `functions` of
    it are not bound to fla (something imported the module before this)."""
    import importlib
    import inspect
    import sys

    hidden = {n: sys.modules.pop(n) for n in list(sys.modules) if n == "fla" or n.startswith("fla.")}
    sys.modules["fla"] = None  # `import fla` raises ImportError
    try:
        module = importlib.import_module(module_name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(hidden)
    for name in functions:
        fn = getattr(module, name)
        assert not inspect.getclosurevars(fn).nonlocals.get("is_new_implementation"), \
            f"transformers' {name} is bound to fla: something imported {module_name} before this"
    return module


def hf_greedy(path, prompts: list[list[int]], n: int, **load_kwargs) -> list[list[int]]:
    """transformers' `n` greedy tokens (float32, eos ignored) after each prompt; `load_kwargs` go to
    from_pretrained (e.g. attn_implementation)."""
    model = hf_causal_lm(path, dtype=torch.float32, **load_kwargs).eval()
    out = []
    for p in prompts:
        seq = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(seq[0, len(p):].tolist())
    return out


def assert_embedding_contract(path, ids=(3, 9, 27, 81)) -> None:
    """forward(input_ids) == forward(inputs_embeds=embed_input_ids(input_ids)), bit for bit, each on a fresh cache
    and one sequence (the memory profile's dummy batch)."""
    from kestrel.config import EngineConfig
    from kestrel.engine.core import EngineCore
    from kestrel.worker.memory_profile import dummy_prefill_batch

    core = EngineCore(EngineConfig.create(model=str(path), num_kv_blocks=8), progress=False)
    model, runner = core.executor.runner.model, core.executor.runner
    ids = torch.tensor(ids)

    def run(**kw):
        _, positions, ctx = dummy_prefill_batch(runner, len(ids))
        with torch.inference_mode():
            return model(ids, positions, ctx, **kw)

    torch.testing.assert_close(run(), run(inputs_embeds=model.embed_input_ids(ids)), rtol=0, atol=0)


def kestrel_greedy(path, prompts: list[list[int]], n: int, **llm_kwargs):
    """Kestrel's `n` greedy tokens (eos ignored) after each prompt, and the LLM (to inspect its engine)."""
    from kestrel import LLM

    llm = LLM(str(path), progress=False, **llm_kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs], llm


def bf16_logprob_tolerance(max_abs_logit: float) -> float:
    """Two bf16 ulps of the largest logit (a logit x carries x * 2**-8 of rounding; both sides round), and
    never below 0.1."""
    return max(0.1, 2 * max_abs_logit * 2.0 ** -7)


def teacher_forced_agreement(llm, hf_model, prompt: list[int], n: int, device: str):
    """Returns (tokens agreeing, max |logprob error| of the chosen tokens, that error's bf16 tolerance)."""
    agree, errors, tol, _ = teacher_forced_errors(llm, hf_model, prompt, n, device)
    return agree, max(errors, default=0.0), tol


def teacher_forced_errors(llm, hf_model, prompt: list[int], n: int, device: str):
    """Returns (tokens agreeing, |logprob error| of the chosen token at each position, the bf16 tolerance, the
    disagreements at near-ties: our argmax is within the tolerance of transformers' token in its own logprobs)."""
    ids = torch.tensor([prompt], device=device)
    seq = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0].tolist()
    with torch.no_grad():
        logits = hf_model(torch.tensor([seq], device=device)).logits[0].float()
    ref = logits.log_softmax(-1)
    tol = bf16_logprob_tolerance(logits[len(prompt) - 1:].abs().max().item())
    out = llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0))[0]
    agree, errors, ties = 0, [], 0
    for j in range(len(prompt), len(seq)):
        entry = out.prompt_logprobs[j]
        top1 = next(t for t, lp in entry.items() if lp.rank == 1)
        agree += top1 == seq[j]
        ties += top1 != seq[j] and ref[j - 1, seq[j]].item() - ref[j - 1, top1].item() < tol
        errors.append(abs(entry[seq[j]].logprob - ref[j - 1, seq[j]].item()))
    return agree, errors, tol, ties


def same_dtype_reference_errors(hf_exact, hf_same_dtype, prompt: list[int], n: int, device: str) -> list[float]:
    """What the engine's dtype alone costs the model: at each position of the exact model's greedy continuation,
    |logprob of its token under transformers run in the engine's dtype - under the exact model|."""
    ids = torch.tensor([prompt], device=device)
    seq = hf_exact.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0].tolist()
    with torch.no_grad():
        exact = hf_exact(torch.tensor([seq], device=device)).logits[0].float().log_softmax(-1)
        same = hf_same_dtype(torch.tensor([seq], device=device)).logits[0].float().log_softmax(-1)
    return [abs(same[j - 1, seq[j]].item() - exact[j - 1, seq[j]].item()) for j in range(len(prompt), len(seq))]


def assert_teacher_forced(llm, ref_path, prompts: list[list[int]], n: int = 32, spare: int = 0,
                          device: str = "cpu") -> None:
    """A bf16 engine against transformers in float32 (the exact model) on `ref_path`, teacher-forced per prompt:
    at least n - 2 of n tokens agree, or every disagreement but one sits at a near-tie of the reference; and the
    chosen tokens' logprobs are within the bf16 tolerance at every position but `spare` (a MoE router near-tie that
    bf16 rounding flips moves one position by a whole expert's share)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(ref_path, dtype=torch.float32).to(device).eval()
    for p in prompts:
        agree, errors, tol, ties = teacher_forced_errors(llm, hf, p, n, device)
        assert agree >= n - 2 or agree + ties >= n - 1, (len(p), agree, ties)
        assert sorted(errors)[-1 - spare] < tol, (len(p), sorted(errors)[-1 - spare:], tol)


class TransformersAsLLM:
    """transformers' model behind the one LLM call teacher_forced_errors makes (greedy prompt logprobs), so that
    its own run can be scored like ours."""

    def __init__(self, model, device: str = "cpu"):
        self.model, self.device = model, device

    def generate(self, seqs, params):
        from types import SimpleNamespace

        with torch.no_grad():
            logp = self.model(torch.tensor(seqs, device=self.device)).logits[0].float().log_softmax(-1)
        entries = [None]
        for j in range(1, len(seqs[0])):
            top = int(logp[j - 1].argmax())
            entries.append({top: SimpleNamespace(rank=1, logprob=float(logp[j - 1, top])),
                            **({} if seqs[0][j] == top else {seqs[0][j]: SimpleNamespace(
                                rank=2, logprob=float(logp[j - 1, seqs[0][j]]))})})
        return [SimpleNamespace(prompt_logprobs=entries)]


def beside_transformers_bf16(llm, path, prompts: list[list[int]], n: int = 32, device: str = "cpu"):
    """Per prompt, teacher-forced against transformers in float32 (teacher_forced_errors' tuple): yields (prompt,
    ours, transformers' own bf16 run's)."""
    hf = hf_causal_lm(path, dtype=torch.float32).to(device).eval()
    hf_bf16 = TransformersAsLLM(hf_causal_lm(path, dtype=torch.bfloat16).to(device).eval(), device)
    for p in prompts:
        yield p, teacher_forced_errors(llm, hf, p, n, device), teacher_forced_errors(hf_bf16, hf, p, n, device)


def shortfalls_beside_transformers_bf16(runs, n: int = 32, per_prompt: int = 1, pooled: int | None = None) -> list:
    """The bar for a model whose tiny checkpoint bf16 itself moves (router or selection near-ties), given
    beside_transformers_bf16's runs [(prompt, ours, transformers' bf16 run's)]: per prompt, our agreeing tokens
    are at least n - 2 or at least that run's less `per_prompt`; and with `pooled` None, per prompt, at most
    `per_prompt` more positions than that run whose chosen token's logprob is off by the bf16 tolerance or more;
    with `pooled` k, over all prompts together, agreeing tokens at least that run's less k per prompt and
    positions off at most k per prompt more. Returns the shortfalls (empty: passed)."""
    out, totals = [], [0, 0, 0, 0]
    for p, (agree, errors, tol, _), (their_agree, their_errors, _, _) in runs:
        off, their_off = sum(e >= tol for e in errors), sum(e >= tol for e in their_errors)
        for i, v in enumerate((agree, their_agree, off, their_off)):
            totals[i] += v
        if agree < min(n - 2, their_agree - per_prompt):
            out.append((len(p), f"agree {agree} of {n}, transformers bf16 {their_agree}"))
        if pooled is None and off > their_off + per_prompt:
            out.append((len(p), f"{off} positions off by >= {tol:.3f}, transformers bf16 {their_off}; worst "
                                f"{[round(e, 3) for e in sorted(errors)[-3:]]} vs "
                                f"{[round(e, 3) for e in sorted(their_errors)[-3:]]}"))
    if pooled is not None:
        agree, their_agree, off, their_off = totals
        if agree < their_agree - pooled * len(runs) or off > their_off + pooled * len(runs):
            out.append(("all", f"agree {agree}, off {off}; transformers bf16 {their_agree}, {their_off}"))
    return out


def assert_no_worse_than_transformers_bf16(llm, path, prompts: list[list[int]], n: int = 32, device: str = "cpu",
                                           per_prompt: int = 1, pooled: int | None = None) -> None:
    """shortfalls_beside_transformers_bf16 is empty (transformers in float32 the exact model)."""
    runs = list(beside_transformers_bf16(llm, path, prompts, n, device))
    bad = shortfalls_beside_transformers_bf16(runs, n, per_prompt, pooled)
    assert not bad, bad


# the MoE bar (per_prompt, pooled): calibrated on the CPU (our bf16 engine and transformers' bf16 run against
# transformers float32, the GPU tests' tiny checkpoints, seeds 0-5 of Qwen3-Next / Qwen3.5-MoE and 0-3 of
# MiniMax-M2 / Mistral 4): ours agreed at worst 4 tokens fewer than transformers' bf16 run on a prompt, 3 fewer
# over a checkpoint's prompts, with at most 2 more positions off; router weights 1.5x off: 15-27 fewer per prompt
MOE_BAR = dict(per_prompt=4, pooled=1)


def assert_bf16_beside_transformers(llm, path, prompts: list[list[int]], moe: bool, label: str = "",
                                    n: int = 32, device: str = "cuda", **hf_load) -> None:
    """A bf16 engine teacher-forced against transformers in float32 (the GPU family tests): per prompt, >= n - 2
    tokens agree or every disagreement but one is a near-tie (an MoE model held instead to transformers' own bf16
    run: MOE_BAR); the chosen tokens' logprobs within the bf16 tolerance over what transformers' own bf16 run costs,
    at all positions but one. `hf_load`: transformers' from_pretrained options (e.g. a quantization config)."""
    hf = hf_causal_lm(path, dtype=torch.float32, **hf_load).to(device).eval()
    hf_bf16 = hf_causal_lm(path, dtype=torch.bfloat16, **hf_load).to(device).eval()
    runs = []
    for p in prompts:
        ours = agree, errors, tol, ties = teacher_forced_errors(llm, hf, p, n, device)
        if moe:
            runs.append((p, ours, teacher_forced_errors(TransformersAsLLM(hf_bf16, device), hf, p, n, device)))
        else:
            assert agree >= n - 2 or agree + ties >= n - 1, (label, len(p), agree, ties)
        own = same_dtype_reference_errors(hf, hf_bf16, p, n, device)
        over = sorted(e - (tol + r) for e, r in zip(errors, own))
        assert over[-2] < 0, (label, len(p), [(round(e, 3), round(r, 3)) for e, r in zip(errors, own)
                                              if e >= tol + r], tol)
    assert not (bad := shortfalls_beside_transformers_bf16(runs, n, **MOE_BAR)), (label, bad)


def decisive_routers(path, factor: float = 8.0) -> None:
    """Sharpen the random routers (logits x factor): with flat random routers many tokens sit on a near-tie at
    the top-k boundary, and a bf16 rounding that flips it swaps an expert carrying a large share of the output
    (2.6 logprob error at one position, H200, session 6). Sharp routers give the boundary experts tiny weights, so
    such a flip costs little, and the comparison tests the engine rather than the weights' ties."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.gate.wg.weight",
                              "feed_forward.router.weight", "mlp.router.weight", ".router.proj.weight")) and t.dim() == 2:
                tensors[name] = t * factor
        save_file(tensors, f, metadata={"format": "pt"})


def bf16_representable(path, keep: tuple[str, ...] = ()) -> None:
    """Round every weight of the checkpoint at `path` through bf16 (stored float32) but those whose names end
    with one of `keep` (tensors the engine holds in float32): transformers in float32 on it is then the exact
    model of what a bf16 engine loads, and a comparison with it measures the engine's arithmetic alone."""
    from safetensors.torch import load_file, save_file

    for f in path.glob("*.safetensors"):
        tensors = load_file(f)
        save_file({n: t if n.endswith(keep) else t.to(torch.bfloat16).float() for n, t in tensors.items()}, f,
                  metadata={"format": "pt"})


GRAPH_TIE = 0.1  # nats: a bf16 logit of magnitude ~10 is rounded to steps of 0.06


def eager_logprob_gap(llm, seq: list[int], a: int, b: int) -> float:
    """|logprob of a - logprob of b| after `seq` in the engine's own run of it alone (inf: either not in its top
    20). Alone, not in the batch that parted: which of the two it picks may change with the batch too."""
    top = llm.generate([seq], SamplingParams(temperature=0, max_tokens=1, logprobs=20))[0].outputs[0].logprobs[0]
    return abs(top[a].logprob - top[b].logprob) if a in top and b in top else float("inf")


def assert_graph_replay_equals_eager(path, prompts: list[list[int]], num_kv_blocks: int, **engine_kw) -> None:
    """bf16 engines with CUDA graphs and without give the same greedy tokens, on `prompts` three times over (a
    padded captured batch) and on its first prompt alone, but for at most one row that parts late at a near-tie of
    the eager engine's own logprobs; `engine_kw` go to both engines (e.g. max_model_len)."""
    from kestrel import LLM

    kw = dict(dtype="bfloat16", progress=False, async_scheduling="off", num_kv_blocks=num_kv_blocks, **engine_kw)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    graphs = LLM(str(path), **kw)
    assert graphs.engine.core.executor.runner.graphs is not None
    eager = LLM(str(path), enforce_eager=True, **kw)
    for batch in (prompts * 3, prompts[:1]):
        a = [o.outputs[0].token_ids for o in graphs.generate(batch, params)]
        b = [o.outputs[0].token_ids for o in eager.generate(batch, params)]
        diverged = [(i, next(j for j, (x, y) in enumerate(zip(ga, ea)) if x != y))
                    for i, (ga, ea) in enumerate(zip(a, b)) if ga != ea]
        # a captured batch is padded (16 rows for 12), so a kernel tiled by batch size may round one row's bf16
        # differently: allowed once, late, and only where eager itself saw a near-tie between the two tokens
        assert len(diverged) <= 1, diverged
        for i, j in diverged:
            assert j >= 8, (i, j, len(a[i]))
            gap = eager_logprob_gap(eager, list(batch[i]) + list(b[i][:j]), b[i][j], a[i][j])
            assert gap < GRAPH_TIE, (i, j, gap)
