#!/usr/bin/env bash
# On the GPU machine, after run.sh's setup: `pegainfer generate --device cuda` on the small checkpoint, then
# start-up (process start to first token, cubins cached, weights in the page cache on the second run) and peak
# resident memory for a full-size random Qwen3-4B checkpoint written there.
set -uo pipefail
cd "$(dirname "$0")/../.."
. scripts/gpu/env.sh
pg generate --model-path .gpu/small --prompt "The inference server" --max-tokens 12 --device cuda --json
pg generate --model-path .gpu/small --prompt "The inference server" --max-tokens 12 --device cpu --json
SHAPE=$(python3 -c "import json; c = json.load(open('models/configs/qwen3-4b.json')); print(' '.join(f'--set {k}={json.dumps(c[k])}' for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'head_dim', 'vocab_size', 'tie_word_embeddings', 'rope_theta', 'max_position_embeddings')))")
time pg make-checkpoint /tmp/qwen3-4b-random --dtype bfloat16 --logit-std 2 $SHAPE
for run in cold warm; do
    echo "== start-up, $run page cache"
    /usr/bin/time -v python3 -m pegainfer.cli generate --model-path /tmp/qwen3-4b-random --prompt-ids 1,2,3,4 \
        --max-tokens 1 --device cuda 2>&1 | grep -E "Elapsed|Maximum resident|tokens on|loaded|error"
done
