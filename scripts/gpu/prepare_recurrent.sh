#!/usr/bin/env bash
# Prepares scripts/gpu/recurrent_check.py on this CPU machine: small random Qwen3.5 and Qwen3.5-MoE checkpoints
# (.gpu/small_q35, .gpu/small_q35_moe, bf16), the sm_90 cubins of them and of the Qwen3.5-4B shape, and
# .gpu/cache_q35, the per-call cache holding just those. On the device: python3 scripts/gpu/recurrent_check.py
# --small .gpu/small_q35 --out $OUT, with PEGAINFER_CACHE=.gpu/cache_q35 (carry the three folders).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_q35 --arch Qwen3_5ForCausalLM --dtype bfloat16
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_q35_moe --arch Qwen3_5MoeForCausalLM --dtype bfloat16
"$PY" -m pegainfer.cli compile .gpu/small_q35 --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile .gpu/small_q35_moe --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile qwen3.5-4b --sm 90 --cache-dir .gpu/aot_cache
rm -rf .gpu/cache_q35
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_q35 'Qwen3_5*'
du -sh .gpu/cache_q35
