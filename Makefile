# Two commands on a fresh machine: `make demo` and `make test` (each sets up .venv first).
.PHONY: setup demo test kernels-compile

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/kestrel chat --message "What is the capital of France? Answer in one sentence." --max-tokens 64

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests

# Optional (not CI: triton is 1 GB): compile every Triton kernel for sm_90 ahead of time on the CPU.
kernels-compile: setup
	.venv/bin/python -m pip install -q "triton==3.6.0"
	.venv/bin/python -m pytest -q -p no:cacheprovider tests/attention/test_triton_compile.py
