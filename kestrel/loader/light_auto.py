"""transformers' AutoConfig and AutoTokenizer without importing transformers' model code.

transformers 5 reaches its generation utilities, and through them masking_utils (torch._dynamo), FSDP,
torch.distributed.tensor (and sklearn where installed), ~3 s of a CPU start-up and ~5 s on a GPU host, by two
paths that an engine with its own model code does not need:
- every configuration module decorates its config class with `auto_docstring`, whose docstring build imports
  transformers.models.auto.modeling_auto. While a config or tokenizer loads here, that decorator leaves config
  classes as they are (with their raw docstring);
- tokenization_auto imports auto_factory, which imports GenerationMixin only to mix it into remote-code model
  classes (add_generation_mixin_to_remote_model). auto_factory is imported here with a stand-in, and that function
  imports the real class the first time it runs.
Everything else (AutoConfig's class choice, defaults, rope-parameter standardisation; AutoTokenizer's class choice)
is transformers' own. Where transformers' layout differs, the normal (slower) path runs.
tests/loader/test_light_auto.py fails if the heavy modules come back or a config or tokenizer differs."""
from __future__ import annotations

import functools
import importlib
import sys
import threading
from contextlib import contextmanager

_AUTO_FACTORY = "transformers.models.auto.auto_factory"

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


class _GenerationMixinNotImported:
    """auto_factory's GenerationMixin until add_generation_mixin_to_remote_model first runs."""


def _import_auto_factory_without_generation() -> None:
    if _AUTO_FACTORY in sys.modules:
        return
    import transformers.generation as gen

    if "GenerationMixin" in vars(gen):  # generation utils are loaded already: nothing to save
        return
    with _swap:
        gen.GenerationMixin = _GenerationMixinNotImported
        try:
            af = importlib.import_module(_AUTO_FACTORY)
        finally:
            if vars(gen).get("GenerationMixin") is _GenerationMixinNotImported:
                del gen.GenerationMixin
    if vars(af).get("GenerationMixin") is not _GenerationMixinNotImported:
        return
    add_mixin = getattr(af, "add_generation_mixin_to_remote_model", None)
    if not callable(add_mixin):  # its one user is gone: the real class now
        af.GenerationMixin = importlib.import_module("transformers.generation").GenerationMixin
        return

    @functools.wraps(add_mixin)
    def add_generation_mixin_to_remote_model(model_class):
        af.GenerationMixin = importlib.import_module("transformers.generation").GenerationMixin
        af.add_generation_mixin_to_remote_model = add_mixin
        return add_mixin(model_class)

    af.add_generation_mixin_to_remote_model = add_generation_mixin_to_remote_model


def import_auto_classes() -> None:
    """Import AutoConfig and AutoTokenizer the light way (before threads start: transformers' lazy imports are not
    thread-safe)."""
    with _config_classes_undocumented():
        _import_auto_factory_without_generation()
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401


def tokenizer_from_pretrained(path, **kwargs):
    """AutoTokenizer.from_pretrained(path, **kwargs)."""
    with _config_classes_undocumented():
        _import_auto_factory_without_generation()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), **kwargs)
