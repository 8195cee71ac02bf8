"""Runner add-ons: per-step parts of per-request features (base.py has the interface). `build_addons` picks
them from the config and the model's declared capabilities (kestrel/models/interfaces.py)."""
from __future__ import annotations

from kestrel.lora.manager import LoRAManager
from kestrel.models.interfaces import has_bidirectional_prefix, supports_images
from kestrel.worker.addons.base import HOOKS, StepAddon, overriding
from kestrel.worker.addons.grammar import GrammarBitmask
from kestrel.worker.addons.images import ImageEncoderCache
from kestrel.worker.addons.logits_bias import LogitsBias
from kestrel.worker.addons.lora import LoRAAddon
from kestrel.worker.addons.pooling import Pooler
from kestrel.worker.addons.prefix_mask import BidirectionalPrefix


def build_addons(model, config, device, dtype, pooling_task: str | None = None,
                 pooling_method: str = "last") -> list[StepAddon]:
    """`pooling_task` (a pooling runner's, kestrel/core/pooling.py): the pooler ends its requests' steps, pooling
    by `pooling_method` (last | cls | mean)."""
    addons: list[StepAddon] = []
    lora = None
    if config.lora.enable_lora:
        sc = config.scheduler
        manager = LoRAManager(model, config.lora, device, dtype, max(sc.max_num_batched_tokens, sc.max_num_seqs),
                              config.kernel.lora_backend)
        addons.append(lora := LoRAAddon(manager, model))
    if has_bidirectional_prefix(model):
        addons.append(BidirectionalPrefix())
    if supports_images(model):
        addons.append(ImageEncoderCache(model, device, lora))
    addons.append(LogitsBias())
    addons.append(GrammarBitmask())
    if pooling_task is not None:
        addons.append(Pooler(model, device, pooling_method))
    return addons


def lora_manager(addons: list[StepAddon]):
    """The LoRAManager among `addons` (None without --enable-lora)."""
    return next((a.manager for a in addons if isinstance(a, LoRAAddon)), None)


__all__ = ["HOOKS", "StepAddon", "build_addons", "lora_manager", "overriding"]
