"""LoRA admin routes (vLLM's names): POST /v1/load_lora_adapter {lora_name, lora_path} and
POST /v1/unload_lora_adapter {lora_name}. Both fan out to every engine core (kestrel/frontend/lora_registry.py): the reply
is 200 when every engine applied the change; otherwise the change is undone where it succeeded and the error body
names the engines that failed and why. The app decides who may call them (the `dependencies` it passes)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from kestrel.errors import InvalidRequest


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM compatibility; the name decides


def lora_router(state, dependencies=()) -> APIRouter:
    router = APIRouter(dependencies=list(dependencies))
    engine = state.engine

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(req: LoadLoRAAdapterRequest):
        if req.lora_name == state.model_name:
            raise InvalidRequest(f"lora_name {req.lora_name!r} is the base model's name", param="lora_name")
        await engine.load_lora_adapter(req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
        await engine.unload_lora_adapter(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router


def lora_model_cards(state) -> list[dict]:
    """/v1/models entries of the loaded adapters, each naming its parent (the base model)."""
    return [{"id": r.name, "object": "model", "created": state.created, "owned_by": "kestrel", "root": r.path,
             "parent": state.model_name, "max_model_len": state.engine.max_model_len}
            for r in state.engine.loras.adapters.values()]
