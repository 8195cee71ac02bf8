# Two commands on a fresh machine: `make demo` and `make test` (each sets up .venv first).
.PHONY: setup demo test kernels-check

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/kestrel chat --message "What is the capital of France? Answer in one sentence." --max-tokens 64

# The suite, then the Triton kernels under the Triton interpreter on the CPU (triton comes with setup; the main run
# already checks that every kernel compiles for sm_90 ahead of time). TRITON_INTERPRET must be set before triton is
# first imported, hence a second run. triton 3.6's interpreter needs numpy < 2.4 (numpy 2.4 refuses int() of a
# 1-element array, which its range() does), so setup puts that numpy in .kernels-np/, first on PYTHONPATH there.
TRITON_COMPILE_TESTS = tests/attention/test_triton_compile.py tests/kernels/test_moe_triton_compile.py \
	tests/kernels/test_lora_compile.py tests/kernels/test_kda_decode_compile.py tests/attention/test_triton_sparse_mla_compile.py \
	tests/kernels/test_w4a16_compile.py
TRITON_INTERP_TESTS = tests/attention/test_triton_ops.py tests/attention/test_triton_mla.py tests/attention/test_triton_fp8_kv.py \
	tests/attention/test_triton_sampling.py tests/kernels/test_skinny_gemm_interp.py tests/kernels/test_gemv_interp.py \
	tests/kernels/test_moe_triton_interp.py tests/kernels/test_lora_kernels_interp.py \
	tests/structured_output/test_bitmask_triton.py tests/kernels/test_kda_decode.py \
	tests/attention/test_triton_sparse_mla.py tests/attention/test_triton_indexer_fp8.py \
	tests/attention/test_triton_topk.py tests/attention/test_triton_sparse_mla_graphs.py \
	tests/attention/test_triton_prefill_graphs.py tests/attention/test_triton_sinks.py \
	tests/attention/test_mrope_fused_interp.py tests/kernels/test_w4a16_interp.py tests/kernels/test_kv_rows.py
INTERP_RUN = HF_HUB_OFFLINE=1 PYTHONPATH=.kernels-np TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider --disable-warnings

# Two pytest-xdist workers for the 2 cores (-n 2): the suite's tests wait on their server and worker processes for
# much of their time; --dist loadfile keeps each file's module fixtures (a started server) on one worker. Tests
# marked serial assert latencies, which the other worker's load would blur: they run alone afterwards.
test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile -m "not serial" tests
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider -m serial tests
	$(INTERP_RUN) -n 2 $(TRITON_INTERP_TESTS)

# Only the Triton checks of `make test` (compile ahead of time + interpreter), for kernel work.
kernels-check: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider $(TRITON_COMPILE_TESTS)
	$(INTERP_RUN) -n 2 $(TRITON_INTERP_TESTS)
