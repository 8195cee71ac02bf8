"""Triton kernels. Modules here import triton at import time: import them lazily (on first use), never from
kestrel.kernels' import path, so that machines without triton (CI, CPU) never need it."""
