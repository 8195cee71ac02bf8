"""Kestrel: a compact LLM inference and serving engine."""
__version__ = "0.1.0"


def __getattr__(name):  # lazy so that `import kestrel.engine.scheduler` stays light
    if name == "LLM":
        from kestrel.entrypoints import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from kestrel.core import sampling_params

        return getattr(sampling_params, name)
    if name == "PoolingParams":
        from kestrel.core.pooling import PoolingParams

        return PoolingParams
    if name == "BeamSearchParams":
        from kestrel.frontend.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(name)


__all__ = ["BeamSearchParams", "LLM", "PoolingParams", "SamplingParams", "StructuredOutputsParams", "__version__"]
