"""Control calls: what `Executor.call_all(method, *args)` may run on every rank's ModelRunner. Only the methods of
CONTROL_METHODS are callable by name; each returns a value msgspec can encode. LoRA's registry lives here (every
rank keeps the same adapters; each reads its own shard of them)."""
from __future__ import annotations

import logging

from kestrel.errors import InvalidRequest

logger = logging.getLogger(__name__)


def _lora(runner):
    if runner.lora is None:
        raise InvalidRequest("LoRA is not enabled on this engine (start it with --enable-lora)")
    return runner.lora


def add_lora(runner, lora_id: int, name: str, path: str) -> bool:
    """Read and check the adapter (this rank's shard); False when it was already there."""
    added = _lora(runner).add(lora_id, name, path)
    if added:
        logger.info("LoRA adapter %r (id %d) loaded", name, lora_id)
    return added


def remove_lora(runner, lora_id: int) -> bool:
    removed = _lora(runner).remove(lora_id)
    if removed:
        logger.info("LoRA adapter id %d removed", lora_id)
    return removed


def list_loras(runner) -> list[list]:
    """[[lora id, name], ...] of the adapters this rank holds."""
    return sorted([i, n] for i, n in _lora(runner).list().items())


CONTROL_METHODS = {"add_lora": add_lora, "remove_lora": remove_lora, "list_loras": list_loras}


def run_control(runner, method: str, args) -> object:
    fn = CONTROL_METHODS.get(method)
    if fn is None:
        raise InvalidRequest(f"{method!r} is not a control method of the model runner "
                             f"(callable: {', '.join(sorted(CONTROL_METHODS))})")
    return fn(runner, *args)
