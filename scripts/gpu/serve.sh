#!/usr/bin/env bash
# On the GPU machine (device tool, carry [".gpu"]), after scripts/gpu/prepare.sh and scripts/gpu/serve_wheels.sh
# here. `bash scripts/gpu/serve.sh pegainfer`: a greedy completion through `pegainfer serve --device cuda` equal to
# `pegainfer generate --device cuda` on the small checkpoint (where .gpu/small was carried; SMALL=0 skips it);
# start-up to HTTP ready (second start: warm cubins and page cache) and idle resident memory of a full-size random
# model, from the server's own /metrics; then `pegainfer bench serve` at each concurrency of $CONC (its own prompts:
# seed = concurrency, so no level hits the prefix cache that an earlier one filled), with the server's step trace
# (--trace-steps) summarised per concurrency; $SERVE_FLAGS go to that server; $SGLANG_CONC: the same load from
# SGLang's client too (its bench_serving.py, from serve_wheels.sh's wheel). `bash scripts/gpu/serve.sh hf`: the same
# request stream against `transformers serve --continuous-batching`, each concurrency cut off after $HF_LIMIT seconds.
# The model: MODEL_CONFIG, an embedded config (default qwen3-4b; qwen3.5-4b, deepseek-v2-lite, ... compiled here
# first: `pegainfer compile NAME --sm 90`), written there as /tmp/NAME-random by scripts/gpu/random_checkpoint.py
# (bench's random weights, seconds; MAKER=hf: `make-checkpoint`, transformers' init with logits spread 2, as every
# sweep before 2026-12-06 was run, Qwen3 configs only, 77 s for 4B). The checkpoint's tokenizer has one word per id,
# so every token streams as text and TTFT is the first token's. LABEL (default the config's name) names the reports
# and logs, under /tmp/serve_<LABEL> and, as one tarball, $OUT/serve_<LABEL>.tgz (the device tool brings back 8
# files at most); the tables print last.
set -uo pipefail
cd "$(dirname "$0")/../.."
TARGET=${1:-pegainfer}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl || exit 1
. scripts/gpu/env.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site  # the serving packages the image lacks, installed above
MODEL_CONFIG=${MODEL_CONFIG:-qwen3-4b}; LABEL=${LABEL:-$MODEL_CONFIG}
[ "$TARGET" = pegainfer ] || LABEL=$TARGET
keep_work "/tmp/serve_$LABEL" "serve_$LABEL.tgz"
CONC=${CONC:-"1 8 32 64 128"}; INPUT_LEN=${INPUT_LEN:-1024}; OUTPUT_LEN=${OUTPUT_LEN:-128}
MODEL=/tmp/$MODEL_CONFIG-random
ready() {  # waits for $1/health, up to 10 minutes, while the server ($pid) lives: one that exits fails at once
    python3 - "$1" "$pid" <<'PY'
import os, sys, time, httpx
for _ in range(1200):
    try:
        if httpx.get(sys.argv[1] + "/health", timeout=2).status_code == 200:
            sys.exit(0)
    except httpx.TransportError:
        pass
    if not os.path.exists(f"/proc/{sys.argv[2]}"):
        sys.exit(1)
    time.sleep(0.5)
sys.exit(1)
PY
}
metric() { python3 -c "import sys, httpx; print(next(l.split()[-1] for l in httpx.get(sys.argv[1] + '/metrics').text.splitlines() if l.startswith(sys.argv[2] + '{')))" "$1" "$2"; }
sweep() {  # $1: base URL, $2: model name, $3: report prefix, $4: seconds allowed per concurrency, $5: extra flags
    for c in $CONC; do
        n=$(( c * 2 > 16 ? c * 2 : 16 ))
        first=1; [ -f "$WORK/trace.jsonl" ] && first=$(( $(wc -l <"$WORK/trace.jsonl") + 1 ))
        timeout "$4" python3 -m pegainfer.cli bench serve --base-url "$1" --model "$2" --tokenizer "$MODEL" \
            --input-len "$INPUT_LEN" --output-len "$OUTPUT_LEN" --num-prompts "$n" --max-concurrency "$c" \
            --seed "$c" ${5:-} --result-file "$WORK/$3_c$c.json" >>"$WORK/$3_bench.log" 2>&1 \
            || echo "c=$c: bench exit $?" | tee -a "$WORK/$3_bench.log"
        [ -f "$WORK/trace.jsonl" ] && tail -n +"$first" "$WORK/trace.jsonl" >"$WORK/trace_c$c.jsonl"
    done
    python3 - "$WORK" "$3" $CONC <<'PY'
import json, sys
from pathlib import Path
work, prefix = Path(sys.argv[1]), sys.argv[2]
print(f"{'conc':>5} {'done':>9} {'dur_s':>7} {'out_tok/s':>9} {'ttft_ms':>8} {'p99ttft':>8} {'tpot_ms':>8} "
      f"{'itl_ms':>7}")
for c in sys.argv[3:]:
    path = work / f"{prefix}_c{c}.json"
    if not path.is_file():
        print(f"{c:>5} no report (cut off)")
        continue
    r = json.loads(path.read_text())
    v = {k: r.get(k) or 0.0 for k in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms")}
    print(f"{c:>5} {r['completed']:>4}/{r['num_prompts']:<4} {r['duration_s']:7.2f} {r['output_throughput']:9.0f} "
          f"{v['mean_ttft_ms']:8.0f} {v['p99_ttft_ms']:8.0f} {v['mean_tpot_ms']:8.2f} {v['mean_itl_ms']:7.2f}")
PY
    if [ -f "$WORK/trace.jsonl" ]; then
        python3 scripts/gpu/trace_summary.py "$WORK/trace.jsonl" --label all --header
        for c in $CONC; do python3 scripts/gpu/trace_summary.py "$WORK/trace_c$c.jsonl" --label "c$c"; done
    fi
}
sglang_sweep() {  # SGLang's benchmark client (bench_serving.py of its 0.4.6.post5 wheel, run as a script) at each
    # concurrency of $SGLANG_CONC, on the same stream: random token ids, 1024 in, 128 out, ignore_eos
    for c in $SGLANG_CONC; do
        n=$(( c * 2 > 16 ? c * 2 : 16 ))
        timeout "${SERVE_LIMIT:-240}" python3 /tmp/site/sglang/bench_serving.py --backend vllm --base-url "$1" \
            --model "$2" --tokenizer "$MODEL" --dataset-name random-ids --random-input-len "$INPUT_LEN" \
            --random-output-len "$OUTPUT_LEN" --random-range-ratio 1.0 --num-prompts "$n" --max-concurrency "$c" \
            --seed "$c" --disable-tqdm --output-file "$WORK/sglang.jsonl" >>"$WORK/sglang_bench.log" 2>&1 \
            || echo "c=$c: sglang client exit $?" | tee -a "$WORK/sglang_bench.log"
    done
    [ -f "$WORK/sglang.jsonl" ] || { echo "sglang client: no results (see sglang_bench.log)"; return; }
    python3 - "$WORK/sglang.jsonl" <<'PY'
import json, sys
print(f"{'sglang client':>13} {'conc':>5} {'done':>5} {'out_tok/s':>9} {'ttft_ms':>8} {'tpot_ms':>8} {'tpot_p50':>8}")
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{'':>13} {r['max_concurrency']:>5} {r['completed']:>5} {r['output_throughput']:9.0f} "
          f"{r['mean_ttft_ms']:8.0f} {r['mean_tpot_ms']:8.2f} {r['median_tpot_ms']:8.2f}")
PY
}
if [ ! -f "$MODEL/config.json" ] && [ "${MAKER:-fast}" = hf ]; then
    SHAPE=$(python3 -c "import json; c = json.load(open('models/configs/$MODEL_CONFIG.json')); print(' '.join(f'--set {k}={json.dumps(c[k])}' for k in ('hidden_size', 'intermediate_size', 'num_hidden_layers', 'num_attention_heads', 'num_key_value_heads', 'head_dim', 'vocab_size', 'tie_word_embeddings', 'rope_theta', 'max_position_embeddings')))")
    pg make-checkpoint "$MODEL" --dtype bfloat16 --logit-std 2 --tokenizer words $SHAPE
elif [ ! -f "$MODEL/config.json" ]; then
    python3 scripts/gpu/random_checkpoint.py "$MODEL_CONFIG" "$MODEL" 2>&1 | tee "$WORK/checkpoint.txt"
fi
if [ "$TARGET" = hf ]; then
    transformers serve "$MODEL" --continuous-batching --device cuda:0 --dtype bfloat16 --host 127.0.0.1 \
        --port 8001 >"$WORK/hf_serve.log" 2>&1 &
    pid=$!
    ready http://127.0.0.1:8001 || { echo "transformers serve did not start"; tail -30 "$WORK/hf_serve.log"; }
    sweep http://127.0.0.1:8001 "$MODEL" hf "${HF_LIMIT:-120}" --no-ignore-eos  # it refuses ignore_eos (HTTP 422)
    kill $pid; wait $pid
    exit 0
fi
if [ "${SMALL:-1}" != 0 ] && [ -d .gpu/small ]; then
echo "== greedy through the server against generate, small checkpoint"
pg generate --model-path .gpu/small --prompt "The inference server" --max-tokens 12 --ignore-eos --device cuda --json \
    | tee "$WORK/serve_generate.json"
# python3 itself in the background (not the pg function, whose subshell a kill would leave the server behind), and
# a small share of the GPU: a server takes --gpu-memory-utilization of the device for its KV cache
python3 -m pegainfer.cli serve --model-path .gpu/small --device cuda --port 8000 --served-model-name small \
    --gpu-memory-utilization 0.2 >"$WORK/serve_small.log" 2>&1 &
pid=$!
ready http://127.0.0.1:8000 && python3 - <<'PY' | tee "$WORK/serve_small.json"
import json, os, httpx
body = {"model": "small", "prompt": "The inference server", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
result = httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=120).json()
expected = json.load(open(os.environ["WORK"] + "/serve_generate.json"))
print(json.dumps({"server_text": result["choices"][0]["text"], "generate_text": expected["text"],
                  "equal": result["choices"][0]["text"] == expected["text"], "usage": result["usage"]}))
PY
kill $pid; wait $pid
fi
STARTS=${STARTS:-first second}
for start in $STARTS; do
    echo "== $LABEL ($MODEL_CONFIG shape${SERVE_FLAGS:+, $SERVE_FLAGS}): $start start"
    python3 -m pegainfer.cli serve --model-path "$MODEL" --device cuda --port 8000 --served-model-name "$MODEL_CONFIG" \
        --max-num-seqs "${MAX_NUM_SEQS:-256}" ${SERVE_FLAGS:-} --trace-steps "$WORK/trace.jsonl" >"$WORK/serve_$start.log" 2>&1 &
    pid=$!
    ready http://127.0.0.1:8000 || { tail -30 "$WORK/serve_$start.log"; exit 1; }
    sleep 2
    echo "startup_seconds $(metric http://127.0.0.1:8000 pegainfer:startup_seconds)" \
         "resident_bytes_idle $(metric http://127.0.0.1:8000 process_resident_memory_bytes)" \
         "kv_blocks $(metric http://127.0.0.1:8000 pegainfer:kv_blocks_total)" | tee -a "$WORK/serve_startup.txt"
    [ "$start" = "${STARTS##* }" ] || { kill $pid; wait $pid; }
done
sweep http://127.0.0.1:8000 "$MODEL_CONFIG" serve "${SERVE_LIMIT:-240}"
[ -z "${SGLANG_CONC:-}" ] || sglang_sweep http://127.0.0.1:8000 "$MODEL_CONFIG"
curl -s http://127.0.0.1:8000/metrics >"$WORK/serve_metrics.txt" 2>/dev/null || true
kill $pid; wait $pid
