"""Kestrel: a compact LLM inference and serving engine."""
__version__ = "0.1.0"


def __getattr__(name):  # lazy so that `import kestrel.engine.scheduler` stays light
    if name == "LLM":
        from kestrel.entrypoints import LLM

        return LLM
    if name == "SamplingParams":
        from kestrel.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
