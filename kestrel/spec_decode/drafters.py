"""The runner's draft models (speculative_config methods "mtp" and "eagle3"), fed the target's hidden states
(kestrel/spec_decode/hidden_capture.py). A drafter is a runner add-on (DrafterAddon,
kestrel/spec_decode/runner_addon.py): after each step its after_step records what the step computed and drafts for the requests that sampled
(RunnerOutput.next_drafts); bind_kv (after the KV groups exist) and capture_graphs (after the decode graphs) run
at start-up. EAGLE-3
(kestrel/spec_decode/eagle3_drafter.py) keeps a KV cache of its own, one more layer of the target's full-attention KV
group; MTP (kestrel/spec_decode/mtp_drafter.py) recomputes a window of the last positions
(kestrel/spec_decode/window_drafter.py)."""
from __future__ import annotations


def build_drafter(spec, target, hf_config, context, target_path: str, device, dtype, max_tokens: int):
    """The runner's draft model for a speculative_config (methods mtp, eagle3); None where the engine drafts.
    `context`: the loaded model's ModelContext, where an EAGLE-3 draft registers its attention layer (built before
    the layers are bound to KV groups)."""
    kw = dict(max_tokens=max_tokens, max_batch=spec.disable_by_batch_size) if spec is not None else {}
    if spec is not None and spec.method == "mtp":
        from kestrel.spec_decode.mtp_drafter import MtpDrafter

        drafter = MtpDrafter(target, hf_config, target_path, spec.num_speculative_tokens, device, dtype, **kw)
        drafter.cfg = spec
        return drafter
    if spec is not None and spec.method == "eagle3":
        from kestrel.spec_decode.eagle3_drafter import Eagle3Drafter

        drafter = Eagle3Drafter(target, hf_config, context, spec.model, spec.num_speculative_tokens, device, dtype,
                                **kw)
        drafter.cfg = spec
        return drafter
    return None
