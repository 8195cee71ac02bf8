"""The runner's side of LoRA: which adapters exist (registered by id), which are in host memory (an LRU of
--max-cpu-loras; dropped ones are read from disk again), which sit in the --max-loras device slots (LRU among the
slots no live request uses), and the token -> slot mappings. Every LoRA-capable Linear of the model gets a
LoRAKernel and `fusable = False` for the model's whole life: a CUDA graph is captured once for any mix of
adapters, so the unfused path must be the one captured whether or not a step has adapters.

A model declares SupportsLoRA (kestrel/models/interfaces.py) and its parts (`lora_stages`: module prefix ->
"decoder", "tower" or "connector"; a text model is all decoder) and each part has its own mapping: the decoder's
covers the step's tokens, a vision tower's and a connector's the rows of the image being encoded, counted from
its processed inputs (the model's `lora_encoder_tokens(image)`: tiles x patches, never the decoder's
placeholders). Linears outside every declared part (a vision tower the model does not declare) get no LoRA, and
adapters targeting them are refused."""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from kestrel.config import LoRAConfig
from kestrel.errors import ConfigError
from kestrel.layers.linear import Linear
from kestrel.lora.adapter import STAGE_TARGETS, LoRAAdapter, LoRAAdapterError, load_adapter
from kestrel.lora.layers import LoRAKernel, LoRAMapping
from kestrel.models.interfaces import supports_lora

logger = logging.getLogger(__name__)


def pick_backend(device: torch.device, forced: str = "auto") -> str:
    """Triton shrink/expand on CUDA (where Triton imports), the PyTorch reference elsewhere. The reference loops
    over the slots on the host, so CUDA graphs need the Triton kernels."""
    from kestrel.platform.triton_gates import interpreter_mode, triton_importable

    ok, why = triton_importable()
    runnable = ok and (device.type == "cuda" or interpreter_mode())
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not runnable:
            raise ConfigError(f"--lora-backend triton cannot run here: {why or 'no CUDA device'}")
        return "triton"
    return "triton" if runnable and device.type == "cuda" else "torch"


class LoRAManager:
    def __init__(self, model: torch.nn.Module, cfg: LoRAConfig, device: torch.device, dtype: torch.dtype,
                 max_tokens: int, backend: str = "auto"):
        self.cfg = cfg
        self.dtype = dtype
        self.num_slots = cfg.max_loras
        self.max_cpu = cfg.max_cpu_loras or cfg.max_loras
        if self.num_slots < 1 or self.max_cpu < self.num_slots:
            raise LoRAAdapterError(f"--max-loras ({cfg.max_loras}) must be >= 1 and --max-cpu-loras "
                                   f"({cfg.max_cpu_loras}) >= --max-loras")
        self.backend = pick_backend(device, backend)
        if not supports_lora(model):
            raise ConfigError(f"--enable-lora: {type(model).__name__} does not declare SupportsLoRA")
        self.stages = tuple(model.lora_stages)
        self.mapping = LoRAMapping(max_tokens, self.num_slots, device, self.backend)  # the decoder's
        # the vision parts' mappings: one image's rows at a time, grown for larger images
        self.encoder_mappings = {stage: LoRAMapping(64, self.num_slots, device, self.backend, exact_rows=True)
                                 for _, stage in self.stages if stage != "decoder"}
        self.rename = model.lora_module_name  # adapter module paths -> ours
        self.packed = dict(model.packed_modules)
        self.linears: dict[str, Linear] = {}
        self.kernels: dict[str, LoRAKernel] = {}
        for module in model.modules():
            stage = self._stage_of(module.spec.layer_name) if isinstance(module, Linear) else None
            if stage is not None and module.spec.layer_name.rsplit(".", 1)[-1] in STAGE_TARGETS[stage]:
                name = module.spec.layer_name
                mapping = self.encoder_mappings.get(stage, self.mapping)
                module.kernel = LoRAKernel(module.kernel, module, mapping, self.num_slots, cfg.max_lora_rank,
                                           dtype, device)
                module.fusable = False
                self.linears[name] = module
                self.kernels[name] = module.kernel
        if not self.linears:
            raise LoRAAdapterError("--enable-lora: this model has no LoRA-capable layers "
                                   f"({', '.join(STAGE_TARGETS['decoder'])})")
        logger.info("LoRA: %d layers, %d device slots of rank %d, %s kernels", len(self.linears), self.num_slots,
                    cfg.max_lora_rank, self.backend)
        self.registered: dict[int, tuple[str, str]] = {}  # lora id -> (name, path)
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # LRU, most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # lora id -> device slot, LRU
        self.free_slots = list(range(self.num_slots))
        self.unreadable: dict[int, str] = {}  # the last set_mapping's adapters that could not be read again: why

    def _stage_of(self, layer_name: str) -> str | None:
        return next((stage for prefix, stage in self.stages if layer_name.startswith(prefix)), None)

    # ---- registry (engine-core utility calls)
    def add(self, lora_id: int, name: str, path: str) -> bool:
        """Read and check the adapter now (a bad one fails here, not in a later step). False: already there."""
        if lora_id in self.registered:
            if self.registered[lora_id] != (name, path):
                raise LoRAAdapterError(f"LoRA id {lora_id} is already {self.registered[lora_id][0]!r}")
            return False
        for other_id, (other, _) in self.registered.items():
            if other == name:
                raise LoRAAdapterError(f"an adapter named {name!r} is already loaded (id {other_id})")
        adapter = self._read(name, path)
        self.registered[lora_id] = (name, path)
        self._cache(lora_id, adapter)
        return True

    def remove(self, lora_id: int) -> bool:
        if self.registered.pop(lora_id, None) is None:
            return False
        self.cpu.pop(lora_id, None)
        slot = self.slot_of.pop(lora_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        return True

    def list(self) -> dict[int, str]:
        return {i: name for i, (name, _) in self.registered.items()}

    def _read(self, name: str, path: str) -> LoRAAdapter:
        try:
            return load_adapter(name, path, self.linears, self.packed, self.cfg.max_lora_rank, self.dtype,
                                self.rename)
        except LoRAAdapterError:
            raise
        except Exception as e:  # an unreadable or malformed folder (permissions, truncated files, ...) is the adapter's
            raise LoRAAdapterError(f"adapter {name!r} ({path}) cannot be read: {type(e).__name__}: {e}") from e

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self.cpu[lora_id] = adapter
        self.cpu.move_to_end(lora_id)
        while len(self.cpu) > self.max_cpu:
            self.cpu.popitem(last=False)

    # ---- device slots
    def activate(self, lora_id: int, live: set[int]) -> int:
        """The slot holding `lora_id`, loading it (evicting the least recently used adapter that no live request
        uses) if needed."""
        slot = self.slot_of.get(lora_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_id)
            return slot
        if lora_id not in self.registered:
            raise LoRAAdapterError(f"LoRA id {lora_id} is not loaded")
        adapter = self.cpu.get(lora_id)
        if adapter is None:
            adapter = self._read(*self.registered[lora_id])
        self._cache(lora_id, adapter)
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((i for i in self.slot_of if i not in live), None)
            if victim is None:
                raise RuntimeError(f"all {self.num_slots} LoRA slots are used by running requests")
            slot = self.slot_of.pop(victim)
        for name, kernel in self.kernels.items():
            kernel.set_slot(slot, adapter.layers.get(name))
        self.slot_of[lora_id] = slot
        return slot

    def set_mapping(self, request_lora_ids: list[int], tokens_per_request: list[int], live: set[int]) -> None:
        """One step's token -> slot mapping, requests in batch order (lora id 0: no adapter). An adapter dropped
        from host memory whose folder can no longer be read leaves its tokens without an adapter and is listed in
        `unreadable`: the runner reports its requests as failed (the step goes on for the others)."""
        self.unreadable = {}
        slots = []
        for i in request_lora_ids:
            if i and i not in self.unreadable:
                try:
                    slots.append(self.activate(i, live))
                    continue
                except LoRAAdapterError as e:
                    logger.error("LoRA id %d cannot be read again: %s", i, e)
                    self.unreadable[i] = str(e)
            slots.append(-1)
        self.mapping.set(np.repeat(np.asarray(slots, dtype=np.int64), tokens_per_request))

    def set_encoder_mapping(self, lora_id: int, rows: dict[str, int], live: set[int]) -> None:
        """The vision parts' mappings for one image of a request with adapter `lora_id` (0: none): `rows[stage]`
        rows, all of that adapter."""
        slot = self.activate(lora_id, live) if lora_id else -1
        for stage, mapping in self.encoder_mappings.items():
            if stage not in rows:
                raise RuntimeError(f"the model's lora_encoder_tokens gives no row count for its {stage!r}")
            mapping.set(np.full(rows[stage], slot, dtype=np.int64))
