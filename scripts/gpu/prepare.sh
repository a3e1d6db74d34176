#!/usr/bin/env bash
# Prepares a GPU session on this (CPU) machine: a small random bf16 Qwen3 checkpoint and the sm_90 cubins of it
# and of the full-size Qwen3-4B config, all under .gpu/ (git-ignored; the device tool carries it). Then run on
# the H200, in one call, with carry [".gpu"]:
#   bash scripts/gpu/run.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
rm -rf .gpu/small .gpu/small_soft && mkdir -p .gpu  # the cubin cache is content-addressed: kept
SHAPE="--set hidden_size=256 --set intermediate_size=704 --set num_hidden_layers=4 --set num_attention_heads=8
       --set num_key_value_heads=2 --set head_dim=64 --set vocab_size=1000"
"$PY" -m pegainfer.cli make-checkpoint .gpu/small --dtype bfloat16 --seed 3 $SHAPE
# The same shape with logits spread 2 instead of 6: bf16 logits of magnitude ~15 carry a rounding step of 0.06,
# the size of the gate's mean |delta logprob| bound, so the gate is also run where logits are smaller.
"$PY" -m pegainfer.cli make-checkpoint .gpu/small_soft --dtype bfloat16 --seed 3 --logit-std 2 $SHAPE
for model in .gpu/small .gpu/small_soft qwen3-4b; do
    "$PY" -m pegainfer.cli compile "$model" --sm 90 --cache-dir .gpu/aot_cache --backends triton
done
du -sh .gpu
