"""The token-block layout the batched LoRA kernels (kestrel/kernels/triton_ops/lora.py) read and the LoRA mapping
(kestrel/lora/layers.py) writes. Importing it needs no triton."""

BLOCK_M = 16  # token rows per program of the Triton LoRA kernels
