"""transformers' Auto classes without importing transformers' model code.

In transformers 5 every configuration module decorates its config class with `auto_docstring`, and building that
docstring imports transformers.models.auto.modeling_auto: generation utilities, FSDP, torch.distributed.tensor,
torch._dynamo (and sklearn where installed), ~3 s of a CPU start-up and ~5 s on a GPU host, for a docstring. While
a config loads here, that decorator leaves config classes as they are (with their raw docstring); everything else,
AutoConfig's class choice, defaults and rope-parameter standardisation included, is transformers' own.
tests/loader/test_light_auto.py fails if the heavy modules come back or a config differs."""
from __future__ import annotations

import threading
from contextlib import contextmanager

_swap = threading.RLock()  # one swap at a time, so that a restore never puts back another thread's stand-in


@contextmanager
def _config_classes_undocumented():
    import transformers.utils as tu
    from transformers.configuration_utils import PreTrainedConfig

    real = getattr(tu, "auto_docstring", None)
    if not callable(real):  # transformers' layout changed: the normal (slower) path
        yield
        return

    def auto_docstring(obj=None, **kwargs):
        def decorate(o):
            if isinstance(o, type) and issubclass(o, PreTrainedConfig):
                return o
            return real(o, **kwargs)  # whatever else a module imported meanwhile decorates: documented as usual
        return decorate if obj is None else decorate(obj)

    with _swap:
        tu.auto_docstring = auto_docstring
        try:
            yield
        finally:
            tu.auto_docstring = real


def config_from_pretrained(path, **kwargs):
    """AutoConfig.from_pretrained(path, **kwargs)."""
    from transformers import AutoConfig

    with _config_classes_undocumented():
        return AutoConfig.from_pretrained(str(path), **kwargs)


def config_for_model(model_type: str, **kwargs):
    """AutoConfig.for_model(model_type, **kwargs)."""
    from transformers import AutoConfig

    with _config_classes_undocumented():
        return AutoConfig.for_model(model_type, **kwargs)
