"""The model runner's build, above the worker: the runner add-ons of feature packages that sit above it
(speculative decoding's verify steps and drafter) join the worker's own."""
from __future__ import annotations

from kestrel.spec_decode.runner_addon import runner_addons as speculative_addons

# callables (config, loaded model, device, dtype, max_step_tokens) -> [StepAddon], in the order their hooks run
RUNNER_FEATURES = (speculative_addons,)


def build_runner(config, progress: bool = True, parallel=None):
    """The runner over the build's parts (kestrel/worker/build.py build_parts), not yet started."""
    from kestrel.worker.build import build_parts
    from kestrel.worker.model_runner import ModelRunner

    return ModelRunner(build_parts(config, progress, parallel, RUNNER_FEATURES))
