#!/usr/bin/env bash
# Prepares the GPU checks on this (CPU) machine, under .gpu/ (git-ignored): small random bf16 Qwen3 checkpoints,
# the sm_90 cubins of them (Triton) and of the full-size Qwen3-4B config (every installed backend, so the sm_90
# default, TileLang for prefill, is what runs), compiled into .gpu/aot_cache (content-addressed: kept from one
# preparation to the next), and .gpu/cache_qwen3, the per-call cache holding just those manifests and cubins (the
# device tool carries 64 MB). Then on the H200, one call each (docs/BENCHMARKS.md gives the last results):
#   carry [".gpu/small", ".gpu/small_soft", ".gpu/cache_qwen3"]:
#       PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 bash scripts/gpu/run.sh
#   carry [".gpu/small", ".gpu/cache_qwen3", ".gpu/wheels"] (after scripts/gpu/serve_wheels.sh):
#       PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 bash scripts/gpu/serve.sh pegainfer   (or: serve.sh hf)
#   carry [".gpu/cache_qwen3"]:  PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 bash lab/tune_run.sh
#   carry two caches (one compiled before a kernel change, one after): bash lab/decode_ab.sh A B
#   carry [".gpu/cache_qwen3"]:  PEGAINFER_CACHE=$PWD/.gpu/cache_qwen3 python3 scripts/gpu/step_profile.py qwen3-4b \
#       --batch 1 4 16 --out $OUT/prof   (where a decode step's time goes, kernel by kernel; source env.sh first)
# and, after scripts/gpu/prepare_archs.sh, the other architectures' gate (see there).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu/small .gpu/small_soft && mkdir -p .gpu
SHAPE="--set hidden_size=256 --set intermediate_size=704 --set num_hidden_layers=4 --set num_attention_heads=8
       --set num_key_value_heads=2 --set head_dim=64 --set vocab_size=1000"
"$PY" -m pegainfer.cli make-checkpoint .gpu/small --dtype bfloat16 --seed 3 $SHAPE
# The same shape with logits spread 2 instead of 6: bf16 logits of magnitude ~15 carry a rounding step of 0.06,
# the size of the gate's mean |delta logprob| bound, so the gate is also run where logits are smaller.
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_soft --dtype bfloat16 --seed 3 --logit-std 2 $SHAPE
"$PY" -m pegainfer.cli compile .gpu/small --sm 90 --cache-dir .gpu/aot_cache --backends triton
"$PY" -m pegainfer.cli compile qwen3-4b --sm 90 --cache-dir .gpu/aot_cache  # minutes when TileLang's are cold
rm -rf .gpu/cache_qwen3
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_qwen3 'Qwen3ForCausalLM-*'
du -sh .gpu/cache_qwen3
