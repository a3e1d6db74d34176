#!/usr/bin/env bash
# Prepares scripts/gpu/w8a8_check.py (and fp8_check.py's small FP8 checkpoints, with the W8A8 prefill tile) on this
# CPU machine: the sm_90 cubins of the Qwen3-4B shape in bf16, with FP8 weights in 128 x 128 blocks (qwen3-4b-fp8)
# and with --quantization fp8 (a scale per channel), and of the small FP8 checkpoints prepare_fp8.sh wrote; then
# .gpu/cache_w8a8, the per-call cache holding just those.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
"$PY" -m pegainfer.cli compile qwen3-4b --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile qwen3-4b-fp8 --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile qwen3-4b --quantization fp8 --sm 90 --cache-dir .gpu/aot_cache
for form in block channel; do
    "$PY" -m pegainfer.cli compile .gpu/small_fp8_$form --sm 90 --cache-dir .gpu/aot_cache
done
rm -rf .gpu/cache_w8a8
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_w8a8 'Qwen3ForCausalLM-*'
du -sh .gpu/cache_w8a8
