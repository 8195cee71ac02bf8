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
	tests/kernels/test_lora_compile.py tests/kernels/test_kda_decode_compile.py tests/attention/test_triton_sparse_mla_compile.py
TRITON_INTERP_TESTS = tests/attention/test_triton_ops.py tests/attention/test_triton_mla.py tests/attention/test_triton_fp8_kv.py \
	tests/attention/test_triton_sampling.py tests/kernels/test_skinny_gemm_interp.py tests/kernels/test_gemv_interp.py \
	tests/kernels/test_moe_triton_interp.py tests/kernels/test_lora_kernels_interp.py \
	tests/structured_output/test_bitmask_triton.py tests/kernels/test_kda_decode.py \
	tests/attention/test_triton_sparse_mla.py tests/attention/test_triton_indexer_fp8.py \
	tests/attention/test_triton_topk.py tests/attention/test_triton_sparse_mla_graphs.py \
	tests/attention/test_triton_prefill_graphs.py
INTERP_RUN = HF_HUB_OFFLINE=1 PYTHONPATH=.kernels-np TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:cacheprovider --disable-warnings

# The interpreter run goes beside the suite: the suite waits on its server and worker processes for about half of
# its time, so on 2 cores the two together take little longer than the suite alone. Its log follows the suite's.
test: setup
	@$(INTERP_RUN) $(TRITON_INTERP_TESTS) > .kernels-interp.log 2>&1 & kernels=$$!; \
	trap 'kill $$kernels 2>/dev/null' INT TERM; \
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests; suite=$$?; \
	wait $$kernels; interp=$$?; \
	echo "== Triton kernels under the interpreter (ran beside the suite): $(TRITON_INTERP_TESTS) =="; \
	cat .kernels-interp.log; \
	[ $$suite -eq 0 ] && [ $$interp -eq 0 ]

# Only the Triton checks of `make test` (compile ahead of time + interpreter), for kernel work.
kernels-check: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider $(TRITON_COMPILE_TESTS)
	$(INTERP_RUN) $(TRITON_INTERP_TESTS)
