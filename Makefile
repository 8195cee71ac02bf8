# Two commands on a fresh machine: `make demo` and `make test` (each sets up .venv first).
.PHONY: setup demo test kernels-check

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/kestrel chat --message "What is the capital of France? Answer in one sentence." --max-tokens 64

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests

# Optional (not CI: triton is 1 GB). Checks the Triton kernels on the CPU: every kernel compiles for sm_90 ahead
# of time, and the attention/sampling ops match their references under the Triton interpreter. The interpreter of
# triton 3.6 needs numpy < 2.4 (numpy 2.4 refuses int() of a 1-element array, which its range() does), so that
# numpy goes to .kernels-np/, first on PYTHONPATH for this target only.
kernels-check: setup
	.venv/bin/python -m pip install -q "triton==3.6.0"
	.venv/bin/python -m pip install -q --target .kernels-np "numpy==2.3.5"
	.venv/bin/python -m pytest -q -p no:cacheprovider tests/attention/test_triton_compile.py tests/kernels/test_moe_triton_compile.py \
		tests/kernels/test_lora_compile.py tests/structured_output/test_bitmask_triton.py
	PYTHONPATH=.kernels-np TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider \
		tests/attention/test_triton_ops.py tests/attention/test_triton_mla.py tests/attention/test_triton_sampling.py tests/kernels/test_skinny_gemm_interp.py \
		tests/kernels/test_moe_triton_interp.py tests/kernels/test_lora_kernels_interp.py \
		tests/structured_output/test_bitmask_triton.py
