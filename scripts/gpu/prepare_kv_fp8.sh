#!/usr/bin/env bash
# Prepares scripts/gpu/kv_fp8_check.py on this (CPU) machine, under .gpu/ (git-ignored): a small random bf16 Qwen3
# checkpoint (logits spread 2, as the gate's), the sm_90 cubins of it and of the Qwen3-4B shape with a bf16 and an
# FP8 KV cache, and .gpu/cache_kv_fp8, the per-call cache holding just those. Then on the H200 (kv_fp8_check.py's
# docstring gives the carry).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SHAPE="--set hidden_size=256 --set intermediate_size=768 --set num_hidden_layers=4 --set num_attention_heads=8
       --set num_key_value_heads=2 --set head_dim=64 --set vocab_size=1000"
rm -rf .gpu/small_kv
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_kv --dtype bfloat16 --seed 3 --logit-std 2 $SHAPE
for kv in auto fp8; do
    "$PY" -m pegainfer.cli compile .gpu/small_kv --kv-cache-dtype $kv --sm 90 --cache-dir .gpu/aot_cache
    "$PY" -m pegainfer.cli compile qwen3-4b --kv-cache-dtype $kv --sm 90 --cache-dir .gpu/aot_cache
done
rm -rf .gpu/cache_kv_fp8
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_kv_fp8 'Qwen3ForCausalLM-*'
du -sh .gpu/cache_kv_fp8
