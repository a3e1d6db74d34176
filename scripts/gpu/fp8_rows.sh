#!/usr/bin/env bash
# On the GPU machine (carry .gpu/src, .gpu/wheels and .gpu/cache_qwen3_fp8, after scripts/gpu/prepare_sweeps.sh
# here): issue 38's FP8 rows on the Qwen3-4B shape: `bench decode` with FP8 weights and with bf16 beside them, FP8
# prefill TTFT 1k/4k/8k, decode with FP8 weights and an FP8 KV cache, then a server with both started and asked one
# completion. A part that hangs is stopped by SIGABRT, whose faulthandler traceback (every thread) lands in its log.
#   PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3_fp8 bash scripts/gpu/fp8_rows.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
export PEGAINFER_SRC=${PEGAINFER_SRC:-$PWD/.gpu/src}
. scripts/gpu/env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/wheels/*.whl || exit 1
export PYTHONPATH=$PYTHONPATH:/tmp/site  # the server's HTTP stack
bench() { timeout -s ABRT "$1" python3 -X faulthandler -m pegainfer.cli bench "${@:2}" 2>&1 | grep -v "loading weights"; }
bench 120 decode qwen3-4b --quantization fp8 --kv-cache-dtype fp8 --batch 1,64 --context 128 | tee "$OUT/fp8kv_decode.txt"
serve_fp8kv() {  # a server with both, asked one completion once ready (or its exit noted)
    [ -f /tmp/qwen3-4b-random/config.json ] || python3 scripts/gpu/random_checkpoint.py qwen3-4b /tmp/qwen3-4b-random
    timeout -s ABRT 100 python3 -X faulthandler -m pegainfer.cli serve --model-path /tmp/qwen3-4b-random --device cuda \
        --port 8000 --served-model-name qwen3-4b --quantization fp8 --kv-cache-dtype fp8 >"$OUT/fp8kv_serve.log" 2>&1 &
    local pid=$!
    python3 - "$pid" <<'PY' | tee "$OUT/fp8kv_request.txt"
import os, sys, time, httpx
pid = int(sys.argv[1])
for _ in range(240):
    try:
        if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
            body = {"model": "qwen3-4b", "prompt": "a b c", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            print(httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=60).json())
            break
    except httpx.TransportError:
        pass
    if not os.path.exists(f"/proc/{pid}"):
        print("the server exited before it was ready")
        break
    time.sleep(0.5)
PY
    kill "$pid" 2>/dev/null; wait "$pid"
    grep -v "loading weights" "$OUT/fp8kv_serve.log" | tail -60
}
# a server over an engine that hangs would hang too
grep -q 'ms/step' "$OUT/fp8kv_decode.txt" && serve_fp8kv
bench 120 decode qwen3-4b --quantization fp8 --batch 1,16,64 --context 128,1024 | tee "$OUT/fp8_decode.txt"
bench 80 decode qwen3-4b --batch 1,16,64 --context 128,1024 | tee "$OUT/bf16_decode.txt"
bench 80 prefill qwen3-4b --quantization fp8 --prompt-len 1024,4096,8192 | tee "$OUT/fp8_prefill.txt"
