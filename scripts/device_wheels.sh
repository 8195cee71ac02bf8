#!/usr/bin/env bash
# The Python packages the GPU machine's image lacks, as cp312 manylinux wheels in .whl/ (git-excluded; carried to
# the device with carry [".whl"] and installed there into /tmp/site, see benchmarks/suite.py's docstring):
# the engine's own (msgspec, pyzmq, gguf, pillow, pybase64, av: video_url's decoder), structured outputs
# (xgrammar + tvm-ffi, pydantic, jsonschema), the OpenAI server and the serving benchmarks' client (fastapi,
# starlette, uvicorn + httptools, httpx2), and what vLLM 0.26's OpenAI server imports beyond shared/peers/vllm's wheels (uvicorn, watchfiles,
# model-hosting-container-standards) and what its LLaVA model module imports when the server inspects the
# architecture (mistral_common, pydantic_extra_types, pycountry); and fla-core, the batched KDA prefill's kernels
# (pure Python + Triton, py3-none-any; its one other dependency, einops, is in the image).
# Usage: bash scripts/device_wheels.sh   (needs PyPI; no dependencies resolved: the list is complete)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  annotated_doc==0.0.7 annotated_types==0.7.0 apache_tvm_ffi==0.1.15.post2 attrs==26.1.0 av==18.1.0 \
  fastapi==0.165.0 fla_core==0.6.0 \
  gguf==0.19.0 httptools==0.9.0 httpcore2==2.16.2 httpx2==2.16.2 jmespath==1.1.0 jsonschema==4.25.1 \
  jsonschema_specifications==2025.9.1 mistral_common==1.13.1 model_hosting_container_standards==0.1.16 msgspec==0.23.0 \
  opentelemetry_api==1.45.2 pillow==13.0.0 pybase64==1.5.1 pycountry==26.2.16 pydantic==2.12.5 pydantic_extra_types==2.11.1 pydantic_core==2.41.5 pyzmq==27.3.0 \
  referencing==0.37.0 rpds_py==2026.9.1 starlette==1.10.0 supervisor==4.3.0 truststore==0.10.5 \
  typing_inspection==0.4.2 uvicorn==0.55.0 watchfiles==1.3.0 xgrammar==0.2.9
# py-spy for the suite's mmspy stage (a static binary, tagged manylinux1)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl py-spy==0.4.3
# compressed-tensors, the INT4 expert tests' reference (pure Python; torch and transformers are in the image)
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl compressed_tensors==0.20.1 loguru==0.7.3
ls .whl | wc -l
# vLLM 0.26's LLaVA path on the device (the suite's vsite stage installs these into its vsite, for its server only):
# its pixtral.py imports names transformers 5.17 renamed, so it runs on transformers 5.5.3; blake3 and
# prometheus_fastapi_instrumentator are imported inside functions (the multimodal hasher, the metrics route).
mkdir -p .whl2
grep -qx '/.whl2/' .git/info/exclude 2>/dev/null || echo '/.whl2/' >> .git/info/exclude
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl2 \
  transformers==5.5.3 blake3==1.0.11 prometheus_fastapi_instrumentator==8.1.0
ls .whl2 | wc -l
