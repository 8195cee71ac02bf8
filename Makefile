# Two commands on a fresh machine: `make demo` and `make test` (each sets up .venv first).
.PHONY: setup demo test

setup:
	./scripts/setup.sh

demo: setup
	.venv/bin/kestrel chat --message "What is the capital of France? Answer in one sentence." --max-tokens 64

test: setup
	HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests
