#!/usr/bin/env bash
# Prepares scripts/gpu/fp8_check.py on this (CPU) machine, under .gpu/ (git-ignored): small random FP8 Qwen3
# checkpoints of both formats (logits spread 2, as the gate's), their bf16 dequantized copies for Hugging Face, the
# sm_90 cubins of them and of the Qwen3-4B shape with bf16 and with --quantization fp8 weights, and .gpu/cache_fp8,
# the per-call cache holding just those. Then on the H200 (fp8_check.py's docstring gives the carry):
#   PYTHONPATH=$PYTHONPATH:scripts/gpu PEGAINFER_CACHE=$PWD/.gpu/cache_fp8 python3 scripts/gpu/fp8_check.py --out $OUT/fp8
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
SHAPE="--set hidden_size=256 --set intermediate_size=768 --set num_hidden_layers=4 --set num_attention_heads=8
       --set num_key_value_heads=2 --set head_dim=64 --set vocab_size=1000"
for form in block channel; do
    rm -rf .gpu/small_fp8_$form .gpu/small_fp8_${form}_hf
    "$PY" -m pegainfer.cli make-checkpoint .gpu/small_fp8_$form --dtype bfloat16 --seed 3 --logit-std 2 \
        --quantization fp8-$form $SHAPE
    "$PY" scripts/gpu/dequantized_copy.py .gpu/small_fp8_$form .gpu/small_fp8_${form}_hf
    "$PY" -m pegainfer.cli compile .gpu/small_fp8_$form --sm 90 --cache-dir .gpu/aot_cache
done
"$PY" -m pegainfer.cli compile qwen3-4b --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile qwen3-4b --quantization fp8 --sm 90 --cache-dir .gpu/aot_cache
rm -rf .gpu/cache_fp8
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_fp8 'Qwen3ForCausalLM-*'
du -sh .gpu/cache_fp8
