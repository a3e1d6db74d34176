#!/usr/bin/env bash
# Prepares scripts/gpu/latent_check.py on this CPU machine: small random DeepSeek-V2 and V3 checkpoints
# (.gpu/small_dsv2, .gpu/small_dsv3, bf16; .gpu/small_dsv3_fp8 in block-scaled FP8 with its bf16 copy for Hugging
# Face), the sm_90 cubins of them and of the DeepSeek-V2-Lite shape, and
# .gpu/cache_latent, the per-call cache holding just those. On the device: python3 scripts/gpu/latent_check.py
# --out $OUT, with PEGAINFER_CACHE=.gpu/cache_latent (carry the three folders).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_dsv2 --arch DeepseekV2ForCausalLM --dtype bfloat16
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_dsv3 --arch DeepseekV3ForCausalLM --dtype bfloat16
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_dsv3_fp8 --arch DeepseekV3ForCausalLM --dtype bfloat16 \
    --quantization fp8-block
rm -rf .gpu/small_dsv3_fp8_bf16
"$PY" scripts/gpu/dequantized_copy.py .gpu/small_dsv3_fp8 .gpu/small_dsv3_fp8_bf16
"$PY" -m pegainfer.cli compile .gpu/small_dsv3_fp8 --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile .gpu/small_dsv2 --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile .gpu/small_dsv3 --sm 90 --cache-dir .gpu/aot_cache
"$PY" -m pegainfer.cli compile deepseek-v2-lite --sm 90 --cache-dir .gpu/aot_cache
rm -rf .gpu/cache_latent
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_latent 'Deepseek*'
du -sh .gpu/cache_latent
