"""The runner's draft models (speculative_config methods "mtp" and "eagle3"), fed the target's hidden states
(kestrel/worker/hidden_capture.py). After each step the runner calls the drafter's after_step, which records what
the step computed and drafts for the requests that sampled (RunnerOutput.next_drafts); bind (after the KV
groups exist) and capture_graphs (after the decode graphs) are its other hooks. EAGLE-3
(kestrel/worker/eagle3_drafter.py) keeps a KV cache of its own, one more layer of the target's full-attention KV
group; MTP (kestrel/worker/mtp_drafter.py) recomputes a window of the last positions
(kestrel/worker/window_drafter.py)."""
from __future__ import annotations


def build_drafter(spec, target, hf_config, context, target_path: str, device, dtype, max_tokens: int):
    """The runner's draft model for a speculative_config (methods mtp, eagle3); None where the engine drafts.
    `context`: the loaded model's ModelContext, where an EAGLE-3 draft registers its attention layer (built before
    the layers are bound to KV groups)."""
    kw = dict(max_tokens=max_tokens, max_batch=spec.disable_by_batch_size) if spec is not None else {}
    if spec is not None and spec.method == "mtp":
        from kestrel.worker.mtp_drafter import MtpDrafter

        return MtpDrafter(target, hf_config, target_path, spec.num_speculative_tokens, device, dtype, **kw)
    if spec is not None and spec.method == "eagle3":
        from kestrel.worker.eagle3_drafter import Eagle3Drafter

        return Eagle3Drafter(target, hf_config, context, spec.model, spec.num_speculative_tokens, device, dtype,
                             **kw)
    return None
