#!/usr/bin/env bash
# Everything the GPU checks need, in one device call:  bash benchmarks/gpu_suite.sh [stages...]
# MoE (issue 13): moe (GPU kernel tests + kernel table), moealign (layout tests + the routing layout alone by slot
#   count, one program vs grid, Qwen3-30B-A3B and DeepSeek-V2-Lite), moetune (tile search, writes fused_moe.json to $OUT),
#   tputmoe / latmoe (Qwen3-30B-A3B shape), vllmmoe (vLLM 0.26 peer on the same shape; needs /tmp/site staged).
# MLA (issue 14): mla (GPU MLA tests + the decode kernel alone), mlatune (decode tile sweep, V2-Lite and V3 heads),
#   mlapre (the dense prefill path of one layer, 16k tokens, old glue vs expand_kv),
#   tputmla / latmla (DeepSeek-V2-Lite shape: MLA + MoE), tputmlad / latmlad (its all-dense variant),
#   vllmmla / vllmmlad (vLLM 0.26 peer on the same shapes; needs /tmp/site staged).
# LoRA (issue 16): lora (GPU LoRA tests), tputlora (256 requests, 4 rank-16 adapters vs none, qwen3-0.6b shape).
# Images (issue 15): mmvllm (LLaVA-NeXT-7B shape, one image per chat request: vLLM 0.26 server, then ours), or the
#   halves mmv / mmk; mmrender (our frontend alone: render threads x torch threads, cold and warm); vsite (after
#   staging vLLM: .whl2's transformers 5.5.3 + blake3 + prometheus_fastapi_instrumentator into /tmp/vsite, whose
#   LLaVA path does not import under the image's transformers 5.17; carry [".whl2"]); mmprof (the engine alone,
#   offline: encoder time, prefill rates, a closed loop without the server); mmkw (images on the server's render threads vs 8 render processes); mmspy
#   (py-spy of the frontend, the engine core and the client under load: benchmarks/mm_spy.sh).
# Structured outputs (issue 18): structured (256 requests, a JSON schema on each vs none), structfill (the host's
#   accept + bitmask fill per step, no GPU, by fill-thread count), structgpu (GPU + engine structured-output tests).
# Tensor parallelism (issue 19): tp (mp executor + NCCL at TP 1 == in-process; TP 2 == TP 1 where 2 GPUs).
# Multi-GPU (issue 20; 2, 4 or 8 GPUs; each stage fits one 600-s call: a command's timeout is capped by what is left
#   of 580 s since the suite started, and a command with under 30 s left is skipped):
#   multigpu1: the TP GPU tests (TP 2 vs TP 1: Llama, Qwen3, Qwen3-MoE in bf16, CUDA graphs on and off), llama-8b
#     throughput + latency at TP 1 and TP 2, qwen3-30b-a3b throughput at TP 2;
#   multigpu2: data parallel 2 vs one engine core (llama-8b), then with 4+ GPUs llama-70b throughput + latency at
#     TP 4; multigpu3 (8 GPUs): llama-70b throughput + latency at TP 8; vllmtp: vLLM 0.26 at TP 2 on llama-8b
#     (needs /tmp/vsite staged).
# Stages: startup imports startprof tput0 tput0nopdl tputsweep tests attnt b1k attn tput lat latnopdl lat8b tput8b fp8 tputfp8 structured sweep trace tracelat profile profile1 profile8b. Logs and JSON go to $OUT (or ./gpu_out).
# The device image lacks some packages: `bash scripts/device_wheels.sh` puts them in .whl/; each call then carries
# [".whl"] and starts with `python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl` and
# PYTHONPATH=/tmp/site:$PWD (pass KESTREL_COMMIT=<sha>: the device's copy of .git is not this checkout's HEAD).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
stages=${*:-tests tput lat lat8b tput8b}
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
# run_capped SECONDS CMD...: CMD under `timeout`, at most SECONDS and at most what is left of the call's 580 s
run_capped() {
  local left=$((580 - SECONDS)) cap=$1; shift
  if ((left < 30)); then echo "--- skipped (${left} s left): $*"; return 0; fi
  timeout $((cap < left ? cap : left)) "$@"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
echo "${KESTREL_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}" | tee -a "$OUT/device.txt"  # the device's .git is stale
for s in $stages; do
  echo "=== $s $(date +%T)"
  case $s in
    tests)  timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/gpu tests/kernels/test_gemv_interp.py \
              tests/kernels/test_skinny_gemm_interp.py 2>&1 | tail -25 ;;
    attnt)  timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/attention -k "qk_norm or gpu" 2>&1 | tail -8 ;;
    b1k)    timeout 200 python3 -m benchmarks.batch1_kernels 2>&1 | tee "$OUT/batch1_kernels.txt" | grep -v "^config failed" | tail -40 ;;
    attn)   timeout 200 python3 -m benchmarks.gpu_attention_check --quick 2>&1 | tail -30 ;;
    tput)   timeout 300 python3 -m benchmarks.throughput --shape qwen3-0.6b --hf-requests 64 --json "$OUT/tput.json" 2>&1 | grep -v Warning | tail -25 ;;
    tput0nopdl) timeout 200 python3 -m benchmarks.throughput --no-pdl --shape qwen3-0.6b --hf-requests 0 --json "$OUT/tput_nopdl.json" 2>&1 | grep -i "kestrel\|start" ;;
    tputsweep) timeout 330 python3 -m benchmarks.throughput --shape qwen3-0.6b --hf-requests 64 --sweep --json "$OUT/tput.json" 2>&1 | grep -v Warning | tail -32 ;;
    ab)     for tree in .old .; do  # regression A/B: .old holds the previous tree (git archive <sha> | tar -x -C .old)
              echo "--- tree $tree ($(cat $tree/.commit 2>/dev/null || git rev-parse --short HEAD))"
              timeout 200 python3 $tree/benchmarks/throughput.py --shape qwen3-0.6b --hf-requests 0 2>&1 | grep -i "^| kestrel\|start-up\|mean step"
              timeout 150 python3 $tree/benchmarks/latency.py --shape qwen3-0.6b --hf-output-len 0 2>&1 | grep -i "kestrel"
            done ;;
    tput0)  timeout 200 python3 -m benchmarks.throughput --shape qwen3-0.6b --hf-requests 0 --json "$OUT/tput.json" 2>&1 | tail -12 ;;
    sweep)  timeout 200 python3 -m benchmarks.throughput --shape qwen3-0.6b --hf-requests 0 --sweep --json "$OUT/sweep.json" 2>&1 | tail -25 ;;
    lat)    timeout 150 python3 -m benchmarks.latency --shape qwen3-0.6b --json "$OUT/lat.json" 2>&1 | tail -12 ;;
    latnopdl) timeout 150 python3 -m benchmarks.latency --no-pdl --shape qwen3-0.6b --hf-output-len 0 --json "$OUT/lat_nopdl.json" 2>&1 | grep kestrel ;;
    lat8b)  timeout 200 python3 -m benchmarks.latency --shape llama-8b --hf-output-len 32 --json "$OUT/lat8b.json" 2>&1 | tail -12 ;;
    tput8b) timeout 300 python3 -m benchmarks.throughput --shape llama-8b --hf-requests 0 --json "$OUT/tput8b.json" 2>&1 | tail -20 ;;
    fp8)    timeout 200 python3 -m benchmarks.gpu_fp8 2>&1 | tail -40 ;;
    structured) timeout 400 python3 -m benchmarks.structured --shape qwen3-0.6b --json "$OUT/structured.json" 2>&1 | grep -v Warning | tail -13 ;;
    structthreads) timeout 400 python3 -m benchmarks.structured --shape qwen3-0.6b --fill-threads 14,10,6 --json "$OUT/structured_threads.json" 2>&1 | grep -v Warning | tail -14 ;;
    structfill) timeout 300 python3 -m benchmarks.structured_fill --threads 1,4,8,14 --json "$OUT/structured_fill.json" 2>&1 | tail -10 ;;
    structgpu) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_structured.py \
              tests/structured_output/test_bitmask_triton.py tests/structured_output/test_engine.py 2>&1 | tail -8 ;;
    tputfp8) timeout 200 python3 -m benchmarks.throughput --shape qwen3-0.6b --hf-requests 0 --quantization fp8 --json "$OUT/tputfp8.json" 2>&1 | tail -12 ;;
    trace)  timeout 200 python3 -m benchmarks.step_trace --shape qwen3-0.6b --json "$OUT/trace.json" 2>&1 | tail -14 ;;
    tracelat) timeout 150 python3 -m benchmarks.step_trace --shape qwen3-0.6b --latency --json "$OUT/trace_lat.json" 2>&1 | tail -8 ;;
    profile) (timeout 150 python3 -m benchmarks.profile_step > "$OUT/profile.txt" 2>&1; head -3 "$OUT/profile.txt") ;;
    startup) export TRITON_CACHE_DIR=/tmp/triton_cold_$$  # first start compiles every kernel, the second finds them cached
             for i in 1 2; do timeout 100 python3 -m benchmarks.startup --shape qwen3-0.6b > "$OUT/startup$i.log" 2>&1; grep "Pre-compiled\|^start-up" "$OUT/startup$i.log"; done
             unset TRITON_CACHE_DIR ;;
    imports) (timeout 60 python3 -X importtime -c "from benchmarks.common import write_shape; from kestrel.loader import load_hf_config; import kestrel.entrypoints; load_hf_config(write_shape('qwen3-0.6b'))" 2> "$OUT/importtime.txt"; sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -4) ;;
    startprof) TRITON_CACHE_DIR=/tmp/triton_cold_p$$ timeout 100 python3 -m benchmarks.startup --cprofile > "$OUT/startprof.txt" 2>&1; grep "start-up\|Pre-compiled" "$OUT/startprof.txt" ;;
    profile1) (timeout 150 python3 -m benchmarks.profile_step --batch 1 --greedy > "$OUT/profile1.txt" 2>&1; head -3 "$OUT/profile1.txt") ;;
    profile8b) (timeout 200 python3 -m benchmarks.profile_step --batch 1 --greedy --shape llama-8b > "$OUT/profile8b.txt" 2>&1; head -3 "$OUT/profile8b.txt") ;;
    moe)    timeout 330 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_moe.py tests/gpu/test_gpu_moe_models.py 2>&1 | tail -6
            timeout 230 python3 -m benchmarks.moe_kernel --json "$OUT/moe_kernel.json" 2>&1 | tail -20 ;;
    moetune) timeout 300 python3 -m benchmarks.moe_kernel --tune --write --json "$OUT/moe_tuned.json" 2>&1 | tail -20
            cp kestrel/kernels/configs/fused_moe.json "$OUT/fused_moe.json" ;;
    moetunemla) timeout 300 python3 -m benchmarks.moe_kernel --shape deepseek-v2-lite --tune --write \
              --json "$OUT/moe_tuned_mla.json" 2>&1 | tail -20
            cp kestrel/kernels/configs/fused_moe.json "$OUT/fused_moe.json" ;;
    moealign) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton_interp.py \
              tests/gpu/test_gpu_moe.py -k "layout or graph or warm_up or grid" 2>&1 | tail -4
            for sh in qwen3-30b-a3b deepseek-v2-lite; do timeout 120 python3 -m benchmarks.moe_kernel --align --shape $sh \
              --json "$OUT/moe_align_$sh.json" 2>&1 | tail -14; done ;;
    kern)   timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_triton_interp.py \
              tests/attention/test_triton_mla.py tests/gpu/test_gpu_mla.py tests/gpu/test_gpu_moe.py 2>&1 | tail -8 ;;
    mlatune16) timeout 400 python3 -m benchmarks.mla_decode --sweep 2>&1 | tee "$OUT/mla_tune16.txt" | tail -5 ;;
    tputmoe) timeout 480 python3 -m benchmarks.throughput --shape qwen3-30b-a3b --hf-requests 0 --json "$OUT/tput_moe.json" 2>&1 | grep -v Warning | tail -12 ;;
    latmoe) timeout 300 python3 -m benchmarks.latency --shape qwen3-30b-a3b --hf-output-len 0 --json "$OUT/lat_moe.json" 2>&1 | tail -8 ;;
    tp)     timeout 300 python3 -m pytest -q -x -rs -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tail -8 ;;
    lora)   timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_lora.py \
              tests/kernels/test_lora_kernels_interp.py 2>&1 | tail -8 ;;
    tputlora) timeout 400 python3 -m benchmarks.lora_throughput --shape qwen3-0.6b --json "$OUT/tput_lora.json" 2>&1 \
              | grep -v Warning | tail -10 ;;
    mla)    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_gpu_mla.py tests/attention/test_triton_mla.py \
              tests/attention/test_mla.py 2>&1 | tail -6
            timeout 200 python3 -m benchmarks.mla_decode 2>&1 | tee "$OUT/mla_decode.txt" | tail -12 ;;
    mlatune) timeout 400 python3 -m benchmarks.mla_decode --sweep 2>&1 | tee "$OUT/mla_tune16.txt" | tail -60
            timeout 400 python3 -m benchmarks.mla_decode --sweep --heads 128 2>&1 | tee "$OUT/mla_tune128.txt" | tail -60 ;;
    tputmla) timeout 480 python3 -m benchmarks.throughput --shape deepseek-v2-lite --hf-requests 0 --max-model-len 4096 \
              --json "$OUT/tput_mla.json" 2>&1 | grep -v Warning | tail -16 ;;
    latmla) timeout 300 python3 -m benchmarks.latency --shape deepseek-v2-lite --hf-output-len 0 --max-model-len 4096 \
              --json "$OUT/lat_mla.json" 2>&1 | tail -8 ;;
    tputmlad) timeout 480 python3 -m benchmarks.throughput --shape deepseek-v2-lite-dense --hf-requests 0 \
              --max-model-len 4096 --json "$OUT/tput_mla_dense.json" 2>&1 | grep -v Warning | tail -16 ;;
    latmlad) timeout 300 python3 -m benchmarks.latency --shape deepseek-v2-lite-dense --hf-output-len 0 --max-model-len 4096 \
              --json "$OUT/lat_mla_dense.json" 2>&1 | tail -8 ;;
    vllmmla) PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} timeout 560 python3 -m benchmarks.vllm_peer --shape deepseek-v2-lite \
              --json "$OUT/vllm_mla.json" 2>&1 | grep -v Warning | tail -8 ;;
    vllmmlad) PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} timeout 560 python3 -m benchmarks.vllm_peer \
              --shape deepseek-v2-lite-dense --json "$OUT/vllm_mla_dense.json" 2>&1 | grep -v Warning | tail -8 ;;
    engine) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_engine.py 2>&1 | tail -6 ;;
    moemodels) timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_moe_models.py > "$OUT/moemodels.txt" 2>&1; tail -3 "$OUT/moemodels.txt" ;;
    tp1)    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 | tail -40 ;;
    profmla) (timeout 300 python3 -m benchmarks.profile_step --shape deepseek-v2-lite > "$OUT/profile_mla.txt" 2>&1; head -45 "$OUT/profile_mla.txt") ;;
    prof1moe) (timeout 300 python3 -m benchmarks.profile_step --batch 1 --greedy --shape qwen3-30b-a3b > "$OUT/profile1_moe.txt" 2>&1; head -45 "$OUT/profile1_moe.txt") ;;
    prof1mla) (timeout 300 python3 -m benchmarks.profile_step --batch 1 --greedy --shape deepseek-v2-lite > "$OUT/profile1_mla.txt" 2>&1; head -45 "$OUT/profile1_mla.txt") ;;
    mlasplit) timeout 300 python3 -m benchmarks.mla_decode --splits 2>&1 | tee "$OUT/mla_splits.txt" | tail -90 ;;
    vsite)  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/vsite \
              .whl2/*.whl 2>&1 | tail -2  # transformers 5.5.3 pins tokenizers <= 0.23.0; the image has 0.23.2
            sed -i 's/"tokenizers>=0.22.0,<=0.23.0"/"tokenizers>=0.22.0"/' /tmp/vsite/transformers/dependency_versions_table.py
            PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} python3 -c "import transformers, vllm.model_executor.models.llava_next; print('vLLM LLaVA path imports with transformers', transformers.__version__)" 2>&1 | tail -1 ;;
    mmrender) timeout 300 python3 -m benchmarks.mm_render --model-dir /tmp/llava-next-7b --threads 1,4,8 \
              --json "$OUT/mm_render.json" 2>&1 | tail -16 ;;
    mmv)    M=/tmp/llava-next-7b; python3 -m benchmarks.mm_serve --write-model $M > /dev/null  # issue 15: vLLM's half
            PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} python3 -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
              --max-model-len 4096 --host 127.0.0.1 --port 8011 > "$OUT/vllm_mm.log" 2>&1 & VP=$!
            for i in $(seq 200); do curl -sf http://127.0.0.1:8011/health > /dev/null && break
              kill -0 $VP 2> /dev/null || { echo "vLLM server exited:"; grep -i error "$OUT/vllm_mm.log" | tail -5; break; }; sleep 2; done
            echo "--- vLLM 0.26 (ready after ~$((i * 2)) s)"; timeout 300 python3 -m benchmarks.mm_serve --url http://127.0.0.1:8011 \
              --num-requests ${MM_REQUESTS:-128} 2>&1 | tail -12
            kill $VP 2> /dev/null; wait $VP 2> /dev/null ;;
    mmvllm) M=/tmp/llava-next-7b; python3 -m benchmarks.mm_serve --write-model $M > /dev/null  # issue 15: vLLM, then us
            PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} python3 -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
              --max-model-len 4096 --host 127.0.0.1 --port 8011 > "$OUT/vllm_mm.log" 2>&1 & VP=$!
            # stop waiting as soon as the server process is gone (a missing module used to cost the whole wait)
            for i in $(seq 200); do curl -sf http://127.0.0.1:8011/health > /dev/null && break
              kill -0 $VP 2> /dev/null || { echo "vLLM server exited:"; tail -5 "$OUT/vllm_mm.log"; break; }; sleep 2; done
            echo "--- vLLM 0.26 (ready after ~$((i * 2)) s)"; timeout 300 python3 -m benchmarks.mm_serve --url http://127.0.0.1:8011 2>&1 | tail -12
            kill $VP; wait $VP 2> /dev/null; echo "--- kestrel"
            timeout 300 python3 -m benchmarks.mm_serve --model-dir $M --server-log "$OUT/kestrel_mm.log" 2>&1 | tail -12 ;;
    mmprof) M=/tmp/llava-next-7b; python3 -m benchmarks.mm_serve --write-model $M > /dev/null  # issue 15: where time goes
            timeout 300 python3 -m benchmarks.mm_profile --model-dir $M 2>&1 | grep -v Warning | tee "$OUT/mm_profile.txt" | tail -12 ;;
    mmkw)   M=/tmp/llava-next-7b; python3 -m benchmarks.mm_serve --write-model $M > /dev/null  # images: processes vs threads
            for n in 0 8; do echo "--- --image-render-processes $n"
              timeout 200 python3 -m benchmarks.mm_serve --model-dir $M --server-log "$OUT/kestrel_mm_p$n.log" --num-requests ${MM_REQUESTS:-128} \
                --server-args "--load-format dummy --max-model-len 4096 --image-render-processes $n" 2>&1 | tail -10; done ;;
    mmspy)  bash benchmarks/mm_spy.sh 2>&1 | tail -16 ;;  # issue 15: py-spy of frontend, engine core and client
    mmk)    M=/tmp/llava-next-7b; python3 -m benchmarks.mm_serve --write-model $M > /dev/null  # issue 15: our half only
            timeout 300 python3 -m benchmarks.mm_serve --model-dir $M --server-log "$OUT/kestrel_mm.log" 2>&1 | tail -12 ;;
    mlak)   timeout 200 python3 -m benchmarks.mla_decode 2>&1 | tee "$OUT/mla_decode.txt" | tail -14 ;;
    mlapre) timeout 300 python3 -m benchmarks.mla_prefill 2>&1 | tee "$OUT/mla_prefill.txt" | tail -6 ;;
    multigpu1) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # as set there
            if ((NGPU < 2)); then echo "--- multigpu1 needs 2 GPUs, found $NGPU"; continue; fi
            run_capped 240 python3 -m pytest -q -rs -p no:cacheprovider tests/gpu/test_gpu_tensor_parallel.py 2>&1 \
              | tee "$OUT/tp_tests.log" | tail -8
            for tp in 1 2; do
              echo "--- llama-8b TP $tp"
              run_capped 150 python3 -m benchmarks.throughput --shape llama-8b --hf-requests 0 --tensor-parallel-size $tp \
                --json "$OUT/tput8b_tp$tp.json" 2>&1 | tee "$OUT/tput8b_tp$tp.log" | grep -v Warning | tail -26
              run_capped 120 python3 -m benchmarks.latency --shape llama-8b --hf-output-len 0 --tensor-parallel-size $tp \
                --json "$OUT/lat8b_tp$tp.json" 2>&1 | tee "$OUT/lat8b_tp$tp.log" | tail -5
            done
            echo "--- qwen3-30b-a3b TP 2"
            run_capped 200 python3 -m benchmarks.throughput --shape qwen3-30b-a3b --hf-requests 0 --tensor-parallel-size 2 \
              --max-model-len 4096 --json "$OUT/tput_moe_tp2.json" 2>&1 | tee "$OUT/tput_moe_tp2.log" | grep -v Warning \
              | tail -26 ;;
    multigpu2|multigpu3) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
            tp=$([ $s = multigpu2 ] && echo 4 || echo 8)
            if [ $s = multigpu3 ]; then :; elif ((NGPU < 2)); then echo "--- data parallel 2 needs 2 GPUs"; else
              run_capped 200 python3 -m benchmarks.dp_throughput --shape llama-8b --data-parallel-size 2 \
                --json "$OUT/dp2_8b.json" 2>&1 | tee "$OUT/dp2_8b.log" | grep -v "INFO\|Warning" | tail -9
            fi
            if ((NGPU < tp)); then echo "--- llama-70b TP $tp needs $tp GPUs, found $NGPU"; else
              echo "--- llama-70b TP $tp"
              run_capped 240 python3 -m benchmarks.throughput --shape llama-70b --hf-requests 0 --tensor-parallel-size $tp \
                --max-model-len 4096 --json "$OUT/tput70b_tp$tp.json" 2>&1 | tee "$OUT/tput70b_tp$tp.log" \
                | grep -v Warning | tail -26
              run_capped 150 python3 -m benchmarks.latency --shape llama-70b --hf-output-len 0 --tensor-parallel-size $tp \
                --max-model-len 4096 --json "$OUT/lat70b_tp$tp.json" 2>&1 | tee "$OUT/lat70b_tp$tp.log" | tail -5
            fi ;;
    vllmtp) export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
            if ((NGPU < 2)); then echo "--- vllmtp needs 2 GPUs, found $NGPU"; continue; fi
            PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} run_capped 560 python3 -m benchmarks.vllm_peer --shape llama-8b \
              --tensor-parallel-size 2 --json "$OUT/vllm_8b_tp2.json" 2>&1 | tee "$OUT/vllm_8b_tp2.log" | grep -v Warning \
              | tail -8 ;;
    vllmmoe) PYTHONPATH=/tmp/vsite:${PYTHONPATH:-} timeout 560 python3 -m benchmarks.vllm_peer --shape qwen3-30b-a3b --json "$OUT/vllm_moe.json" 2>&1 | grep -v Warning | tail -8 ;;
  esac
done
echo "=== done $(date +%T)"
