"""Multi-LoRA serving: PEFT adapters (adapter.py), the per-layer LoRA kernels wrapped around a Linear's kernel
(layers.py, with the Triton shrink/expand in kestrel/kernels/triton_ops/lora.py), the runner-side slots, caches
and per-token mapping (manager.py) and the frontend's adapter registry (registry.py)."""
