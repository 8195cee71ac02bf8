"""The model runner's build, above the worker: the runner add-ons of feature packages that sit above it
(speculative decoding's verify steps and drafter) join the worker's own."""
from __future__ import annotations

from kestrel.spec_decode.runner_addon import runner_addons as speculative_addons

# callables (config, loaded model, device, dtype, max_step_tokens) -> [StepAddon], in the order their hooks run
RUNNER_FEATURES = (speculative_addons,)


def build_runner(config, progress: bool = True, parallel=None):
    from kestrel.worker.model_runner import ModelRunner

    return ModelRunner(config, progress, parallel, feature_addons=RUNNER_FEATURES)
