#!/usr/bin/env bash
# Prepares scripts/gpu/sweeps.sh on this CPU machine, under .gpu/ (git-ignored): .gpu/src, the tree of one commit
# ($COMMIT, default HEAD; `git archive`, so the run measures that commit and not a working tree others are
# editing), the sm_90 cubins that tree compiles for Qwen3.5-4B and DeepSeek-V2-Lite (.gpu/cache_models) and for
# the Qwen3-4B shape in bf16, with --quantization fp8 and with an FP8 KV cache too (.gpu/cache_qwen3_fp8), each a
# per-call cache of just those manifests (the device tool carries 64 MB), and the serving wheels without SGLang's
# client, with xgrammar's (.gpu/wheels, .gpu/xg). The content-addressed .gpu/aot_cache is kept between runs.
# JOBS (default 2) compiler processes; QWEN3_ONLY=1 stops after the Qwen3-4B shapes (their cache also holds
# the LoRA and EAGLE-3 manifests scripts/gpu/features_bench.py runs). sweeps.sh's header gives the device calls.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
COMMIT=$(git rev-parse --short "${COMMIT:-HEAD}")
if [ "$(cat .gpu/src/COMMIT 2>/dev/null)" != "$COMMIT" ]; then
    rm -rf .gpu/src && mkdir -p .gpu/src
    git archive "$COMMIT" | tar x -C .gpu/src
    echo "$COMMIT" >.gpu/src/COMMIT
fi
mkdir -p /tmp/pkg_sweeps && ln -sfn "$PWD/.gpu/src" /tmp/pkg_sweeps/pegainfer
export PYTHONPATH=/tmp/pkg_sweeps  # the snapshot, not the editable install of the working tree
compile() { nice "$PY" -m pegainfer.cli compile "$@" --sm 90 --cache-dir .gpu/aot_cache --jobs "${JOBS:-2}"; }
compile qwen3-4b
compile qwen3-4b --enable-lora --max-loras 8 --max-lora-rank 16  # scripts/gpu/features_bench.py
compile qwen3-4b --quantization fp8
compile qwen3-4b --quantization fp8 --kv-cache-dtype fp8
compile qwen3-4b-fp8  # scripts/gpu/fp8_gate.py's 128 x 128 blocks
HEAD=$("$PY" scripts/gpu/features_bench.py head-config .gpu/eagle3)  # features_bench.py eagle3's head, its config
compile qwen3-4b --speculative-config "{\"method\": \"eagle3\", \"num_speculative_tokens\": 2, \"model\": \"$HEAD\"}"
rm -rf .gpu/cache_qwen3_fp8
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_qwen3_fp8 'Qwen3ForCausalLM-*' 'LlamaForCausalLMEagle3-*'
SGLANG=0 XGRAMMAR=1 bash scripts/gpu/serve_wheels.sh
[ -n "${QWEN3_ONLY:-}" ] && exit 0
compile qwen3.5-4b
compile qwen3.5-4b --speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'  # features_bench.py mtp
compile deepseek-v2-lite
rm -rf .gpu/cache_models
"$PY" scripts/gpu/slim_cache.py .gpu/aot_cache .gpu/cache_models 'Qwen3_5ForConditionalGeneration-*' \
    'DeepseekV2ForCausalLM-*'
du -sh .gpu/src .gpu/cache_models .gpu/cache_qwen3_fp8 .gpu/wheels .gpu/xg
