"""The lowest-level types, shared by the engine (scheduler, KV manager) and the worker (model runner, models):
per-layer KV-cache specs and the per-step messages from the scheduler to the runner. Imports nothing of Kestrel
but the sampling parameters."""
